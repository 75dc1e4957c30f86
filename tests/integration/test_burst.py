"""A short burst on the real cluster: 500 held GPU jobs from 8 parallel submitters. Every job is
accepted, every job carries a decision, and the history holds exactly the decisions Slurm's
AdminComments name: none lost, none extra. (bench/submit_burst.py measures 10,000 with the
plugin on, off and hung.)"""
from __future__ import annotations

import subprocess
import uuid
from concurrent.futures import ThreadPoolExecutor

from policy_service.slurm.slurm_text import decision_ids_in
from tests.waiting import wait_for

JOBS, SUBMITTERS = 500, 8


def test_a_burst_of_500_submissions_loses_and_adds_no_decision(stack):
    tag = f"burst-{uuid.uuid4().hex[:6]}"

    def submit(i: int) -> subprocess.CompletedProcess:
        return stack.run("sbatch", "--parsable", "--hold", "--gres=gpu:1", f"--job-name={tag}-{i % 10}",
                         "--wrap=true", "--output=/dev/null", check=False, timeout=120)

    with ThreadPoolExecutor(SUBMITTERS) as pool:
        results = list(pool.map(submit, range(JOBS)))
    try:
        failed = [r.stderr for r in results if r.returncode != 0]
        assert not failed, failed[:3]
        names = ",".join(f"{tag}-{k}" for k in range(10))
        held = stack.run("squeue", "-h", "-t", "PD", "-n", names, "-O", "admin_comment:").stdout
        comments = decision_ids_in(held)
        assert len(comments) == JOBS, f"{JOBS - len(comments)} job(s) without a decision"

        def recorded() -> set[str]:
            with stack.history() as db:
                return {r[0] for r in db.execute("SELECT decision_id FROM decisions WHERE job_name LIKE ?",
                                                 (f"{tag}-%",))}

        wait_for(lambda: recorded() >= comments, 60, lambda: f"{len(comments - recorded())} decisions to be written")
        assert recorded() == comments
    finally:
        stack.run("scancel", "-n", ",".join(f"{tag}-{k}" for k in range(10)), check=False)
