"""The estimator's operating curve in GPU-hours, on measured GPU memory series (alibaba-v2026-genai).

Each container is a recurring class, its series cut into 30-minute and 2-hour runs, replayed
online as the service would see them (``real_trace.replay_outcomes`` with ``at_cap`` and
``requeue``: a shared run dies when its memory goes above the bytes of the shards it holds, the
class learns it as an OOM at that cap, and then learns the whole-GPU rerun with its true peak). Per run (one run = one window; S = shards per GPU, k = shards it holds,
h = its length, the window's last sample, in hours):

  * shared run: a scored run the policy puts on k <= S shards (not a cold class, not serving an
    OOM penalty, charge within the GPU);
  * requeued: a shared run whose memory goes above its k shards' bytes; it is OOM-killed at t_oom
    (the first sample above the cap) and rerun once on a whole GPU (issue 22, item 1);
  * saved = (1 - k / S) x h GPU-hours for a shared run that is not requeued (the rest of its GPU
    is free for others); 0 for a requeued run (the rerun holds a whole GPU) and whole-GPU runs;
  * lost = (k / S) x t_oom + requeue_wait_h for a requeued run: the share it held while it ran
    before the OOM (work thrown away) plus the rerun's extra wait for a whole GPU, counted as one
    whole GPU's hours for each hour waited (the job is denied the whole GPU it then needs);
  * charge / peak in shard units = mean over shared runs of k x shard / peak;
  * rounding = mean over shared runs of (k x shard - charge) / peak: the waste of whole shards.

Sweep: ``estimator.quantile_floor_frac`` (the margin floor) x ``estimator.min_samples`` x the shard
(5, 10, 20 GiB of an 80 GiB GPU). The rule: the largest mean over both windows of saved - lost
among the points with <= 1 % of shared runs requeued in each window. The estimator's defaults are
chosen at the configured shard (gpu.shard_bytes: the fleet's unit, which gres.conf fixes); the
best point of each shard size and over all of them are printed beside it.

    .venv/bin/python bench/operating_curve.py [--genai-dir DIR] [--requeue-wait-h 0.5]
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from policy_service.config import GIB, Config, EstimatorConfig, GpuConfig
from policy_service.sim.loaders import DataNotFound

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_trace  # noqa: E402  (bench/real_trace.py, beside this file)

WINDOWS_S = (1800, 7200)
FLOORS = (0.2, 0.35, 0.5, 0.65, 0.8)
MIN_SAMPLES = (1, 2, 4, 8)
SHARD_GIB = (5, 10, 20)
FINE_FLOORS = tuple(round(0.2 + 0.05 * i, 2) for i in range(13))  # 0.20 .. 0.80
FINE_MIN_SAMPLES = (1, 2, 3, 4, 5, 6, 8)
REQUEUE_WAIT_H = 0.5
WAIT_SENSITIVITY_H = (0.0, 0.5, 2.0)
MAX_REQUEUED = 0.01  # of shared runs
MAX_CHARGE_RATIO = 1.5  # mean charge / peak in shard units
MAX_LOST_OVER_SAVED = 0.05


@dataclass(frozen=True)
class Setting:
    floor: float  # estimator.quantile_floor_frac
    min_samples: int  # estimator.min_samples
    shard_gib: int  # gpu.memory_bytes / gpu.shards_per_gpu


@dataclass(frozen=True)
class Point:
    """One setting on one window."""

    setting: Setting
    window_s: int
    scored: int
    shared: int
    requeued: int
    charge_ratio: float  # mean k x shard / peak over shared runs
    rounding: float  # mean (k x shard - charge) / peak over shared runs
    saved_h: float
    lost_h: float

    @property
    def shared_frac(self) -> float:
        return self.shared / self.scored if self.scored else float("nan")

    @property
    def requeued_frac(self) -> float:
        return self.requeued / self.shared if self.shared else float("nan")

    @property
    def net_h(self) -> float:
        return self.saved_h - self.lost_h

    @property
    def lost_over_saved(self) -> float:
        return self.lost_h / self.saved_h if self.saved_h else float("inf")


def saved_gpu_h(r: real_trace.Replayed) -> float:
    """GPU-hours sharing freed in one run: the part of the GPU it did not hold, for as long as it
    ran; nothing for a whole-GPU run or one that was requeued (its rerun holds a whole GPU)."""
    if not r.shared or r.over:
        return 0.0
    return (1 - r.shards / r.shards_per_gpu) * r.runtime_s / 3600


def lost_gpu_h(r: real_trace.Replayed, requeue_wait_h: float) -> float:
    """GPU-hours a requeue cost: the share held until the OOM plus the rerun's wait for a whole
    GPU (one GPU-hour per hour waited); nothing for a run that was not requeued."""
    if not r.over:
        return 0.0
    return r.shards / r.shards_per_gpu * r.over_at_s / 3600 + requeue_wait_h


def summarise(setting: Setting, window_s: int, runs: Sequence[real_trace.Replayed], requeue_wait_h: float) -> Point:
    shared = [r for r in runs if r.shared]
    n = len(shared)
    cap = [r.cap_bytes for r in shared]
    return Point(setting, window_s, scored=len(runs), shared=n, requeued=sum(r.over for r in shared),
                 charge_ratio=sum(c / r.peak_bytes for c, r in zip(cap, shared)) / n if n else float("nan"),
                 rounding=sum((c - r.charge_bytes) / r.peak_bytes for c, r in zip(cap, shared)) / n if n
                 else float("nan"),
                 saved_h=sum(saved_gpu_h(r) for r in runs), lost_h=sum(lost_gpu_h(r, requeue_wait_h) for r in runs))


def configs(setting: Setting, base: Config) -> tuple[EstimatorConfig, GpuConfig]:
    est = dataclasses.replace(base.estimator, quantile_floor_frac=setting.floor, min_samples=setting.min_samples)
    gpu = dataclasses.replace(base.gpu, shards_per_gpu=base.gpu.memory_bytes // (setting.shard_gib * GIB))
    return est, gpu


def replay(classes: list[list[real_trace.Run]], setting: Setting, base: Config) -> list[real_trace.Replayed]:
    est, gpu = configs(setting, base)
    return [r for runs in classes for r in real_trace.replay_outcomes(runs, est, gpu, at_cap=True, requeue=True)]


def choose(points: Iterable[Point], max_requeued: float = MAX_REQUEUED) -> Setting | None:
    """The setting with the largest mean saved - lost over the windows, among those with at most
    ``max_requeued`` of shared runs requeued in every window (and some shared run); None if none."""
    by: dict[Setting, list[Point]] = {}
    for p in points:
        by.setdefault(p.setting, []).append(p)
    ok = {s: ps for s, ps in by.items() if all(p.shared > 0 and p.requeued_frac <= max_requeued for p in ps)}
    if not ok:
        return None
    return max(ok, key=lambda s: sum(p.net_h for p in ok[s]) / len(ok[s]))


def targets(p: Point) -> dict[str, bool]:
    return {"requeued<=1%": p.requeued_frac <= MAX_REQUEUED, "chg/pk<=1.5": p.charge_ratio <= MAX_CHARGE_RATIO,
            "lost<=5%saved": p.lost_over_saved <= MAX_LOST_OVER_SAVED}


HEADER = (f"{'window':>6s} {'floor':>5s} {'min_s':>5s} {'shard':>5s} {'shared':>7s} {'requeued':>8s} "
          f"{'chg/pk':>6s} {'round':>5s} {'saved h':>8s} {'lost h':>7s} {'lost/sv':>7s} {'sv-lost':>8s}")


def row(p: Point, mark: str = "") -> str:
    s = p.setting
    return (f"{p.window_s // 60:4d}mn {s.floor:5.2f} {s.min_samples:5d} {s.shard_gib:3d}G {p.shared_frac:7.1%} "
            f"{p.requeued_frac:8.2%} {p.charge_ratio:6.2f} {p.rounding:5.2f} {p.saved_h:8.1f} {p.lost_h:7.1f} "
            f"{p.lost_over_saved:7.1%} {p.net_h:8.1f}{mark}")


def curve(classes_by_window: dict[int, list[list[real_trace.Run]]], base: Config, settings: Iterable[Setting],
          waits: Sequence[float]) -> dict[float, list[Point]]:
    """Points per requeue wait (the replay does not depend on the wait: it runs once per setting)."""
    out: dict[float, list[Point]] = {w: [] for w in waits}
    for s in settings:
        for window, classes in classes_by_window.items():
            runs = replay(classes, s, base)
            for w in waits:
                out[w].append(summarise(s, window, runs, w))
    return out


def grid(shards: Iterable[int], min_samples: Iterable[int], floors: Iterable[float]) -> list[Setting]:
    return [Setting(f, m, g) for g in shards for m in min_samples for f in floors]


def halves(classes_by_window: dict[int, list[list[real_trace.Run]]]) -> tuple[dict, dict]:
    """Even and odd containers (by container id order), each window."""
    return ({w: c[0::2] for w, c in classes_by_window.items()}, {w: c[1::2] for w, c in classes_by_window.items()})


def describe(s: Setting | None) -> str:
    return f"floor {s.floor:.2f}, min_samples {s.min_samples}, shard {s.shard_gib} GiB" if s else \
        "none (no point has <= 1 % of shared runs requeued in both windows)"


def with_net(points: Sequence[Point], s: Setting | None) -> str:
    """The setting and its mean saved - lost over the windows."""
    nets = [p.net_h for p in points if p.setting == s]
    return describe(s) + (f" (mean saved - lost {sum(nets) / len(nets):.1f} GPU-h)" if nets else "")


def verdict_rows(name: str, points: Sequence[Point], s: Setting) -> None:
    for p in (p for p in points if p.setting == s):
        verdicts = "  ".join(f"{k}: {'PASS' if v else 'FAIL'}" for k, v in targets(p).items())
        print(f"{name:14s} {row(p)}  {verdicts}")


def report(classes_by_window: dict[int, list[list[real_trace.Run]]], base: Config, wait_h: float) -> Setting | None:
    """Print the curve (coarse grid), the choice (fine grid: overall and per shard size), its
    sensitivity to the requeue wait, and a cross-check on halves; return the choice at the
    configured shard."""
    today = Setting(base.estimator.quantile_floor_frac, base.estimator.min_samples, base.gpu.shard_bytes // GIB)
    waits = sorted({wait_h, *WAIT_SENSITIVITY_H})
    coarse = grid(SHARD_GIB, MIN_SAMPLES, FLOORS)
    fine = sorted(set(grid(SHARD_GIB, FINE_MIN_SAMPLES, FINE_FLOORS)) | set(coarse) | {today},
                  key=lambda s: (s.shard_gib, s.min_samples, s.floor))
    by_wait = curve(classes_by_window, base, fine, waits)
    points = by_wait[wait_h]
    print(f"Operating curve in GPU-hours, requeue_wait_h = {wait_h:g} (definitions: bench/operating_curve.py). "
          f"Today: {describe(today)} of {base.gpu.memory_bytes // GIB} GiB.")
    print(HEADER)
    for p in points:
        if p.setting in coarse or p.setting == today:
            print(row(p, "  <- today" if p.setting == today else ""))
    print(f"\nChosen on the fine grid (floor {FINE_FLOORS[0]:g}..{FINE_FLOORS[-1]:g} step 0.05, min_samples "
          f"{FINE_MIN_SAMPLES}): the largest mean saved - lost of the two windows with <= {MAX_REQUEUED:.0%} "
          "requeued in both.")
    chosen = choose(p for p in points if p.setting.shard_gib == today.shard_gib)
    for w in waits:
        pts = by_wait[w]
        print(f"  requeue_wait_h {w:g}: at the configured {today.shard_gib} GiB "
              f"{with_net(pts, choose(p for p in pts if p.setting.shard_gib == today.shard_gib))}; over every shard "
              f"{with_net(pts, choose(pts))}; per shard: "
              + "; ".join(f"{with_net(pts, choose(p for p in pts if p.setting.shard_gib == g))}" for g in SHARD_GIB))
    verdict_rows("today", points, today)
    for g in SHARD_GIB:
        best = choose(p for p in points if p.setting.shard_gib == g)
        if best is not None:
            verdict_rows(f"best {g} GiB", points, best)
    even, odd = halves(classes_by_window)
    for name, fit, check in (("even", even, odd), ("odd", odd, even)):
        fit_pts, check_pts = curve(fit, base, fine, (wait_h,))[wait_h], curve(check, base, fine, (wait_h,))[wait_h]
        for g in (*SHARD_GIB, None):
            s = choose(p for p in fit_pts if g is None or p.setting.shard_gib == g)
            got = [p for p in check_pts if p.setting == s]
            print(f"  chosen on {name} containers ({'any shard' if g is None else f'{g} GiB'}): {describe(s)}; on the "
                  "other half: " + ", ".join(f"{p.window_s // 60} min requeued {p.requeued_frac:.2%} chg/pk "
                                             f"{p.charge_ratio:.2f} lost/saved {p.lost_over_saved:.1%}" for p in got))
    return chosen


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--genai-dir", type=Path, default=real_trace.DEFAULT_DIR)
    ap.add_argument("--requeue-wait-h", type=float, default=REQUEUE_WAIT_H)
    args = ap.parse_args(argv)
    try:
        series = real_trace.load_memory(args.genai_dir)
    except DataNotFound as exc:
        print(f"not measured: {exc}")
        return 1
    classes = {w: [r for r in (real_trace.cut_runs(s, w) for s in series) if r] for w in WINDOWS_S}
    report(classes, Config(), args.requeue_wait_h)
    return 0


if __name__ == "__main__":
    sys.exit(main())
