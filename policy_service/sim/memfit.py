"""Fits of the simulator's memory model to measured GPU memory series (pure functions).

Input: runs cut from the Alibaba ``cluster-trace-v2026-GenAI`` series by ``memtrace.cut_runs``
(one window of a container's series = one run of its class). Two things are fitted:

* within-run growth: a run "grows" when its peak exceeds its first sample by more than
  ``grow_threshold``; for growing runs ``log(peak / first)`` is taken as normal (median, sigma),
  and the moment the peak is reached, as a fraction of the window, is summarised;
* run-to-run variation: ``d = log(peak_k / peak_{k-1})`` over consecutive windows of a
  container is a two-part mixture: most runs repeat their peak within ``jump`` (a narrow normal),
  a fraction moves by more. The simulator draws each run's peak as the class peak times
  ``exp(e)`` with ``e`` i.i.d. from a two-normal mixture; its parameters are solved so that the
  difference of two draws reproduces the measured share of jumps and their rms.

    python -m policy_service.sim.memfit ../shared/data/alibaba-v2026-genai   # prints the fit (JSON)
"""
from __future__ import annotations

import json
import math
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

from policy_service.sim.memtrace import Run, Series, cut_runs, load_duty, load_memory

WINDOW_S = 1800.0
MIN_PEAK_BYTES = 256 * 1024**2  # an idle container (driver context only) is not a run


def _q(xs: Sequence[float], p: float) -> float:
    return xs[min(len(xs) - 1, int(p * len(xs)))]


@dataclass(frozen=True)
class GrowthFit:
    runs: int
    grow_prob: float  # share of runs whose peak exceeds the first sample by > grow_threshold
    log_growth_median: float  # of log(peak / first) over growing runs
    log_growth_sigma: float
    peak_time_frac_quartiles: tuple[float, float, float]  # when the peak is reached (fraction of the run)
    ratio_quantiles: dict[str, float]  # peak / first over all runs


@dataclass(frozen=True)
class VariationFit:
    pairs: int
    jump: float  # |d| above this is a jump
    diff_jump_prob: float
    diff_sigma_small: float
    diff_sigma_jump: float
    run_jump_prob: float  # per-run parameters of the i.i.d. mixture the simulator draws
    run_sigma_small: float
    run_sigma_jump: float
    diff_quantiles: dict[str, float]


def fit_growth(runs: Sequence[Run], grow_threshold: float = 0.01) -> GrowthFit:
    if not runs:
        raise ValueError("no runs to fit")
    ratios = sorted(r.peak_bytes / max(1, r.first_bytes) for r in runs)
    growers = [r for r in runs if r.peak_bytes > (1.0 + grow_threshold) * max(1, r.first_bytes)]
    logs = [math.log(r.peak_bytes / max(1, r.first_bytes)) for r in growers]
    times = sorted(r.t[r.v.index(r.peak_bytes)] / max(r.t[-1], 1e-9) for r in growers if r.t[-1] > 0)
    return GrowthFit(
        runs=len(runs), grow_prob=len(growers) / len(runs),
        log_growth_median=statistics.median(logs) if logs else 0.0,
        log_growth_sigma=1.4826 * statistics.median([abs(x - statistics.median(logs)) for x in logs]) if logs else 0.0,
        peak_time_frac_quartiles=tuple(_q(times, p) for p in (0.25, 0.5, 0.75)) if times else (0.0, 0.0, 0.0),
        ratio_quantiles={f"p{int(p * 100)}": _q(ratios, p) for p in (0.25, 0.5, 0.75, 0.9, 0.95)})


def consecutive_log_ratios(runs: Sequence[Run]) -> list[float]:
    """log(peak_k / peak_{k-1}) over windows k-1, k of the same container (adjacent windows only)."""
    by: dict[str, list[Run]] = {}
    for r in runs:
        by.setdefault(r.container, []).append(r)
    out = []
    for rs in by.values():
        rs.sort(key=lambda r: r.index)
        for a, b in zip(rs, rs[1:]):
            if b.index == a.index + 1 and a.peak_bytes > 0 and b.peak_bytes > 0:
                out.append(math.log(b.peak_bytes / a.peak_bytes))
    return out


def _tail(sigma: float, jump: float) -> tuple[float, float]:
    """(P(|X| > jump), E[X^2; |X| > jump]) for X ~ Normal(0, sigma)."""
    if sigma <= 0:
        return 0.0, 0.0
    z = jump / sigma
    p = math.erfc(z / math.sqrt(2))
    pdf = math.exp(-z * z / 2) / math.sqrt(2 * math.pi)
    return p, sigma * sigma * (p + 2 * z * pdf)


def diff_mixture(q: float, s_small: float, s_jump: float, jump: float) -> tuple[float, float]:
    """For e1, e2 i.i.d. (Normal(0, s_jump) w.p. q, else Normal(0, s_small)): P(|e1 - e2| > jump)
    and the rms of e1 - e2 given |e1 - e2| > jump."""
    parts = ((1 - q) ** 2, math.sqrt(2) * s_small), (2 * q * (1 - q), math.hypot(s_small, s_jump)), \
        (q * q, math.sqrt(2) * s_jump)
    p = sum(w * _tail(sg, jump)[0] for w, sg in parts)
    m2 = sum(w * _tail(sg, jump)[1] for w, sg in parts)
    return p, math.sqrt(m2 / p) if p > 0 else 0.0


def fit_variation_from_diffs(diffs: Sequence[float], jump: float = 0.05) -> VariationFit:
    """Per-run mixture (q, s_small, s_jump) whose consecutive differences reproduce the measured
    share of |d| > jump and the rms of those jumps (s_small: rms of the small ones / sqrt 2)."""
    if not diffs:
        raise ValueError("no consecutive runs to fit")
    small = [d for d in diffs if abs(d) <= jump]
    big = [d for d in diffs if abs(d) > jump]
    rms = lambda xs: math.sqrt(sum(x * x for x in xs) / len(xs)) if xs else 0.0  # noqa: E731 (mean 0 by symmetry)
    p, r_big = len(big) / len(diffs), rms(big)
    s_small = rms(small) / math.sqrt(2)
    q, s_jump = 0.0, r_big / math.sqrt(2)
    if big:
        for _ in range(60):  # alternate: q for the share of jumps, s_jump for their rms
            lo, hi = 0.0, 1.0
            for _ in range(50):
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if diff_mixture(mid, s_small, s_jump, jump)[0] < p else (lo, mid)
            q = (lo + hi) / 2
            lo, hi = 1e-6, 10.0
            for _ in range(50):
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if diff_mixture(q, s_small, mid, jump)[1] < r_big else (lo, mid)
            s_jump = (lo + hi) / 2
    srt = sorted(diffs)
    return VariationFit(
        pairs=len(diffs), jump=jump, diff_jump_prob=p, diff_sigma_small=rms(small), diff_sigma_jump=r_big,
        run_jump_prob=q, run_sigma_small=s_small, run_sigma_jump=s_jump,
        diff_quantiles={f"p{int(x * 100)}": _q(srt, x) for x in (0.05, 0.25, 0.5, 0.75, 0.95)})


def fit_variation(runs: Sequence[Run], jump: float = 0.05) -> VariationFit:
    return fit_variation_from_diffs(consecutive_log_ratios(runs), jump)


def duty_scale(series: Sequence[Series]) -> float:
    """100 when the duty cycle is published in percent, 1 when as a fraction."""
    top = max((max(s.v) for s in series if s.v), default=0.0)
    return 100.0 if top > 1.0 else 1.0


def fit_duty(series: Sequence[Series]) -> dict[str, float]:
    """Per-container mean GPU utilisation (0..1): quantiles (context for the utilisation assumption)."""
    scale = duty_scale(series)
    means = sorted(statistics.fmean(s.v) / scale for s in series if s.v)
    return {"containers": len(means), "scale": scale,
            **{f"p{int(p * 100)}": _q(means, p) for p in (0.1, 0.25, 0.5, 0.75, 0.9)}}


def fit_trace(data_dir: Path, window_s: float = WINDOW_S) -> dict:
    """The whole fit of one trace folder, with its source: what the results record."""
    data_dir = Path(data_dir)
    mem = load_memory(data_dir)
    runs = [r for s in mem for r in cut_runs(s, window_s, min_peak_bytes=MIN_PEAK_BYTES)]
    out = {"source": {"path": str(data_dir), "window_s": window_s, "containers": len(mem),
                      "command": f"python -m policy_service.sim.memfit {data_dir}"},
           "growth": asdict(fit_growth(runs)), "variation": asdict(fit_variation(runs))}
    try:
        out["duty"] = fit_duty(load_duty(data_dir))
    except Exception as exc:  # noqa: BLE001 - the duty file is context only
        out["duty"] = {"error": str(exc)}
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print("usage: python -m policy_service.sim.memfit DATA_DIR [WINDOW_S]", file=sys.stderr)
        return 2
    print(json.dumps(fit_trace(Path(args[0]), float(args[1]) if len(args) > 1 else WINDOW_S), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
