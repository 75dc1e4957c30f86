"""interference_fit: the model, the scores and the fits, against hand-computed cases."""
from __future__ import annotations

import pytest

from policy_service.sim.interference_fit import (
    KneeParams,
    PairObs,
    fit_knee,
    fit_pairs,
    knee_slowdown,
    mae,
    ranks,
    score_distribution,
    score_pairs,
    spearman,
)


def test_knee_slowdown_by_hand():
    assert knee_slowdown(0.6, 0.7, 0.5, 2.0) == pytest.approx(1 + 0.5 * 0.7 + 2.0 * 0.3)  # 1.95
    assert knee_slowdown(0.2, 0.3, 0.5, 2.0) == pytest.approx(1.15)  # below the knee: base only
    # base 0, slope 1 is max(1, u1 + u2)
    assert knee_slowdown(0.3, 0.4, 0.0, 1.0) == 1.0
    assert knee_slowdown(0.8, 0.7, 0.0, 1.0) == pytest.approx(1.5)


def test_mae_and_ranks_by_hand():
    assert mae([1, 2, 3], [1, 3, 5]) == pytest.approx(1.0)
    assert ranks([10, 20, 20, 5]) == [2.0, 3.5, 3.5, 1.0]
    with pytest.raises(ValueError):
        mae([1], [1, 2])


def test_spearman_by_hand():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # rank differences 0, 1, 1, 0: 1 - 6 x 2 / (4 x 15) = 0.8
    assert spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
    assert spearman([1, 1, 1], [1, 2, 3]) == 0.0  # a constant has no ranking


def test_score_pairs_by_hand():
    pairs = [PairObs(0.3, 0.4, 1.0), PairObs(0.8, 0.7, 1.6)]
    s = score_pairs(KneeParams(0.0, 1.0), pairs)  # predicts 1.0 and 1.5
    assert s.mae == pytest.approx(0.05) and s.spearman == pytest.approx(1.0)
    assert s.mean_predicted == pytest.approx(1.25) and s.mean_measured == pytest.approx(1.3)
    assert s.per_pair and s.n == 2


def test_score_distribution_by_hand():
    # base 0, slope 0: the model says 1.0 for every pair; measured all 1.5 -> every quantile 0.5 off
    s = score_distribution(KneeParams(0.0, 0.0), [1.5] * 20)
    assert s.mae == pytest.approx(0.5) and s.spearman is None and not s.per_pair
    assert s.mean_predicted == pytest.approx(1.0) and s.mean_measured == pytest.approx(1.5)


def _grid_pairs(base: float, slope: float) -> list[PairObs]:
    us = [0.1 * i for i in range(1, 10)]
    return [PairObs(u, v, knee_slowdown(u, v, base, slope)) for u in us for v in us]


def test_fit_pairs_recovers_the_parameters_and_ignores_one_outlier():
    pairs = _grid_pairs(0.1, 0.8)
    fit = fit_pairs(pairs)
    assert (fit.params.base, fit.params.slope) == pytest.approx((0.1, 0.8), abs=1e-9)
    assert fit.mae == pytest.approx(0.0, abs=1e-9)
    # least absolute error: one wild measurement does not move the fit
    fit2 = fit_pairs(pairs + [PairObs(0.5, 0.5, 10.0)])
    assert (fit2.params.base, fit2.params.slope) == pytest.approx((0.1, 0.8), abs=1e-9)


def test_fit_pairs_with_base_held_fits_the_slope_alone():
    fit = fit_pairs(_grid_pairs(0.0, 1.7), fix_base=0.0)
    assert fit.params.base == 0.0 and fit.params.slope == pytest.approx(1.7, abs=1e-9)
    # data with a base: held at 0 the slope absorbs what it can, and the error is not 0
    held = fit_pairs(_grid_pairs(0.3, 1.0), fix_base=0.0)
    assert held.params.base == 0.0 and held.mae > 0.01
    with pytest.raises(ValueError):
        fit_pairs(_grid_pairs(0.1, 1.0)[:9])


def test_fit_knee_with_base_held():
    slow = [p.slowdown - 1.0 for p in _grid_pairs(0.0, 2.0)]
    fit = fit_knee(slow, fix_base=0.0)
    assert fit.base == 0.0 and fit.rms_error < 0.1
