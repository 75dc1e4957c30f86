"""bench/interference_policy.py: the learning variants' observation noise, the warm variant's
evidence from replays of other seeds, and a short run's table."""
import math
import statistics

import pytest

from policy_service.core.interference import knee_slowdown
from policy_service.core.interference_learn import COMPARE_GRID

from tests.unit.bench_loader import load_bench

bench = load_bench("interference_policy")


def test_the_observation_noise_has_the_truths_own_error():
    # lognormal(0, s) has mean absolute deviation from its median 1 of about s sqrt(2/pi) for a small s:
    # sized so that times the grid's mean slowdown it is the truth's fitting error
    for name in bench.TRUTHS:
        t = bench.truths()[name]
        mean = statistics.fmean(knee_slowdown(u, v, t.params.base, t.params.slope) for u, v in COMPARE_GRID)
        assert bench.obs_sigma(name) * math.sqrt(2 / math.pi) * mean == pytest.approx(t.noise_mae)


def test_a_short_run_prints_every_variant_and_the_warm_evidence(capsys):
    assert bench.main(["--jobs", "150", "--loads", "0.9", "--warm-runs", "30", "--refit-every", "10"]) == 0
    out = capsys.readouterr().out
    rows = [ln for ln in out.splitlines() if ln.startswith("| ") and "%" in ln]
    assert len(rows) == len(bench.TRUTHS)
    for ln in rows:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        assert len(cells) == bench.HEADER.count(" | ") + 1
        assert len(cells[5].split(" / ")) == 4  # prior / learned / warm / oracle
        warm, site, per_seed = cells[-3:]
        runs, passes = warm.split(" (")[0], warm.split("(")[1].split(")")[0]
        # warm-up replays of other seeds until 30 shared runs (or MAX_WARM_PASSES)
        assert int(runs.replace(",", "")) >= 30 or float(passes) == bench.MAX_WARM_PASSES
        # the error over the site's shared runs: prior -> learned; warm start -> end ("-": none shared)
        assert all(x == "-" or 0 <= float(x) < 10 for part in site.split("; ") for x in part.split(" -> "))
        assert len(per_seed.split(" / ")) == 1 and per_seed.lstrip("+-").replace(",", "").isdigit()
    assert "failed jobs over all runs: 0" in out


def test_the_site_error_weighs_each_shared_run_where_it_ran():
    from policy_service.core.interference import KneeParams
    from policy_service.core.interference_learn import Evidence, InterferenceObs, model_error
    runs = [InterferenceObs("", "u", "c", 0.2, 0.3, 1.1)] * 3 + [InterferenceObs("", "u", "c", 0.9, 0.8, 2.0)]
    points = bench.site_points(Evidence("", tuple(runs)))
    assert points == ((0.2, 0.3),) * 3 + ((0.9, 0.8),)
    p, q = KneeParams(0.5, 2.0), KneeParams(0.1, 1.0)
    by_hand = (3 * abs(knee_slowdown(0.2, 0.3, 0.5, 2.0) - knee_slowdown(0.2, 0.3, 0.1, 1.0))
               + abs(knee_slowdown(0.9, 0.8, 0.5, 2.0) - knee_slowdown(0.9, 0.8, 0.1, 1.0))) / 4
    assert model_error(p, q, points) == pytest.approx(by_hand)
    assert bench.site_points(Evidence("", ())) == ()
