"""The service reads the partitions' DefCpuPerGPU / DefMemPerGPU from the controller's slurm.conf
(service.slurm_conf): a GPU job of such a partition keeps its request, over both transports."""
import logging
import threading
from pathlib import Path

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.slurm.slurm import PendingJob
from policy_service.serving.client import PolicyClient
from policy_service.config import load_config
from policy_service.serving.server import start_service
from tests.waiting import wait_for

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


def test_a_gpu_with_more_shards_than_its_memory_is_warned_once_from_the_agents_report(service_env, slurm_jobs,
                                                                                       caplog):
    conf = Path(service_env["SWAPAWARE_SERVICE__SLURM_CONF"])
    conf.write_text("NodeName=n1 CPUs=8 Gres=gpu:2,shard:16\nPartitionName=gpu Nodes=n1 Default=YES\n")
    (conf.parent / "gres.conf").write_text("Name=gpu File=/dev/nvidia[0-1]\nName=shard Count=8 File=/dev/nvidia0\n"
                                           "Name=shard Count=8 File=/dev/nvidia1\n")
    svc = start_service(load_config(env=service_env), slurm=slurm_jobs)
    gib = 1024 ** 3
    try:
        with PolicyClient(f"127.0.0.1:{svc.grpc_port}", 5.0) as client, \
                caplog.at_level(logging.WARNING, logger="swapaware.decisions"):
            for job_id in (1, 2):
                fin = pb.JobFinishedRequest(job_id=job_id, node="n1", gpu_indices=[0, 1], finished_at=1100.0,
                                            started_at=1000.0, event_id=f"f{job_id}")
                fin.gpus.add(gpu_index=0, peak_bytes=gib, total_bytes=80 * gib)
                fin.gpus.add(gpu_index=1, peak_bytes=gib, total_bytes=40 * gib)  # 8 x 10 GiB promised
                client.call("JobFinished", fin)
    finally:
        svc.stop(0)
    warned = [m for m in caplog.messages if m.startswith("fleet: ")]
    assert len(warned) == 1 and warned[0].startswith("fleet: n1 GPU 1: gres.conf gives it 8 shards") \
        and "Count=4" in warned[0]


def test_where_the_controller_in_control_refuses_shards_a_job_keeps_its_request(service_env, slurm_jobs):
    """A Slurm 22.05 backup after `scontrol takeover` shows `shard:<type>:0` on every node and refuses
    every shard job (docs/slurm-releases.md): the service reads that with its queue poll."""
    conf = Path(service_env["SWAPAWARE_SERVICE__SLURM_CONF"])
    conf.write_text("NodeName=n1 CPUs=8 Gres=gpu:a100:2,shard:16\nPartitionName=gpu Nodes=n1 Default=YES\n")
    (conf.parent / "gres.conf").write_text("Name=gpu Type=a100 File=/dev/nvidia[0-1]\n"
                                           "Name=shard Count=8 File=/dev/nvidia0\nName=shard Count=8 File=/dev/nvidia1\n")
    slurm_jobs.node_shards = {"n1": {"a100": 0}}
    slurm_jobs.pending = [PendingJob(70, "gres:gpu:1", "", "", 1, 1, "Priority")]  # GPU work waits
    env = dict(service_env, SWAPAWARE_POLICY__SHARE_MIN_QUEUE="0.05", SWAPAWARE_POLICY__QUEUE_POLL_S="0.05")
    svc = start_service(load_config(env=env), slurm=slurm_jobs)
    try:
        facts = pb.JobFacts(user="alice", uid=1000, job_name="train", tres_per_node="gres:gpu:1",
                            script_fingerprint="00000001deadbeef", comment="swapaware:mem=2G")
        with PolicyClient(f"127.0.0.1:{svc.grpc_port}", 5.0) as client:
            kept = client.call("Admit", pb.AdmitRequest(job=facts)).decision
            assert kept.action == pb.ACTION_WHOLE_GPU and not kept.rewrite.HasField("tres_per_node")
            (why,) = [r.message for r in kept.reasons if r.code == "shards_refused"]
            assert "n1: the controller in control reports 0 a100 shards" in why, why
            assert "why=shards_refused" in kept.rewrite.admin_comment
            slurm_jobs.node_shards = {"n1": {"a100": 16}}  # the primary is back: typed counts again
            wait_for(lambda: svc.queue_monitor.snapshot().live_shards.by_node["n1"]["a100"] == 16, 5.0,
                     "a poll that reads the shards back")
            shared = client.call("Admit", pb.AdmitRequest(job=facts)).decision
            assert shared.action == pb.ACTION_SHARE and shared.rewrite.tres_per_node == "gres:shard:1"
            svc.handler.standby = lambda: "writer is ctl2"  # an Admit while standby: a controller taking over
            standby = client.call("Admit", pb.AdmitRequest(job=facts)).decision
            assert standby.action == pb.ACTION_WHOLE_GPU and not standby.rewrite.HasField("tres_per_node")
            (why,) = [r.message for r in standby.reasons if r.code == "shards_refused"]
            assert "this service is standby (writer is ctl2)" in why, why
    finally:
        svc.stop(0)


def test_the_queue_poll_works_out_the_refusals_before_an_admit_needs_them(service_env, slurm_jobs, monkeypatch):
    """The refusals of each new snapshot are worked out by the poll thread (partitions.warm_live) before
    Admits can read it, so the first Admit after a takeover does not pay for them under slurmctld's
    job_submit call."""
    from policy_service.slurm.partitions import PartitionDefaults
    conf = Path(service_env["SWAPAWARE_SERVICE__SLURM_CONF"])
    conf.write_text("NodeName=n1 CPUs=8 Gres=gpu:a100:2,shard:16\nPartitionName=gpu Nodes=n1 Default=YES\n")
    (conf.parent / "gres.conf").write_text("Name=gpu Type=a100 File=/dev/nvidia[0-1]\n"
                                           "Name=shard Count=8 File=/dev/nvidia0\nName=shard Count=8 File=/dev/nvidia1\n")
    slurm_jobs.node_shards = {"n1": {"a100": 0}}
    worked_out = []
    real = PartitionDefaults._live_counts
    monkeypatch.setattr(PartitionDefaults, "_live_counts",
                        lambda self, *a: worked_out.append(threading.current_thread().name) or real(self, *a))
    slurm_jobs.pending = [PendingJob(70, "gres:gpu:1", "", "", 1, 1, "Priority")]  # GPU work waits
    env = dict(service_env, SWAPAWARE_POLICY__SHARE_MIN_QUEUE="0.05",
               SWAPAWARE_POLICY__QUEUE_POLL_S="300")   # no poll but those this test asks for
    svc = start_service(load_config(env=env), slurm=slurm_jobs)
    try:
        facts = pb.JobFacts(user="alice", uid=1000, job_name="train", tres_per_node="gres:gpu:a100:1",
                            script_fingerprint="00000001deadbeef", comment="swapaware:mem=2G")

        def held() -> int:                         # the memo's results for the snapshot an Admit reads now
            live = svc.queue_monitor.snapshot().live_shards
            return sum(1 for kept_for, _ in svc.handler.partitions()._live_memo.values() if kept_for is live)

        pairs = len(worked_out)                    # the first snapshot, taken before serving
        assert worked_out == ["queue-monitor"] * pairs and pairs == 4 == held()   # gpu and default x any, a100
        with PolicyClient(f"127.0.0.1:{svc.grpc_port}", 5.0) as client:
            for poll in range(3):
                kept = client.call("Admit", pb.AdmitRequest(job=facts)).decision
                assert kept.action == pb.ACTION_WHOLE_GPU
                assert [r.code for r in kept.reasons if r.code == "shards_refused"] == ["shards_refused"]
                svc.queue_monitor.controller_changed("a test's poll")   # a new snapshot, polled at once
                # the new snapshot served (its counts read) with its refusals already worked out
                wait_for(lambda: len(worked_out) == pairs * (poll + 2) and held() == pairs, 5.0,
                         "the poll thread to work it out")
        assert set(worked_out) == {"queue-monitor"}, worked_out   # never an Admit's thread
    finally:
        svc.stop(0)
