"""What-if on the test cluster's own accounting: jobs run through the plugin and the node agent,
their `sacct --json` (this release's) is replayed by `swapaware simulate --workload sacct` with the
service's history, and the result says whose memory was observed."""
import json
import uuid

import pytest

from .conftest import fake_alloc_script

pytestmark = pytest.mark.integration


def test_simulate_the_clusters_own_accounting(stack, tmp_path):
    name = f"whatif-{uuid.uuid4().hex[:6]}"
    jobs = [stack.sbatch(fake_alloc_script(stack, gib=gib, hold_s=0.5), "--gres=gpu:1", f"--job-name={name}")
            for gib in (2, 3, 2)]
    for j in jobs:
        assert stack.wait_done(j) == "COMPLETED"
        stack.wait_observation(j)
    export = tmp_path / "site.json"
    export.write_text(stack.run("sacct", "--json", "-X", "--allusers", "-j", ",".join(map(str, jobs))).stdout)
    out = tmp_path / "out"
    res = stack.swapaware("simulate", "--workload", "sacct", "--sacct-json", str(export),
                          "--history", str(stack.state / "lib" / "history.sqlite3"), "--gpus", "4",
                          "--arrivals", "recorded", "--policies", "b0,swapaware,oracle", "--noise", "none",
                          "--out", str(out), "--no-progress")
    assert "3 jobs observed, 0 from the model" in res.stdout, res.stdout
    doc = json.loads((out / "results.json").read_text())
    assert doc["meta"]["data_source"]["memory"]["observed_jobs"] == 3
    assert sorted(r["policy"] for r in doc["runs"]) == ["b0", "oracle", "swapaware"]
    assert all(r["jobs"] == 3 for r in doc["runs"])
