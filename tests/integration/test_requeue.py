"""A shared job that runs out of GPU memory is requeued once on a whole GPU and completes; with
--no-requeue it fails as before, the reason in sacct. Real Slurm of the release under test, the
fake NVML refusing what is over the job's handed-down share (as a framework honouring it does).

Slurm starts a requeued job no sooner than its credential lifetime later (AuthInfo cred_expire,
120 s by default, 30 s on the dev cluster; SchedulerParameters=requeue_delay on 26.05)."""
import json
import time
import uuid

import pytest

from tests.waiting import wait_for

from tests.slurm_stack import REQUEUED_RUNS, grows_script, requeue_restarts as restarts, sacct_runs

from .conftest import decision_of, job_field

pytestmark = pytest.mark.integration

HINT = "--comment=swapaware:mem=2G"  # shared from the first run: 1 shard (10 GiB) of a GPU


def test_a_shared_job_that_runs_out_of_gpu_memory_is_requeued_whole_and_completes(stack):
    # beside it (Slurm's requeue delay is the long part of this test): the same job with --no-requeue
    kept = stack.sbatch(grows_script(stack), "--gres=gpu:1", HINT, f"--job-name=oomnorq-{uuid.uuid4().hex[:6]}",
                        "--no-requeue")
    since = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - 1))
    name = f"oomrq-{uuid.uuid4().hex[:6]}"
    out, err = stack.state / "jobs" / f"{name}.out", stack.state / "jobs" / f"{name}.err"
    job = stack.sbatch(grows_script(stack), "--gres=gpu:1", HINT, f"--job-name={name}", f"--output={out}",
                       f"--error={err}")
    shared = decision_of(job_field(stack.show_job(job), "AdminComment"))
    assert shared["action"] == "share" and shared["shards"] == "1", shared
    assert job_field(stack.show_job(job), "TresPerNode") == stack.gres("shard", 1)

    def finished_after_requeue() -> str | None:
        show = stack.show_job(job)
        state = job_field(show, "JobState")
        return state if state in ("COMPLETED", "FAILED", "CANCELLED") and restarts(stack, job) >= 1 else None

    no_requeue_respected(stack, kept)
    assert wait_for(finished_after_requeue, 240, lambda: f"job {job} to be requeued and finish: "
                    f"{stack.show_job(job)}\n{stack.queue_and_gres()}", 0.5) == "COMPLETED"
    show = stack.show_job(job)
    whole = decision_of(job_field(show, "AdminComment"))
    assert whole["action"] == "whole_gpu" and whole["why"].startswith("oom_requeued") and whole["id"] != shared["id"]
    assert restarts(stack, job) == 1
    held = stack.gres("shard", 8) if stack.whole_gpu_as_shards else stack.gres("gpu", 1)
    assert job_field(show, "TresPerNode") == held  # the request as submitted (22.05, uniform: all shards)

    # stdout is the job's own; stderr says once why it ran again
    assert out.read_text().splitlines()[-1] == "done on a GPU of its own" and "swapaware" not in out.read_text()
    notice = [ln for ln in err.read_text().splitlines() if ln.startswith("swapaware:")]
    assert len(notice) == 1 and f"job {job} ran out of GPU memory on a shared GPU" in notice[0] \
        and whole["id"] in notice[0], err.read_text()

    # accounting: the shared run REQUEUED, the whole one COMPLETED; the history: two runs, one OOM
    wait_for(lambda: sacct_runs(stack, job) in REQUEUED_RUNS or None, 30,
             lambda: f"sacct to list both runs of job {job}: {sacct_runs(stack, job)}", 0.5)

    def observations():
        with stack.history() as db:
            rows = db.execute("SELECT decision_id, oom, shared FROM observations WHERE job_id=? ORDER BY finished_at",
                              (job,)).fetchall()
        return rows if len(rows) == 2 else None

    rows = wait_for(observations, 30, f"both runs of job {job} observed", 0.3)
    assert rows == [(shared["id"], 1, 1), (whole["id"], 0, 0)]

    # the report lists the job once (accounting holds both runs)
    listed = json.loads(stack.swapaware("report", "--format", "json", "--jobs", "--start", since).stdout)["jobs"]
    assert [j["job_id"] for j in listed].count(job) == 1


def no_requeue_respected(stack, job: int) -> None:
    """--no-requeue: the job fails as it would have, and sacct's AdminComment says why."""
    assert decision_of(job_field(stack.show_job(job), "AdminComment"))["action"] == "share"
    assert stack.wait_done(job) == "FAILED"
    wait_for(lambda: stack.sacct_admin_comment(job).endswith("oom_requeue=no-requeue") or None, 30,
             lambda: f"sacct to show why job {job} was not requeued: {stack.sacct_admin_comment(job)!r}", 0.5)
    assert restarts(stack, job) == 0 and sacct_runs(stack, job) == ["FAILED"]
