"""On the multi-node cluster: a shared job on node2 that runs out of GPU memory (node2's own fake
NVML refusing beyond its share) is requeued once on a whole GPU by the service on the controller
and completes; each run is observed once, from the node it ran on."""
from __future__ import annotations

import uuid

from tests.slurm_stack import REQUEUED_RUNS, decision_of, grows_script, job_field, requeue_restarts, sacct_runs
from tests.waiting import wait_for


def test_a_shared_job_on_a_compute_node_is_requeued_whole_and_completes(cluster):
    job = cluster.sbatch(grows_script(cluster), "--gres=gpu:1", "--comment=swapaware:mem=2G", "-w", "node2",
                         f"--job-name=oomrq-{uuid.uuid4().hex[:6]}")
    shared = decision_of(job_field(cluster.show_job(job), "AdminComment"))
    assert shared["action"] == "share", shared

    def done() -> str | None:
        state = job_field(cluster.show_job(job), "JobState")
        return state if state in ("COMPLETED", "FAILED") and requeue_restarts(cluster, job) >= 1 else None

    assert wait_for(done, 240, lambda: f"job {job} requeued and finished: {cluster.show_job(job)}", 0.5) == "COMPLETED"
    whole = decision_of(job_field(cluster.show_job(job), "AdminComment"))
    assert whole["action"] == "whole_gpu" and whole["why"].startswith("oom_requeued")
    wait_for(lambda: sacct_runs(cluster, job) in REQUEUED_RUNS or None, 30,
             lambda: f"sacct to list both runs of job {job}: {sacct_runs(cluster, job)}", 0.5)
    runs = wait_for(lambda: (lambda o: o if len(o) == 2 else None)(cluster.observations(job)), 30,
                    f"both runs of job {job} observed", 0.3)
    assert sorted((node, d) for node, d, _peak, _code in runs) == sorted([("node2", shared["id"]), ("node2", whole["id"])])
    assert sorted(code for *_rest, code in runs) == [0, 2]  # the OOM run's exit status, then the rerun's
