"""The service reads the partitions' DefCpuPerGPU / DefMemPerGPU from the controller's slurm.conf
(service.slurm_conf): a GPU job of such a partition keeps its request, over both transports."""
from pathlib import Path

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.config import load_config
from policy_service.server import start_service

GIB = 1024**3


def test_a_gpu_job_in_a_partition_with_per_gpu_defaults_keeps_its_request(service_env, slurm_jobs):
    Path(service_env["SWAPAWARE_SERVICE__SLURM_CONF"]).write_text(
        "NodeName=n1 CPUs=8 Gres=gpu:4,shard:32\n"
        "PartitionName=gpu Nodes=n1 Default=YES\n"
        "PartitionName=gpudef Nodes=n1 DefCpuPerGPU=2 DefMemPerGPU=600\n")
    svc = start_service(load_config(env=service_env), slurm=slurm_jobs)
    try:
        h = svc.handler
        facts = pb.JobFacts(user="alice", uid=1000, job_name="train", tres_per_node="gres:gpu:1",
                            script_fingerprint="00000001deadbeef", comment="swapaware:mem=2G")
        shared = h.admit(pb.AdmitRequest(job=facts)).decision  # the default partition: no per-GPU defaults
        assert shared.action == pb.ACTION_SHARE and shared.rewrite.tres_per_node == "gres:shard:1"
        facts.partition = "gpudef"
        kept = h.admit(pb.AdmitRequest(job=facts)).decision
        assert kept.action == pb.ACTION_WHOLE_GPU and not kept.rewrite.HasField("tres_per_node")
        assert "per_gpu_default" in [r.code for r in kept.reasons]
        assert "DefCpuPerGPU=2, DefMemPerGPU=600" in kept.reasons[0].message
    finally:
        svc.stop(0)
