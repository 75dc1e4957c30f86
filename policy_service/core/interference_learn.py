"""Learning a site's compute interference from its own shared runs (issue 35, first part). Pure.

Each finished run that shared a GPU is one ``InterferenceObs``: its class's solo utilisation
``u_self``, the summed solo utilisations of its co-runners ``u_others``, the GPU type and its
slowdown against its class's solo runtime (the caller compares within the class). Per GPU type
the family of ``core.interference`` is fitted to them, ``s(u, v) = 1 + a v + b max(0, u + v - 1)``:

* **Prior.** The configured fit (``swapcost.compute_interference_*``, Gavel's by default) counts
  as ``prior_weight`` pseudo-observations spread evenly over a 5 x 5 grid of (u, v) in
  [0.1, 0.9], each at the prior's own prediction. Evidence outgrows it: the fit weighs both.
* **Robust fit.** Least absolute error over evidence and prior points (a weighted median
  regression): runtime noise that is not sharing moves it by its median, not its mean, and an
  observation far off moves it no further than one a little off. The objective is convex in
  (a, b); for a fixed ``a`` the best ``b`` is a weighted median (exact), the profile in ``a`` is
  convex again, so a golden-section search on ``a`` finds the optimum: ~30 weighted medians,
  ~37 ms for a full window of 2,000 observations in CPython (refit every few runs, not per run).
* **Bounds.** One user's observations together weigh at most ``r x`` (everyone else's
  observations + the prior's weight), ``r = max_user_share / (1 - max_user_share)``; likewise
  one class's (``max_class_share``). With the default 0.1 a user is at most a tenth of the total
  where the rest counts in full, so no user steers the site model with their own runtimes: a
  weighted median regression with one user at weight share ``e < 1/2`` stays where the other
  users' residuals balance within ``e``, however far that user's slowdowns are inflated
  (``user_influence`` measures how far one user moves it). A site with few users therefore learns
  slowly: with k users the evidence weighs at most ``r((k-1) N + k P)``.
* **Minimum evidence.** Below ``min_runs`` observations or ``min_users`` users of a GPU type the
  prior is the model, with the reason; only the most recent ``window`` observations count.

Observations are validated first (``check``): utilisations finite and in [0, 1] (co-runners'
sum in (0, max_others_util]), a GPU type and a user named; the slowdown finite, clamped to
[slowdown_min, slowdown_max] (the clamp is in the reason).
"""
from __future__ import annotations

import enum
import math
from collections import Counter
from dataclasses import dataclass, replace
from typing import Sequence

from policy_service.config import InterferenceConfig, SwapCostConfig
from policy_service.core.interference import KneeParams, grid_mae, knee_slowdown, uniform_pairs

PRIOR_GRID = tuple((0.1 + 0.2 * i, 0.1 + 0.2 * j) for i in range(5) for j in range(5))
# The (u, v) points over which two models are compared: 10 x 10 midpoints of [0.1, 1]^2.
COMPARE_GRID = tuple(uniform_pairs(0.1, 10))
_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0
LearnConfig = InterferenceConfig  # the [interference] section: what the learner reads of it


class Refusal(enum.Enum):
    NONE = "none"
    NOT_FINITE = "not_finite"
    UTIL_RANGE = "util_range"
    NOT_SHARED = "not_shared"
    UNNAMED = "unnamed"


class Source(enum.Enum):
    PRIOR = "prior"
    LEARNED = "learned"


@dataclass(frozen=True)
class InterferenceObs:
    """One finished run that shared a GPU (slowdown: its runtime / its class's solo runtime)."""

    gpu_type: str
    user: str
    job_class: str
    u_self: float
    u_others: float
    slowdown: float


@dataclass(frozen=True)
class Checked:
    """An observation as it will count (``obs``; None when refused) and why."""

    obs: InterferenceObs | None
    refusal: Refusal
    reason: str


@dataclass(frozen=True)
class Prior:
    name: str
    params: KneeParams


@dataclass(frozen=True)
class Evidence:
    """One GPU type's most recent observations, oldest first (at most ``LearnConfig.window``)."""

    gpu_type: str
    obs: tuple[InterferenceObs, ...] = ()


@dataclass(frozen=True)
class LearnedModel:
    """The interference model of one GPU type and where it comes from."""

    gpu_type: str
    source: Source
    params: KneeParams
    prior: Prior
    runs: int
    users: int
    evidence_weight: float  # the observations' weight after the bounds
    prior_weight: float
    fit_mae: float | None  # weighted mean absolute error on the observations; None for the prior
    reason: str
    # the co-runners' summed solo utilisation in the observations, weighted as the fit (how busy the
    # site's shared GPUs are kept beside a job); None for the prior
    co_util: float | None = None


def prior_from_config(cfg: SwapCostConfig, name: str = "gavel") -> Prior:
    """The configured fit (swap_cost.compute_interference_*) as the prior; ``name``: what
    reasons call it ([interference] prior_name)."""
    return Prior(name, KneeParams(cfg.compute_interference_base, cfg.compute_interference_knee_slope))


def _refuse(refusal: Refusal, reason: str) -> Checked:
    return Checked(None, refusal, reason)


def check(obs: InterferenceObs, cfg: LearnConfig) -> Checked:
    """Validate one observation: refused with a reason, or accepted (slowdown clamped)."""
    if not obs.gpu_type or not obs.user:
        return _refuse(Refusal.UNNAMED, "no GPU type or no user: the observation cannot be bounded")
    nums = (obs.u_self, obs.u_others, obs.slowdown)
    if not all(isinstance(x, (int, float)) and math.isfinite(x) for x in nums):
        return _refuse(Refusal.NOT_FINITE, f"not finite: u_self {obs.u_self}, u_others {obs.u_others}, "
                                           f"slowdown {obs.slowdown}")
    if not 0.0 <= obs.u_self <= 1.0:
        return _refuse(Refusal.UTIL_RANGE, f"u_self {obs.u_self} outside [0, 1]")
    if obs.u_others <= 0.0:
        return _refuse(Refusal.NOT_SHARED, f"u_others {obs.u_others}: no co-runner used the GPU")
    if obs.u_others > cfg.max_others_util:
        return _refuse(Refusal.UTIL_RANGE, f"u_others {obs.u_others} above {cfg.max_others_util}")
    s = min(cfg.slowdown_max, max(cfg.slowdown_min, obs.slowdown))
    if s != obs.slowdown:
        return Checked(replace(obs, slowdown=s), Refusal.NONE, f"slowdown {obs.slowdown:g} clamped to {s:g}")
    return Checked(obs, Refusal.NONE, "")


def observe(ev: Evidence, obs: InterferenceObs, cfg: LearnConfig) -> tuple[Evidence, Checked]:
    """The evidence with one more observation, if it is valid and of this GPU type."""
    c = check(obs, cfg)
    if c.obs is None:
        return ev, c
    if c.obs.gpu_type != ev.gpu_type:
        return ev, _refuse(Refusal.UNNAMED, f"GPU type {c.obs.gpu_type!r} is not {ev.gpu_type!r}")
    return Evidence(ev.gpu_type, (ev.obs + (c.obs,))[-cfg.window:]), c


def _factors(keys: Sequence[str], share: float, prior_weight: float) -> dict[str, float]:
    """Per key, the factor that holds its observations' weight to r x (the rest + the prior)."""
    r = share / (1.0 - share)
    n = len(keys)
    out = {}
    for key, k in Counter(keys).items():
        cap = r * (n - k + prior_weight)
        out[key] = min(1.0, cap / k)
    return out


def weights(obs: Sequence[InterferenceObs], cfg: LearnConfig) -> list[float]:
    """Each observation's weight: 1, less where its user's or its class's share is capped."""
    users = _factors([o.user for o in obs], cfg.max_user_share, cfg.prior_weight)
    classes = _factors([o.job_class for o in obs], cfg.max_class_share, cfg.prior_weight)
    return [min(users[o.user], classes[o.job_class]) for o in obs]


def weighted_median(values: Sequence[float], ws: Sequence[float]) -> float:
    """The lower weighted median: the smallest value whose cumulative weight reaches half."""
    pairs = sorted((v, w) for v, w in zip(values, ws) if w > 0)
    if not pairs:
        raise ValueError("weighted_median needs a positive weight")
    half, acc = 0.5 * sum(w for _, w in pairs), 0.0
    for v, w in pairs:
        acc += w
        if acc >= half - 1e-12:
            return v
    return pairs[-1][0]


# A fit point: (v, max(0, u + v - 1), slowdown - 1, weight).
Point = tuple[float, float, float, float]


def _best_slope(points: Sequence[Point], a: float, slope_max: float) -> float:
    over = [(x, y - a * v, w) for v, x, y, w in points if x > 0]
    if not over:
        return 0.0
    b = weighted_median([r / x for x, r, _ in over], [w * x for x, _, w in over])
    return min(slope_max, max(0.0, b))


def _loss(points: Sequence[Point], a: float, b: float) -> float:
    return sum(w * abs(y - a * v - b * x) for v, x, y, w in points)


def fit_lad(points: Sequence[Point], base_max: float, slope_max: float, tol: float = 1e-4) -> KneeParams:
    """Weighted least-absolute-error (a, b) on [0, base_max] x [0, slope_max] (see the module doc)."""
    def profile(a: float) -> float:
        return _loss(points, a, _best_slope(points, a, slope_max))

    lo, hi = 0.0, base_max
    x1, x2 = hi - _GOLDEN * (hi - lo), lo + _GOLDEN * (hi - lo)
    f1, f2 = profile(x1), profile(x2)
    while hi - lo > tol:
        if f1 <= f2:
            hi, x2, f2 = x2, x1, f1
            x1 = hi - _GOLDEN * (hi - lo)
            f1 = profile(x1)
        else:
            lo, x1, f1 = x1, x2, f2
            x2 = lo + _GOLDEN * (hi - lo)
            f2 = profile(x2)
    cands = [(profile(a), a) for a in (0.0, 0.5 * (lo + hi), base_max)]
    a = min(cands)[1]
    return KneeParams(a, _best_slope(points, a, slope_max))


def _points(obs: Sequence[InterferenceObs], ws: Sequence[float], prior: Prior, prior_weight: float) -> list[Point]:
    pts = [(o.u_others, max(0.0, o.u_self + o.u_others - 1.0), o.slowdown - 1.0, w) for o, w in zip(obs, ws)]
    each = prior_weight / len(PRIOR_GRID)
    for u, v in PRIOR_GRID:
        y = knee_slowdown(u, v, prior.params.base, prior.params.slope) - 1.0
        pts.append((v, max(0.0, u + v - 1.0), y, each))
    return pts


def learn(ev: Evidence, prior: Prior, cfg: LearnConfig) -> LearnedModel:
    """The interference model of ``ev``'s GPU type: the prior until there is enough evidence,
    then the bounded robust fit to the evidence and the prior together."""
    obs = ev.obs[-cfg.window:]
    users = len({o.user for o in obs})
    base = LearnedModel(ev.gpu_type, Source.PRIOR, prior.params, prior, len(obs), users, 0.0, cfg.prior_weight,
                        None, "")
    where = "all GPU types" if ev.gpu_type == "*" else ev.gpu_type  # "*": interference_rule.ANY_TYPE
    if len(obs) < cfg.min_runs:
        return replace(base, reason=f"prior ({prior.name}): {len(obs)} shared runs on {where} < min {cfg.min_runs}")
    if users < cfg.min_users:
        return replace(base, reason=f"prior ({prior.name}): {users} users on {where} < min {cfg.min_users}")
    ws = weights(obs, cfg)
    params = fit_lad(_points(obs, ws, prior, cfg.prior_weight), cfg.base_max, cfg.slope_max)
    w = sum(ws)
    err = sum(wi * abs(knee_slowdown(o.u_self, o.u_others, params.base, params.slope) - o.slowdown)
              for o, wi in zip(obs, ws)) / w
    reason = (f"learned from {len(obs)} shared runs of {users} users on {where}: a {params.base:.3f}, "
              f"b {params.slope:.3f} (evidence weight {w:.0f}, prior {prior.name} {cfg.prior_weight:.0f})")
    co_util = sum(wi * o.u_others for o, wi in zip(obs, ws)) / w
    return replace(base, source=Source.LEARNED, params=params, evidence_weight=w, fit_mae=err, reason=reason,
                   co_util=co_util)


def model_error(p: KneeParams, q: KneeParams, points: Sequence[tuple[float, float]] = COMPARE_GRID) -> float:
    """Mean absolute slowdown difference of two models over (u, v) points (COMPARE_GRID)."""
    return grid_mae(p, q, points)


def user_influence(ev: Evidence, user: str, prior: Prior, cfg: LearnConfig) -> float:
    """How far one user's observations move the model: ``model_error`` with them against without."""
    without = Evidence(ev.gpu_type, tuple(o for o in ev.obs if o.user != user))
    return model_error(learn(ev, prior, cfg).params, learn(without, prior, cfg).params)


@dataclass(frozen=True)
class SharedRun:
    """What the service knows of one finished run that shared a GPU: the run, its class's solo
    figures (runtime, utilisation; None: not learned) and each co-runner's learned solo
    utilisation (None: not learned)."""

    gpu_type: str
    user: str
    job_class: str
    runtime_s: float
    exit_code: int
    solo_runtime_s: float
    solo_runs: int
    u_self: float | None
    u_others: tuple[float | None, ...]


def from_run(run: SharedRun) -> tuple[InterferenceObs | None, str]:
    """The run as an observation (its slowdown: its runtime over its class's solo runtime, compared
    within the class), or None and why it teaches nothing."""
    if not run.u_others:
        return None, "no co-runner"
    if run.exit_code != 0 or not run.runtime_s > 0:
        return None, "failed, or no runtime"
    if run.solo_runs < 1 or not run.solo_runtime_s > 0:
        return None, "its class has no solo runtime yet"
    if run.u_self is None:
        return None, "its class's solo utilisation is not learned yet"
    if any(u is None for u in run.u_others):
        return None, "a co-runner's solo utilisation is not learned yet"
    return InterferenceObs(run.gpu_type, run.user, run.job_class, run.u_self, float(sum(run.u_others)),
                           run.runtime_s / run.solo_runtime_s), ""
