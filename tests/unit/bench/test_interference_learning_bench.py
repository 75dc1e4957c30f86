"""bench/interference_learning.py's arithmetic: the tally-derived truth, the runs-to-target rule and
a short replay's shape."""
import pytest

from policy_service.core.interference import knee_slowdown
from policy_service.core.interference_learn import LearnConfig, Prior

from tests.unit.bench_loader import load_bench

bench = load_bench("interference_learning")


def test_tally_truth_passes_through_both_medians():
    p = bench.tally_params()
    # a = (2.9 - 1/0.51) / 0.6, b = (1/0.51 - 1 - 0.3 a) / 0.2
    assert p.base == pytest.approx((2.9 - 1 / 0.51) / 0.6)
    assert p.slope == pytest.approx((1 / 0.51 - 1 - 0.3 * p.base) / 0.2)
    assert knee_slowdown(0.9, 0.3, p.base, p.slope) == pytest.approx(1 / 0.51)
    assert knee_slowdown(0.3, 0.9, p.base, p.slope) == pytest.approx(2.9)


def test_runs_within_is_the_first_checkpoint_it_stays_under():
    assert bench.runs_within({25: 0.3, 50: 0.04, 75: 0.06, 100: 0.04, 125: 0.01}, 0.05) == 100
    assert bench.runs_within({25: 0.3, 50: 0.2}, 0.05) is None
    assert bench.runs_within({25: 0.01}, 0.05) == 25


def test_the_noise_is_sized_to_the_truths_own_error():
    truth = bench.truths()["lucid"]
    site = bench.Site(truth, seed=1, users=10)
    own, excess = bench.held_out_excess(site, truth.params, n=4000)
    assert own == pytest.approx(truth.noise_mae, rel=0.1) and excess == 0.0


def test_a_short_replay_records_each_step():
    ts = bench.truths()
    r = bench.replay(ts["lucid"], Prior("gavel", ts["gavel"].params), seed=1, runs=100, users=10, cfg=LearnConfig())
    assert sorted(r["errors"]) == [25, 50, 75, 100] and r["excess"] is None
    assert r["errors"][100] < r["errors"][25]
