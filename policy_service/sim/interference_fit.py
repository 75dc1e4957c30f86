"""Fits of the simulator's compute-interference model to measured co-located GPU job pairs.

The model (``core.interference``, evaluated by ``swapcost.interference_slowdown``): a job with
solo utilisation ``u`` (0..1) next to co-runners whose solo utilisations sum to ``v`` is slowed

    s(u, v) = 1 + base x v + slope x max(0, u + v - 1)

``base = 0, slope = 1`` is ``max(1, u + v)``: the GPU is time-sliced, and a pair whose summed
utilisation fits one GPU is not slowed at all. The same family therefore holds the "knee"
(base > 0, a steep slope) and the model linear in the summed utilisation (base = 0).

Two ways to fit, by what the source records:

* per pair (``fit_pairs``): the source measured each job's solo utilisation (Lucid's profiles):
  least absolute error of the predicted slowdown over every measured (job, co-runner) pair;
* by distribution (``fit_knee``): the source records no utilisation (Gavel): the job types' solo
  utilisations are assumed uniform on [util_lo, 1] and the model's p10..p90 quantiles of the pair
  slowdown are matched to the measured ones (least squares).

Scores: ``score_pairs`` (MAE, Spearman, means) where utilisations are measured;
``score_distribution`` (mean absolute difference of matched quantiles, means) where they are not.
Pure functions; no I/O (the loaders are ``sim.gavel`` and ``sim.colocation``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from policy_service.core.interference import KneeParams, knee_slowdown, mae, uniform_pairs

__all__ = ["KneeFit", "KneeParams", "PairFit", "PairObs", "Score", "fit_knee", "fit_pairs", "knee_slowdown",
           "mae", "predict", "quantile", "ranks", "score_distribution", "score_pairs", "spearman",
           "uniform_pairs"]

@dataclass(frozen=True)
class PairObs:
    """One measured job next to one co-runner: solo utilisations and the measured slowdown
    (solo throughput / co-located throughput)."""

    u_self: float
    u_other: float
    slowdown: float


@dataclass(frozen=True)
class Score:
    """How a parameter set predicts one source's measurements. ``mae``: per pair where the source
    measured utilisations, else the mean absolute difference of matched quantiles; ``spearman``:
    None where per-pair predictions cannot be made (no utilisations)."""

    n: int
    mae: float
    spearman: float | None
    mean_measured: float
    mean_predicted: float
    per_pair: bool


@dataclass(frozen=True)
class PairFit:
    params: KneeParams
    mae: float  # on the pairs it was fitted to
    n: int


@dataclass(frozen=True)
class KneeFit:
    """Distribution fit (no measured utilisations): base, slope and util_lo such that the model's
    p10..p90 quantiles of (slowdown - 1) under solo utilisations ~ U[util_lo, 1] match the measured
    ones (least squares over a grid)."""

    base: float
    slope: float
    util_lo: float
    rms_error: float  # of the fitted quantiles
    quantiles_measured: dict[str, float]
    quantiles_model: dict[str, float]


def predict(params: KneeParams, pairs: Sequence[PairObs]) -> list[float]:
    return [knee_slowdown(p.u_self, p.u_other, params.base, params.slope) for p in pairs]


def ranks(xs: Sequence[float]) -> list[float]:
    """1-based ranks, ties given the mean of the ranks they span."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    out = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2.0 + 1.0
        i = j + 1
    return out


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation (Pearson's on tie-averaged ranks); 0.0 where either is constant."""
    if len(a) != len(b) or len(a) < 2:
        raise ValueError("spearman needs two sequences of the same length, at least 2")
    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra)
    vb = sum((y - mb) ** 2 for y in rb)
    return 0.0 if va == 0 or vb == 0 else cov / math.sqrt(va * vb)


def score_pairs(params: KneeParams, pairs: Sequence[PairObs]) -> Score:
    pred = predict(params, pairs)
    meas = [p.slowdown for p in pairs]
    return Score(n=len(pairs), mae=mae(pred, meas), spearman=spearman(pred, meas),
                 mean_measured=sum(meas) / len(meas), mean_predicted=sum(pred) / len(pred), per_pair=True)


def quantile(sorted_xs: Sequence[float], p: float) -> float:
    """Nearest-rank-below quantile of an ascending sequence (the fit's convention)."""
    return sorted_xs[min(len(sorted_xs) - 1, int(p * len(sorted_xs)))]


def score_distribution(params: KneeParams, slowdowns: Sequence[float], util_lo: float = 0.0,
                       points: int = 100) -> Score:
    """Score against measured slowdowns with no utilisations: the model's slowdowns over solo
    utilisations ~ U[util_lo, 1] (independent) against the measured ones, quantile by quantile
    at p = (i + 0.5) / points: the mean absolute difference (a 1-Wasserstein distance)."""
    if not slowdowns:
        raise ValueError("no measured slowdowns")
    model = sorted(knee_slowdown(u, v, params.base, params.slope) for u, v in uniform_pairs(util_lo))
    meas = sorted(slowdowns)
    ps = [(i + 0.5) / points for i in range(points)]
    diff = mae([quantile(model, p) for p in ps], [quantile(meas, p) for p in ps])
    return Score(n=len(meas), mae=diff, spearman=None, mean_measured=sum(meas) / len(meas),
                 mean_predicted=sum(model) / len(model), per_pair=False)


def _grid(lo: float, hi: float, step: float) -> list[float]:
    return [round(lo + step * i, 6) for i in range(int(round((hi - lo) / step)) + 1)]


def fit_pairs(pairs: Sequence[PairObs], fix_base: float | None = None, base_max: float = 1.0,
              slope_max: float = 4.0) -> PairFit:
    """Least-absolute-error fit of (base, slope) to pairs with measured utilisations: a grid of
    step 0.02 (base) x 0.05 (slope), then a grid of step 0.005 around the best. ``fix_base``
    holds base (0.0: the family linear in the summed utilisation above one GPU)."""
    if len(pairs) < 10:
        raise ValueError("need at least 10 measured pairs")
    meas = [p.slowdown for p in pairs]
    us = [(p.u_other, max(0.0, p.u_self + p.u_other - 1.0)) for p in pairs]

    def err(a: float, b: float) -> float:
        return sum(abs(1.0 + a * v + b * over - y) for (v, over), y in zip(us, meas))

    def search(bases: list[float], slopes: list[float]) -> tuple[float, float, float]:
        best = None
        for a in bases:
            for b in slopes:
                e = err(a, b)
                if best is None or e < best[0] - 1e-12:
                    best = (e, a, b)
        return best

    bases = [fix_base] if fix_base is not None else _grid(0.0, base_max, 0.02)
    _, a0, b0 = search(bases, _grid(0.0, slope_max, 0.05))
    fine_a = [fix_base] if fix_base is not None else [x for x in _grid(a0 - 0.02, a0 + 0.02, 0.005) if x >= 0]
    e, a, b = search(fine_a, [x for x in _grid(b0 - 0.05, b0 + 0.05, 0.005) if x >= 0])
    return PairFit(params=KneeParams(base=a, slope=b), mae=e / len(pairs), n=len(pairs))


_KNEE_PS = tuple(round(0.1 * k, 1) for k in range(1, 10))


def fit_knee(slowdowns: Sequence[float], fix_base: float | None = None) -> KneeFit:
    """Fit (base, slope, util_lo) of the model to measured pair slowdowns given as
    ``solo / paired - 1`` (no utilisations; see KneeFit). ``fix_base`` holds base."""
    if len(slowdowns) < 10:
        raise ValueError("need at least 10 measured pairs")
    s = sorted(slowdowns)
    meas = [quantile(s, p) for p in _KNEE_PS]
    best = None
    bases = [fix_base] if fix_base is not None else [0.02 * ia for ia in range(31)]
    for k in range(10):
        lo = 0.1 * k
        pairs = uniform_pairs(lo)
        idx = [min(len(pairs) - 1, int(p * len(pairs))) for p in _KNEE_PS]
        for a in bases:
            for ib in range(41):
                b = 0.1 * ib
                v = sorted(a * uo + b * max(0.0, us + uo - 1.0) for us, uo in pairs)
                err = sum((v[i] - y) ** 2 for i, y in zip(idx, meas))
                if best is None or err < best[0] - 1e-12:
                    best = (err, a, b, lo, [v[i] for i in idx])
    err, base, slope, lo, model = best
    return KneeFit(base=base, slope=slope, util_lo=lo, rms_error=math.sqrt(err / len(meas)),
                   quantiles_measured={f"p{int(p * 100)}": v for p, v in zip(_KNEE_PS, meas)},
                   quantiles_model={f"p{int(p * 100)}": v for p, v in zip(_KNEE_PS, model)})
