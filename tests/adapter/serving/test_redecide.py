"""Re-deciding pending jobs kept whole, through the real service (real gRPC, real SQLite) with
the stateful Slurm stand-in holding the jobs' AdminComments and GRES."""
import logging

import pytest

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.serving.redecide import PendingRedecider, candidates
from policy_service.slurm.slurm import PendingJob
from policy_service.serving.client import PolicyClient
from policy_service.config import load_config
from policy_service.core.policy import parse_admin_comment
from policy_service.core.types import QueueState
from policy_service.serving.server import start_service
from tests.waiting import wait_for

from tests.adapter.serving.test_service import GIB, facts, run_job

WHOLE = "gres:shard:8"
NO_QUEUE = QueueState(0.0, 4)


def pending(job_id, tres=WHOLE, reason="Priority", **kw):
    return PendingJob(job_id, tres, kw.pop("job", ""), kw.pop("task", ""), kw.pop("nodes", 1), 1, reason, "")


def test_candidates_are_whole_gpu_holds_waiting_for_resources_oldest_first():
    jobs = [pending(9), pending(3, reason="Resources"), pending(4, reason="JobHeldUser"),
            pending(5, tres="gres:shard:2"), pending(6, tres="gres:gpu:1"), pending(7, job="gres:gpu:1"),
            pending(8, nodes=2), pending(2, reason="None")]
    assert [j.job_id for j in candidates(jobs, {8})] == [2, 3, 6, 9]  # gres:gpu:1: a whole GPU on every release


@pytest.fixture
def svc(service_env, slurm_jobs):
    # the queue rule off, so only learning makes a difference; no monitor thread: polls by hand
    s = start_service(load_config(env=dict(service_env, SWAPAWARE_POLICY__REDECIDE_PENDING="true",
                                           SWAPAWARE_POLICY__REDECIDE_MAX_PER_POLL="2",
                                           SWAPAWARE_POLICY__QUEUE_POLL_S="300")), slurm=slurm_jobs)
    try:
        # the monitor's first poll (of an empty queue) is done before the test polls by hand
        wait_for(lambda: slurm_jobs.queue_reads >= 1 and s.queue_monitor.snapshot() is not None, 5.0, "first poll")
        with PolicyClient(f"127.0.0.1:{s.grpc_port}", 5.0) as c:
            yield s, c
    finally:
        s.stop(0)


def submit(client, slurm_jobs, job_id, job):
    d = client.admit(job).decision
    slurm_jobs.comments[job_id] = d.rewrite.admin_comment
    return d


def test_pending_job_kept_whole_is_rewritten_to_shards_once_its_class_is_learned(svc, slurm_jobs, caplog):
    s, client = svc
    assert isinstance(s.queue_monitor.on_poll, PendingRedecider)
    redecide = s.queue_monitor.on_poll
    job = facts(name="burst")
    first = submit(client, slurm_jobs, 11, job)
    second = submit(client, slurm_jobs, 12, job)
    assert first.action == second.action == pb.ACTION_WHOLE_GPU  # nothing known yet
    redecide([pending(12)], NO_QUEUE)
    assert slurm_jobs.tres == {}  # still nothing known: left as it is

    run_job(client, slurm_jobs, 10, job, peak=3 * GIB)  # a run of the class finishes: learned
    with caplog.at_level(logging.INFO, logger="swapaware.decisions"):
        redecide([pending(12)], NO_QUEUE)
    assert slurm_jobs.tres == {12: "gres:shard:1"}
    record = parse_admin_comment(slurm_jobs.comments[12])
    assert record["action"] == "share" and record["why"].startswith("redecided,") and record["id"] != second.decision_id
    assert any(f"replaces {second.decision_id}" in m for m in caplog.messages)
    s.handler.flush()
    row = s.store.decision(record["id"])
    assert row is not None and row.action == "share"
    assert row.decision.reasons[0].message.endswith(f"replaces decision {second.decision_id}")

    # the job starts with its new record: the run is correlated with the new decision
    started = client.call("JobStarted", pb.JobStartedRequest(job_id=12, node="n1", gpu_indices=[0],
                                                             started_at=2000.0, event_id="s12"))
    assert started.decision_id == record["id"]
    assert redecide.rewritten == 1


def test_records_are_read_once_jobs_redecided_only_when_their_keys_learn_and_n_per_poll(svc, slurm_jobs):
    s, client = svc
    redecide = s.queue_monitor.on_poll
    job = facts(name="many")
    for j in (21, 22, 23):
        submit(client, slurm_jobs, j, job)
    waiting = [pending(j) for j in (21, 22, 23)]
    base = slurm_jobs.lookups
    reads = []
    for _ in range(4):  # redecide_max_per_poll = 2 reads + decisions per poll
        redecide(waiting, NO_QUEUE)
        reads.append(slurm_jobs.lookups - base)
    assert reads == [1, 2, 3, 3]  # one record per poll (read + decide); then nothing changed
    other = facts(name="unrelated")
    run_job(client, slurm_jobs, 19, other, peak=2 * GIB)  # learned, but not under these jobs' keys
    redecide(waiting, NO_QUEUE)
    assert slurm_jobs.tres == {}
    run_job(client, slurm_jobs, 20, job, peak=2 * GIB)  # learned under their keys: each is decided again
    base = slurm_jobs.lookups
    redecide(waiting, NO_QUEUE)
    assert slurm_jobs.tres == {21: "gres:shard:1", 22: "gres:shard:1"}
    redecide(waiting, NO_QUEUE)
    assert slurm_jobs.tres == {21: "gres:shard:1", 22: "gres:shard:1", 23: "gres:shard:1"}
    assert slurm_jobs.lookups == base  # records are not read again


def test_a_job_that_started_meanwhile_is_left_alone(svc, slurm_jobs):
    s, client = svc
    job = facts(name="racer")
    d = submit(client, slurm_jobs, 31, job)
    run_job(client, slurm_jobs, 30, job, peak=2 * GIB)
    slurm_jobs.started.add(31)
    s.queue_monitor.on_poll([pending(31)], NO_QUEUE)
    assert slurm_jobs.tres == {} and slurm_jobs.comments[31] == d.rewrite.admin_comment
    assert s.queue_monitor.on_poll.rewritten == 0


def test_shared_or_foreign_records_and_jobs_that_still_need_a_gpu_are_left_alone(svc, slurm_jobs):
    s, client = svc
    big = facts(name="big")
    run_job(client, slurm_jobs, 40, big, peak=79 * GIB)  # needs the whole GPU
    submit(client, slurm_jobs, 41, big)
    slurm_jobs.comments[42] = "an admin's note"
    submit(client, slurm_jobs, 43, facts(name="big", comment="swapaware:mem=2G"))  # shares from the start
    s.queue_monitor.on_poll([pending(41), pending(42), pending(43)], NO_QUEUE)
    assert slurm_jobs.tres == {}


def test_on_by_default_and_off_on_request(service_env, slurm_jobs):
    env = {k: v for k, v in service_env.items() if k != "SWAPAWARE_POLICY__REDECIDE_PENDING"}
    assert load_config(env=env).policy.redecide_pending is True
    s = start_service(load_config(env=env), slurm=slurm_jobs)
    try:
        assert isinstance(s.queue_monitor.on_poll, PendingRedecider)
    finally:
        s.stop(0)
    cfg = load_config(env=dict(env, SWAPAWARE_POLICY__REDECIDE_PENDING="false",
                               SWAPAWARE_POLICY__OVERCOMMIT_COMPUTE_MIN_QUEUE="1.0"))
    s = start_service(cfg, slurm=slurm_jobs)
    try:
        assert s.queue_monitor is not None and s.queue_monitor.on_poll is None
    finally:
        s.stop(0)
