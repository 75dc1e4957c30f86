"""Job ids repeat after Slurm loses its state (a StateSaveLocation reset): the new job with an old
id is tied to its own decision, learned under its own class, and never inherits the old job's."""
from __future__ import annotations

import json
import uuid

from tests.slurm_stack import GIB, decision_of, fake_alloc_script, job_field
from tests.waiting import wait_for

from .conftest import NODES


def reset_slurm_state(cluster) -> None:
    """slurmctld forgets every job (its state save directory emptied): the next job id is 1 again,
    while the accounting keeps the old jobs with those ids."""
    cluster.stack("down")
    for f in (cluster.state / "spool" / "ctld").iterdir():
        if f.is_file():
            f.unlink()
    cluster.stack("up", "--nodes", str(len(NODES)))


def class_samples(cluster, decision_id: str) -> int:
    with cluster.history() as db:
        row = db.execute("SELECT job_class FROM decisions WHERE decision_id=?", (decision_id,)).fetchone()
        stats = db.execute("SELECT stats_json FROM class_stats WHERE level='class' AND key=?", row).fetchone()
    return json.loads(stats[0])["samples"] if stats else 0


def run_to_end(cluster, name: str, gib: float) -> tuple[int, str]:
    job = cluster.sbatch(fake_alloc_script(cluster, gib, hold_s=0.5), "--gres=gpu:1", f"--job-name={name}")
    decision = decision_of(job_field(cluster.show_job(job), "AdminComment"))["id"]
    # Not `sacct -j`: after a reset the accounting also holds older jobs of this id (they may be
    # all it shows until this one is flushed to it); slurmctld knows only this one.
    final = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
    state = wait_for(lambda: (st := job_field(cluster.show_job(job), "JobState")) in final and st, 90,
                     lambda: f"job {job} to end: {cluster.show_job(job)}", 0.3)
    assert state == "COMPLETED"
    wait_for(lambda: any(r[1] == decision for r in cluster.observations(job)), 60,
             lambda: f"job {job}'s observation under decision {decision}: {cluster.observations(job)}", 0.3)
    return job, decision


def test_a_reused_job_id_never_inherits_the_old_jobs_decision(cluster):
    reset_slurm_state(cluster)
    old_job, old_decision = run_to_end(cluster, f"old-{uuid.uuid4().hex[:6]}", 2)
    assert old_job == 1
    old_samples = class_samples(cluster, old_decision)
    assert old_samples == 1

    reset_slurm_state(cluster)
    new_job, new_decision = run_to_end(cluster, f"new-{uuid.uuid4().hex[:6]}", 5)
    assert new_job == old_job and new_decision != old_decision
    # Two instances of job 1, each observed once under its own decision, each class learned once.
    rows = cluster.observations(new_job)
    assert sorted((r[1], r[2]) for r in rows) == sorted([(old_decision, 2 * GIB), (new_decision, 5 * GIB)])
    assert class_samples(cluster, old_decision) == old_samples
    assert class_samples(cluster, new_decision) == 1
    # `swapaware explain 1` means the job 1 Slurm knows now.
    assert new_decision in cluster.swapaware("explain", str(new_job)).stdout
