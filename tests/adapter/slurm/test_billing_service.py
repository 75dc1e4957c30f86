"""The service reads each partition's TRESBillingWeights from the controller's slurm.conf
(service.slurm_conf): a GPU job whose shards would not bill its fraction of the GPU there keeps its
request (shards_unbilled), and one whose shards would is shared as before; on 22.05 a whole GPU is
held as shards only where all of them bill what the GPU bills."""
import logging
from pathlib import Path

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.serving.client import PolicyClient
from policy_service.config import load_config
from policy_service.serving.server import start_service

GRES = ("Name=gpu Type=a100 File=/dev/nvidia[0-1]\nName=gpu Type=h100 File=/dev/nvidia[2-3]\n"
        "Name=shard Count=4 File=/dev/nvidia0\nName=shard Count=4 File=/dev/nvidia1\n"
        "Name=shard Count=8 File=/dev/nvidia2\nName=shard Count=8 File=/dev/nvidia3\n")  # 40, 48, 80, 80 GiB


def _facts(partition: str, gres: str = "gres:gpu:1", hint: str = "swapaware:mem=2G") -> pb.JobFacts:
    return pb.JobFacts(user="alice", uid=1000, job_name="train", tres_per_node=gres, partition=partition,
                       script_fingerprint="00000001deadbeef", comment=hint)


def test_a_job_keeps_its_request_where_its_partitions_weights_would_not_bill_its_shards(service_env, slurm_jobs,
                                                                                       caplog):
    conf = Path(service_env["SWAPAWARE_SERVICE__SLURM_CONF"])
    conf.write_text("NodeName=n1 CPUs=8 Gres=gpu:a100:2,gpu:h100:2,shard:24\n"
                    'PartitionName=billed Nodes=n1 Default=YES TRESBillingWeights="CPU=1.0,GRES/gpu=8,GRES/shard=1"\n'
                    "PartitionName=gpuonly Nodes=n1 TRESBillingWeights=CPU=1,GRES/gpu=10\n"
                    "PartitionName=typed Nodes=n1 TRESBillingWeights=CPU=1,GRES/gpu:a100=12,GRES/gpu:h100=16\n")
    (conf.parent / "gres.conf").write_text(GRES)
    with caplog.at_level(logging.WARNING, logger="swapaware.service"):
        svc = start_service(load_config(env=service_env), slurm=slurm_jobs)
    try:
        with PolicyClient(f"127.0.0.1:{svc.grpc_port}", 5.0) as client:
            shared = client.call("Admit", pb.AdmitRequest(job=_facts("billed"))).decision
            (said,) = [m for m in caplog.messages if "(shards_unbilled)" in m]  # once, when slurm.conf is read
            assert "GPU jobs keep their request (shards_unbilled) in 2 partition(s): partition gpuonly" in said, said
            assert shared.action == pb.ACTION_SHARE and shared.rewrite.tres_per_node == "gres:shard:1"
            kept = client.call("Admit", pb.AdmitRequest(job=_facts("gpuonly"))).decision
            assert kept.action == pb.ACTION_WHOLE_GPU and not kept.rewrite.HasField("tres_per_node")
            assert kept.reasons[0].code == "shards_unbilled" and "why=shards_unbilled" in kept.rewrite.admin_comment
            assert kept.reasons[0].message.startswith(
                "not shared: partition gpuonly (TRESBillingWeights=CPU=1,GRES/gpu=10): no GRES/shard weight"), kept
            assert "the fix: GRES/shard=1.25" in kept.reasons[0].message
            typed = client.call("Admit", pb.AdmitRequest(job=_facts("typed", "gres:gpu:a100:1"))).decision
            assert typed.action == pb.ACTION_WHOLE_GPU and not typed.rewrite.HasField("tres_per_node")
            assert typed.reasons[0].code == "shards_unbilled"
            assert "its GPUs bill different prices per shard" in typed.reasons[0].message
            # on 22.05 (the service's release here) a whole GPU is held as all its shards where they bill it
            whole = client.call("Admit", pb.AdmitRequest(job=_facts("billed", "gres:gpu:h100:1", ""))).decision
            assert whole.action == pb.ACTION_WHOLE_GPU and whole.rewrite.tres_per_node == "gres:shard:h100:8"
            small = client.call("Admit", pb.AdmitRequest(job=_facts("billed", "gres:gpu:a100:1", ""))).decision
            assert small.action == pb.ACTION_WHOLE_GPU and not small.rewrite.HasField("tres_per_node")
            (why,) = [r.message for r in small.reasons if r.code == "shards_unbilled"]
            assert "all 4 shards of one a100 GPU would bill 4 x 1 = 4 and the GPU bills GRES/gpu=8" in why, why
    finally:
        svc.stop(0)


def test_weights_changed_in_slurm_conf_are_read_again(service_env, slurm_jobs):
    conf = Path(service_env["SWAPAWARE_SERVICE__SLURM_CONF"])
    conf.write_text("NodeName=n1 CPUs=8 Gres=gpu:4,shard:32\n"
                    "PartitionName=gpu Nodes=n1 Default=YES TRESBillingWeights=CPU=1,GRES/gpu=10\n")
    svc = start_service(load_config(env=service_env), slurm=slurm_jobs)
    try:
        h = svc.handler
        assert h.admit(pb.AdmitRequest(job=_facts(""))).decision.reasons[0].code == "shards_unbilled"
        conf.write_text("NodeName=n1 CPUs=8 Gres=gpu:4,shard:32\n"
                        "PartitionName=gpu Nodes=n1 Default=YES TRESBillingWeights=CPU=1,GRES/gpu=10,GRES/shard=1.25\n")
        h.partitions.__self__._next_check = float("-inf")  # the watch looks again now, not in 5 s
        shared = h.admit(pb.AdmitRequest(job=_facts(""))).decision
        assert shared.action == pb.ACTION_SHARE and shared.rewrite.tres_per_node == "gres:shard:1"
    finally:
        svc.stop(0)
