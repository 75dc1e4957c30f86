"""On the real cluster: two jobs that shared a GPU, observed by the hooks and the node agent, teach
the site's interference model, and `swapaware explain` says so (issue 35)."""
import uuid

import pytest

from tests.waiting import wait_for

from .conftest import fake_alloc_script

pytestmark = pytest.mark.integration

LEARN = {  # one user's two shared runs suffice here (a site's defaults: 25 runs of 3 users)
    "SWAPAWARE_INTERFERENCE__MIN_RUNS": "2", "SWAPAWARE_INTERFERENCE__MIN_USERS": "1",
    "SWAPAWARE_INTERFERENCE__REFIT_S": "0.2",
}


def model_line(stack, job_id: int) -> str:
    out = stack.swapaware("explain", str(job_id)).stdout
    lines = [ln for ln in out.splitlines() if "interference_model:" in ln]
    assert len(lines) == 1, out
    return lines[0]


def test_shared_runs_change_what_explain_says_about_the_model(stack):
    conf = (stack.state / "etc" / "slurm.conf").read_text()
    if "LL_SHARED_GRES" in conf:
        pytest.skip("this cluster places shard jobs on the least-loaded GPU (SelectTypeParameters LL_SHARED_GRES, "
                    "23.11+) and its node runs two jobs at once (2 CPUs): two jobs never share a GPU here")
    name = f"interf-{uuid.uuid4().hex[:6]}"
    script = fake_alloc_script(stack, gib=1, hold_s=4, busy_pct=10)  # 1 GiB, 10 % busy: one shard
    with stack.service_with(**LEARN):
        solo = stack.sbatch(script, "--gres=gpu:1", f"--job-name={name}")
        assert stack.wait_done(solo) == "COMPLETED"
        stack.wait_observation(solo)
        assert "interference model: prior (gavel): 0 shared runs on all GPU types < min 2" in model_line(stack, solo)

        pair = [stack.sbatch(script, "--hold", "--gres=gpu:1", f"--job-name={name}") for _ in range(2)]
        stack.run("scontrol", "release", ",".join(map(str, pair)))
        for job in pair:
            assert stack.wait_done(job) == "COMPLETED"
            stack.wait_observation(job)
        with stack.history() as db:
            co = [db.execute("SELECT co_runners, gpu_indices FROM observations WHERE job_id=?", (j,)).fetchone()
                  for j in pair]
        assert all(c[0] == 1 for c in co) and co[0][1] == co[1][1], f"the pair did not share one GPU: {co}"

        def learned() -> str | None:
            line = model_line(stack, pair[0])
            return line if "learned from 2 shared runs of 1 users on all GPU types" in line else None

        line = wait_for(learned, 30, lambda: f"explain to name the learned model: {model_line(stack, pair[0])}", 0.5)
        assert "prior gavel" in line  # the evidence and the prior it outgrows
