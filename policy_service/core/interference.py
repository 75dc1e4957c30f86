"""The compute-interference family shared by the service, its learner and the simulator. Pure.

A job with solo GPU utilisation ``u`` (0..1) next to co-runners whose solo utilisations sum to
``v`` is slowed ``s(u, v) = 1 + base x v + slope x max(0, u + v - 1)`` (docs/model.md,
"Interference: two sources"). ``swapcost.interference_slowdown`` evaluates it with the configured
parameters, ``core.interference_learn`` fits it to a site's own shared runs and
``sim.interference_fit`` to published measurements (it re-exports these names).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class KneeParams:
    base: float
    slope: float


def knee_slowdown(u_self: float, u_others: float, base: float, slope: float) -> float:
    """The model's slowdown of a job with solo utilisation u_self next to co-runners summing u_others."""
    return 1.0 + base * u_others + slope * max(0.0, u_self + u_others - 1.0)


def mae(pred: Sequence[float], meas: Sequence[float]) -> float:
    if len(pred) != len(meas) or not pred:
        raise ValueError("mae needs two non-empty sequences of the same length")
    return sum(abs(a - b) for a, b in zip(pred, meas)) / len(pred)


def uniform_pairs(lo: float, n: int = 24) -> list[tuple[float, float]]:
    """A grid of n x n (u_self, u_other) pairs, each uniform on [lo, 1] (midpoints)."""
    us = [lo + (1.0 - lo) * (i + 0.5) / n for i in range(n)]
    return [(a, b) for a in us for b in us]


def grid_mae(p: KneeParams, q: KneeParams, points: Sequence[tuple[float, float]]) -> float:
    """Mean absolute difference of two parameter sets' slowdowns over (u_self, u_others) points."""
    return mae([knee_slowdown(u, v, p.base, p.slope) for u, v in points],
               [knee_slowdown(u, v, q.base, q.slope) for u, v in points])
