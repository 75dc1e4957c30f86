"""A shared run that ends out of GPU memory is requeued once on a whole GPU: through the real
service (real gRPC, real SQLite) with the stateful Slurm stand-in doing what scontrol does."""
import time

import pytest

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.serving.client import PolicyClient
from policy_service.config import load_config
from policy_service.core.policy import parse_admin_comment
from policy_service.serving.server import start_service

from tests.adapter.serving.test_service import GIB, facts, run_job


@pytest.fixture
def svc(service_env, slurm_jobs):
    s = start_service(load_config(env=dict(service_env, SWAPAWARE_POLICY__SHARE_MIN_QUEUE="0",
                                           SWAPAWARE_ESTIMATOR__MIN_SAMPLES="1")), slurm=slurm_jobs)
    try:
        with PolicyClient(f"127.0.0.1:{s.grpc_port}", 5.0) as c:
            yield s, c
    finally:
        s.stop(0)


def shared_run_that_ran_out(client, slurm_jobs, job_id, name, **fin):
    """A class seen once (3 GiB), then a run of it that shares and fails out of GPU memory now."""
    run_job(client, slurm_jobs, job_id - 1, facts(name=name), peak=3 * GIB)
    d = client.admit(facts(name=name)).decision
    assert d.action == pb.ACTION_SHARE and d.rewrite.HasField("tres_per_node"), d
    slurm_jobs.comments[job_id] = d.rewrite.admin_comment
    client.call("JobStarted", pb.JobStartedRequest(job_id=job_id, node="n1", gpu_indices=[0],
                                                   started_at=time.time() - 60, event_id=f"s{job_id}"))
    end = pb.JobFinishedRequest(job_id=job_id, node="n1", gpu_indices=[0], finished_at=time.time(), exit_code=1,
                                event_id=f"f{job_id}", oom_detected=True, oom_evidence="job_near_capacity: 9.9GiB",
                                telemetry_source="fake-nvml", peak_gpu_bytes=int(9.9 * GIB), **fin)
    return d, end


def test_requeued_whole_once_with_the_request_as_submitted(svc, slurm_jobs):
    s, client = svc
    shared, end = shared_run_that_ran_out(client, slurm_jobs, 20, "grows")
    slurm_jobs.completing_reads = 3  # the epilog is still running when the service has requeued it
    assert client.call("JobFinished", end).applied
    assert s.handler.events.on_shared_oom.drain()
    calls = [c for c in slurm_jobs.requeue_calls if c[0] != "state"]
    assert [c[0] for c in calls] == ["requeuehold", "update", "release"]
    assert [c[0] for c in slurm_jobs.requeue_calls].count("state") == 4  # 3 x COMPLETING, then PENDING
    _, job_id, fields, comment = calls[1]
    record = parse_admin_comment(comment)
    assert job_id == 20 and record["action"] == "whole_gpu" and record["why"].startswith("oom_requeued")
    assert fields == {"tres_per_node": "gres:shard:8"}  # 22.05: a whole GPU held as all its shards, as Admit does
    assert slurm_jobs.held == set() and slurm_jobs.comments[20] == comment
    s.handler.flush()
    row = s.store.decision(record["id"])
    assert row.action == "whole_gpu" and row.decision.reasons[0].code == "oom_requeued"
    assert row.decision.reasons[0].message.endswith(f"(replaces decision {shared.decision_id})")
    assert "job_near_capacity" in row.decision.reasons[0].message

    # the same event again (a spool replay): applied once, requeued once
    assert not client.call("JobFinished", end).applied
    assert s.handler.events.on_shared_oom.drain() and len(slurm_jobs.requeue_calls) == 7


def test_no_requeue_is_respected_and_the_reason_reaches_the_admin_comment(svc, slurm_jobs):
    _, client = svc
    slurm_jobs.no_requeue.add(30)
    shared, end = shared_run_that_ran_out(client, slurm_jobs, 30, "no-requeue")
    client.call("JobFinished", end)
    assert slurm_jobs.requeue_calls == [("requeuehold", 30)]  # Slurm refused: nothing else done
    assert slurm_jobs.comments[30] == f"{shared.rewrite.admin_comment} oom_requeue=no-requeue"


def test_an_interactive_job_and_a_late_event_are_not_requeued(svc, slurm_jobs):
    _, client = svc
    _, end = shared_run_that_ran_out(client, slurm_jobs, 40, "late")
    end.finished_at = time.time() - 3600
    end.started_at = end.finished_at - 60
    client.call("JobFinished", end)
    assert slurm_jobs.requeue_calls == []
    assert slurm_jobs.comments[40].endswith(" oom_requeue=late")


def test_turned_off_by_the_site(service_env, slurm_jobs):
    s = start_service(load_config(env=dict(service_env, SWAPAWARE_POLICY__SHARE_MIN_QUEUE="0",
                                           SWAPAWARE_POLICY__REQUEUE_AFTER_OOM="false",
                                           SWAPAWARE_ESTIMATOR__MIN_SAMPLES="1")), slurm=slurm_jobs)
    try:
        with PolicyClient(f"127.0.0.1:{s.grpc_port}", 5.0) as client:
            _, end = shared_run_that_ran_out(client, slurm_jobs, 50, "off")
            client.call("JobFinished", end)
    finally:
        s.stop(0)
    assert slurm_jobs.requeue_calls == [] and slurm_jobs.comments[50].endswith(" oom_requeue=off")


def test_a_shared_run_that_did_not_run_out_is_not_requeued(svc, slurm_jobs):
    _, client = svc
    _, end = shared_run_that_ran_out(client, slurm_jobs, 60, "fine")
    end.exit_code, end.oom_detected, end.peak_gpu_bytes = 0, False, 2 * GIB
    client.call("JobFinished", end)
    assert slurm_jobs.requeue_calls == []
