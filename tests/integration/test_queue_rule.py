"""The queue rule on the real cluster: the service reads squeue/sinfo, keeps a learned job whole
while nothing waits, and shares it once GPU work queues."""
import dataclasses
import uuid

import pytest

from policy_service.slurm.queue import queue_state
from policy_service.slurm.slurm import CliSlurm
from tests.waiting import wait_for

from .conftest import decision_of, fake_alloc_script, job_field
from .test_end_to_end import wait_running

pytestmark = pytest.mark.integration

SLEEP = "#!/bin/sh\nsleep 60\n"


def _fill_all_gpus(stack, tag: str) -> list[int]:
    fillers = [stack.sbatch(SLEEP, stack.fill_gres(i), f"--job-name=fill-{tag}") for i in range(4)]
    for j in fillers:
        wait_running(stack, j)
    return fillers


def test_cli_reads_pending_gpu_jobs_and_gpus_from_the_real_cluster(stack):
    slurm = CliSlurm(env=stack.env)
    assert slurm.cluster_gpus() == 4
    tag = uuid.uuid4().hex[:6]
    fillers = _fill_all_gpus(stack, tag)
    waiting = stack.sbatch(SLEEP, "--gres=gpu:2", f"--job-name=wait-{tag}")
    held = stack.sbatch(SLEEP, "--gres=gpu:1", "--hold", f"--job-name=held-{tag}")
    try:
        pending = {j.job_id: j for j in slurm.pending_jobs()}
        assert {waiting, held} <= set(pending)
        assert pending[waiting].tres_per_node == stack.gres("gpu", 2) and pending[waiting].reason in ("Resources", "Priority",
                                                                                               "None")
        assert pending[held].reason == "JobHeldUser"
        state = queue_state(pending.values(), slurm.cluster_gpus(), 8)
        assert state.pending_gpus == 2.0 and state.total_gpus == 4  # the held job does not count
        # one squeue for both (the queue poll when the admission catch-up follows it): the same jobs
        # as the two squeues it replaces read, on this release's squeue
        both, commented = slurm.queue_with_comments()
        mine = {*fillers, waiting, held}

        def as_read(jobs) -> dict:  # a pending job's reason may change between two reads (None ->
            # Resources once the scheduler looked at it: a 24.11 fresh-clone run): all else is the same
            return {j.job_id: dataclasses.replace(j, reason="") for j in jobs if j.job_id in mine}

        assert as_read(both) == as_read(pending.values())
        assert {j.job_id: j.reason for j in both}[held] == "JobHeldUser"
        assert {j for j in commented if j.job_id in mine} == {j for j in slurm.live_commented_jobs() if j.job_id in mine}
        assert {j.job_id for j in commented} >= mine
    finally:
        stack.run("scancel", *(str(j) for j in (*fillers, waiting, held)))


def test_learned_job_stays_whole_while_nothing_waits_and_shares_once_gpu_work_queues(stack):
    name = f"queue-{uuid.uuid4().hex[:6]}"
    script = fake_alloc_script(stack, gib=3, hold_s=0.5)
    first = stack.sbatch(script, "--gres=gpu:1", f"--job-name={name}")
    assert stack.wait_done(first) == "COMPLETED"
    stack.wait_observation(first)

    # a QoS above normal: the queue ahead of its jobs holds only jobs of that QoS
    stack.run("sacctmgr", "-i", "add", "qos", "high", "priority=100", check=False)
    assert "high|100" in stack.run("sacctmgr", "-n", "-P", "show", "qos", "format=name,priority").stdout
    fillers: list[int] = []
    with stack.service_with(SWAPAWARE_POLICY__SHARE_MIN_QUEUE="0.05", SWAPAWARE_POLICY__QUEUE_POLL_S="0.5"):
        log = stack.state / "log" / "swapaware.log"

        def from_fresh_queue(*options: str) -> dict | None:
            """A held job's decision, None when it was made without a fresh queue snapshot
            (queue_unknown: with a poll every 0.5 s, a snapshot is stale past 1.5 s, which a poll's
            squeue, sinfo and catch-up calls can take on a loaded 2-core machine)."""
            got = decision_of(job_field(stack.held(script, "--gres=gpu:1", *options, f"--job-name={name}"),
                                        "AdminComment"))
            return None if "queue_unknown" in got.get("why", "") else got

        def fresh_decision(*options: str) -> dict:
            return wait_for(lambda: from_fresh_queue(*options), 30, lambda: "a decision from a fresh queue "
                            "snapshot; service log:\n" + log.read_text()[-2000:], 0.5)
        try:
            d = fresh_decision()
            assert d["action"] == "whole_gpu" and "queue_short" in d["why"], d

            fillers = _fill_all_gpus(stack, name)
            fillers.append(stack.sbatch(SLEEP, stack.fill_gres(0), f"--job-name=fill-{name}"))  # waits: 1 of 4 GPUs

            def shared() -> tuple | None:
                info = stack.held(script, "--gres=gpu:1", f"--job-name={name}")
                got = decision_of(job_field(info, "AdminComment"))
                return (got, job_field(info, "TresPerNode")) if got.get("action") == "share" else None

            d2, tres = wait_for(shared, 20, lambda: "a shared decision once a job waits; service log:\n"
                                + log.read_text()[-2000:], 1.0)
            assert tres == stack.gres("shard", 1) and "queue_short" not in d2["why"]

            # the waiting filler is normal QoS: nothing waits ahead of a job of QoS high
            d3 = fresh_decision("--qos=high")
            assert d3["action"] == "whole_gpu" and "queue_short" in d3["why"], (d3, log.read_text()[-2000:])
            explained = stack.swapaware("explain", "--decision", d3["id"]).stdout
            assert "at or above QoS 'high' ask for 0.00 of 4 GPUs" in explained, explained
        finally:
            if fillers:
                stack.run("scancel", *(str(j) for j in fillers))


def test_pending_job_kept_whole_is_rewritten_to_shards_once_its_class_is_learned(stack):
    """policy.redecide_pending: B was submitted while A, the first run of its class, still ran
    (so B was kept whole); once A's observation arrives, the service rewrites the still-pending B
    to gres:shard:1 with scontrol update, and records the new decision."""
    name = f"redecide-{uuid.uuid4().hex[:6]}"
    script = fake_alloc_script(stack, gib=3, hold_s=4)
    jobs: list[int] = []
    # Wide keys off: B's first decision must not come from the account's history of other tests.
    with stack.service_with(SWAPAWARE_POLICY__REDECIDE_PENDING="true", SWAPAWARE_POLICY__QUEUE_POLL_S="0.5",
                            SWAPAWARE_ESTIMATOR__WIDE_KEY_MIN_SAMPLES="1000000"):
        try:
            # every GPU but an h100 (fill_gres: h100, h100, a100, a100): A gets that one
            jobs += [stack.sbatch(SLEEP, stack.fill_gres(i), f"--job-name=fill-{name}") for i in (1, 2, 3)]
            for j in jobs:
                wait_running(stack, j)
            a = stack.sbatch(script, stack.whole_gpu_request, f"--job-name={name}")
            jobs.append(a)
            wait_running(stack, a)
            jobs.append(stack.sbatch(SLEEP, stack.fill_gres(0), f"--job-name=fill-{name}"))  # takes A's GPU when A ends
            b = stack.sbatch(script, stack.whole_gpu_request, f"--job-name={name}")
            jobs.append(b)
            first = decision_of(job_field(stack.show_job(b), "AdminComment"))
            assert first["action"] == "whole_gpu" and "no_history" in first["why"], first
            assert stack.wait_done(a) == "COMPLETED"

            def rewritten() -> tuple | None:
                info = stack.show_job(b)
                d = decision_of(job_field(info, "AdminComment"))
                return (d, info) if d.get("action") == "share" else None

            d, info = wait_for(rewritten, 30, lambda: f"job {b} to be re-decided: {stack.show_job(b)}\n"
                               + (stack.state / "log" / "swapaware.log").read_text()[-2000:], 0.5)
            typed = "h100" if "h100" in stack.whole_gpu_request else ""
            assert job_field(info, "JobState") == "PENDING"
            assert job_field(info, "TresPerNode") == stack.gres("shard", 1, typed)
            assert d["why"].startswith("redecided,") and d["id"] != first["id"]
            explained = stack.swapaware("explain", "--decision", d["id"]).stdout
            assert f"replaces decision {first['id']}" in explained, explained
        finally:
            if jobs:
                stack.run("scancel", *(str(j) for j in jobs))
