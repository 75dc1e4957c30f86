"""The nodes' GPU memory enforcement reaches the service with JobStarted (gRPC on loopback, and
the agent's batched ReportEvents) and gates oversubscription (policy.allow_oversubscription = auto)."""
from __future__ import annotations

import time

import pytest

from policy_service._generated.swapaware.v1 import policy_pb2 as pb

GIB = 1024**3
ADVISORY = pb.NodeEnforcement(backend="advisory", detail="framework_env")
DMEM = pb.NodeEnforcement(backend="nvml-cgroup", hard_cap=True, victim=True, detail="dmem")


def facts():
    return pb.JobFacts(user="alice", account="proj", partition="gpu", job_name="train", tres_per_node="gres:gpu:1",
                       script_fingerprint="00000001deadbeef", comment="swapaware:access=compute_bound")


def run(client, slurm_jobs, job_id, node, enforcement, peak=int(10.5 * GIB), batched=False):
    d = client.admit(facts()).decision
    slurm_jobs.comments[job_id] = d.rewrite.admin_comment
    start = pb.JobStartedRequest(job_id=job_id, node=node, gpu_indices=[0], started_at=time.time(),
                                 event_id=f"s{job_id}")
    if enforcement is not None:
        start.enforcement.CopyFrom(enforcement)
    if batched:
        client.call("ReportEvents", pb.ReportEventsRequest(events=[pb.JobEvent(started=start)]))
    else:
        client.call("JobStarted", start)
    client.call("JobFinished", pb.JobFinishedRequest(job_id=job_id, node=node, gpu_indices=[0],
                                                     finished_at=time.time() + 1, event_id=f"f{job_id}",
                                                     peak_gpu_bytes=peak, telemetry_source="fake-nvml"))
    return d


def codes(d):
    return [r.code for r in d.reasons]


@pytest.mark.parametrize("batched", [False, True])
def test_reports_gate_oversubscription(client, slurm_jobs, service, batched):
    run(client, slurm_jobs, 1, "n1", None)  # the class learns a 10.5 GiB peak; n1 reports nothing
    d = client.admit(facts()).decision
    assert d.action == pb.ACTION_SHARE and d.shards == 2  # nobody reported: sized to the need
    assert "oversubscription_not_enforced" in codes(d) and "no node has reported" in d.rewrite.admin_comment + \
        " ".join(r.message for r in d.reasons)
    run(client, slurm_jobs, 2, "n1", ADVISORY, batched=batched)
    d = client.admit(facts()).decision
    assert d.action == pb.ACTION_SHARE and "advisory x1" in " ".join(r.message for r in d.reasons)
    assert "why=" in d.rewrite.admin_comment and "oversubscription_not_enforced" in d.rewrite.admin_comment
    run(client, slurm_jobs, 3, "n1", DMEM, batched=batched)  # n1 now enforces victim semantics
    d = client.admit(facts()).decision
    assert d.action == pb.ACTION_SHARE_OVERSUBSCRIBED and d.shards == 1
    run(client, slurm_jobs, 4, "n2", ADVISORY, batched=batched)  # a second node without it blocks again
    d = client.admit(facts()).decision
    assert d.action == pb.ACTION_SHARE and "n2" in " ".join(r.message for r in d.reasons)


@pytest.fixture
def forced_env(service_env):
    service_env["SWAPAWARE_POLICY__ALLOW_OVERSUBSCRIPTION"] = "true"
    return service_env


def test_admin_true_oversubscribes_without_reports(forced_env, slurm_jobs):
    from policy_service.serving.client import PolicyClient
    from policy_service.config import load_config
    from policy_service.serving.server import start_service
    svc = start_service(load_config(env=forced_env), slurm=slurm_jobs)
    try:
        with PolicyClient(f"127.0.0.1:{svc.grpc_port}", 5.0) as c:
            run(c, slurm_jobs, 1, "n1", ADVISORY)
            d = c.admit(facts()).decision
            assert d.action == pb.ACTION_SHARE_OVERSUBSCRIBED and "oversubscription_not_enforced" not in codes(d)
    finally:
        svc.stop(0)
