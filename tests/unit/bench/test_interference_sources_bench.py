"""bench/interference_sources.py's arithmetic: the mean over seeds, the halves and the fits table,
on hand-computed cases."""
import pytest

from policy_service.sim.colocation import PairSource
from policy_service.sim.interference_fit import KneeParams, PairObs, knee_slowdown

from tests.unit.bench_loader import load_bench

bench = load_bench("interference_sources")


def _row(jct, shared, reasons):
    return {"jct_mean_s": jct, "slowdown_mean": 1.0, "high_prio_slowdown_p95": 1.0, "shared_jobs": shared,
            "decision_reasons": reasons}


def test_mean_cells_averages_each_number_and_reason_over_seeds():
    k = ("defaults", 0.7)
    out = bench.mean_cells([{k: _row(100.0, 10, {"compute_bound": 4})},
                            {k: _row(200.0, 20, {"compute_shards": 2})}])
    assert out[k]["jct_mean_s"] == 150.0 and out[k]["shared_jobs"] == 15.0
    # a code one seed never saw counts 0 there
    assert out[k]["decision_reasons"] == {"compute_bound": 2.0, "compute_shards": 1.0}


def _source(base, slope):
    us = [0.1 * i for i in range(1, 10)]
    pairs = tuple(PairObs(u, v, knee_slowdown(u, v, base, slope)) for u in us for v in us)
    return PairSource(name="made", pairs=pairs, slowdowns=tuple(p.slowdown for p in pairs), source={})


def test_halves_split_by_pair_row_and_fit_the_model_that_made_them():
    src = _source(0.1, 0.8)
    for half in (0, 1):
        fit = bench.fit_source(src, half)["knee"]
        assert (fit.base, fit.slope) == pytest.approx((0.1, 0.8))
        assert bench.score(fit, src, 1 - half).mae == pytest.approx(0.0, abs=1e-9)
    # rows 0-1 (one measured pair, both ways) go to half 0, rows 2-3 to half 1
    n0 = bench.score(KneeParams(0.0, 0.0), src, 0).n
    assert n0 == sum(1 for i in range(len(src.pairs)) if (i // 2) % 2 == 0)


def test_fits_table_scores_every_candidate_on_every_source():
    lines = bench.fits_table([_source(0.1, 0.8)])
    made = next(line for line in lines if line.startswith("made:knee"))
    assert made.split()[1:4] == ["0.100", "0.800", "0.000"]  # base, slope, MAE 0 on its own data
    assert any(line.startswith("max(1,u1+u2)") for line in lines)
