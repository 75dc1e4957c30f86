"""The seed paper's scenario: 4 jobs, 24 GB of demand on an 18 GB GPU."""
from __future__ import annotations

import pytest

from policy_service.config import AccessClass, Config
from policy_service.sim.config import SimConfig
from policy_service.sim.seed_scenario import SeedScenario, run_seed_scenario


@pytest.mark.parametrize("access, per_corunner", [
    (AccessClass.STREAMING, 0.47),
    (AccessClass.STREAMING, 0.15),
    (AccessClass.RANDOM, 0.47),
])
def test_seed_scenario(access, per_corunner):
    r = run_seed_scenario(Config(), SimConfig(), per_corunner, SeedScenario(access=access))
    assert r["naive"]["ooms"] == 0 and r["swapaware"]["ooms"] == 0
    assert all(r["naive"]["swapped"])  # demand paging hits every job
    # swapaware: all four co-located (charged below their peak), only the lowest-priority job swaps
    assert all(g == "gres:shard:1" for g in r["swapaware"]["gres"])
    assert r["swapaware"]["swapped"] == [False, False, False, True]
    assert r["total_improvement"] >= 0.16
    assert r["top_job_added_latency_s"] == pytest.approx(0.0, abs=1e-6)
