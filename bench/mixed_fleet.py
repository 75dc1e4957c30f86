"""Sharing on a fleet of GPUs of several memory sizes: two ways to make shards mean memory,
measured side by side on the runs of the measured trace (bench/real_trace.py: alibaba-v2026-genai
cut into 30-minute and 2-hour runs, each shared run's charge as the estimator and policy size it).

Schemes (every GPU of the fleet can take any shared job, as an untyped request can land anywhere):

  * ``slots:<ref>``: every GPU has the same number of shards (``--shards``, 8), so a shard is
    GPU memory / 8 and differs by GPU; the policy sizes with one reference memory (``smallest``
    or ``largest`` of the fleet, today's one ``gpu.memory_bytes``): k = ceil(charge / (ref / 8)).
    On a GPU of M bytes the job gets k x M / 8: sized for the smallest, it wastes memory on the
    larger GPUs; sized for the largest, it gets less than its charge on the smaller ones.
  * ``unit:<GiB>``: a shard is a fixed amount of memory on every GPU (gres.conf ``Count=`` per GPU
    = floor(M / unit)), k = ceil(charge / unit); the job fits a GPU with at least k shards and
    gets k x unit there, on every GPU.

Per scheme and GPU size, over the shared runs: jobs per GPU (a GPU filled with copies of the run:
floor(shards / k), 0 where it does not fit), the runs that fit that GPU, the runs whose measured
peak is above what they get there (each one an out-of-memory on a capped node), and memory got /
peak over the runs that fit.

    .venv/bin/python bench/mixed_fleet.py [--gpus-gib 40,48,80] [--shards 8] [--units-gib 5,10]
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from policy_service.config import Config, GpuConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_trace  # noqa: E402  (bench/real_trace.py, beside this file)

GIB = 1 << 30


@dataclass(frozen=True)
class Scheme:
    name: str
    unit_bytes: int = 0  # fixed unit; 0: equal slots per GPU
    slots: int = 8  # shards per GPU for the slot schemes
    ref_bytes: int = 0  # the memory the slot schemes size with


def shards_on(scheme: Scheme, gpu_bytes: int) -> int:
    """Shards of a GPU of ``gpu_bytes`` under ``scheme``."""
    return gpu_bytes // scheme.unit_bytes if scheme.unit_bytes else scheme.slots


def shard_bytes_on(scheme: Scheme, gpu_bytes: int) -> int:
    return scheme.unit_bytes if scheme.unit_bytes else gpu_bytes // scheme.slots


def charged_shards(scheme: Scheme, charge_bytes: int) -> int:
    """k: the shards the policy charges a run whose charge is ``charge_bytes``."""
    per = scheme.unit_bytes or scheme.ref_bytes // scheme.slots
    return max(1, math.ceil(charge_bytes / per))


@dataclass(frozen=True)
class Placement:
    fits: bool
    jobs_per_gpu: int
    got_bytes: int  # memory the job holds on that GPU (0 where it does not fit)


def place(scheme: Scheme, gpu_bytes: int, charge_bytes: int) -> Placement:
    k, n = charged_shards(scheme, charge_bytes), shards_on(scheme, gpu_bytes)
    if k > n:
        return Placement(False, 0, 0)
    return Placement(True, n // k, k * shard_bytes_on(scheme, gpu_bytes))


@dataclass(frozen=True)
class Row:
    scheme: str
    gpu_gib: float
    runs: int
    fit: int
    jobs_per_gpu: float  # mean over all runs (0 for a run that does not fit)
    over: int  # runs that fit and whose peak is above what they get
    got_per_peak: float  # mean over the runs that fit


def evaluate(scheme: Scheme, gpu_bytes: int, runs: Iterable[tuple[int, int]]) -> Row:
    """``runs``: (charge, peak) bytes of each shared run."""
    runs = list(runs)
    placed = [(place(scheme, gpu_bytes, c), p) for c, p in runs]
    fit = [(pl, p) for pl, p in placed if pl.fits]
    return Row(scheme.name, gpu_bytes / GIB, len(runs), len(fit),
               statistics.fmean(pl.jobs_per_gpu for pl, _ in placed) if placed else float("nan"),
               sum(1 for pl, p in fit if p > pl.got_bytes),
               statistics.fmean(pl.got_bytes / p for pl, p in fit) if fit else float("nan"))


def schemes(gpus: list[int], slots: int, units: list[int]) -> list[Scheme]:
    return [Scheme("slots:smallest", slots=slots, ref_bytes=min(gpus)),
            Scheme("slots:largest", slots=slots, ref_bytes=max(gpus)),
            *(Scheme(f"unit:{u / GIB:g}GiB", unit_bytes=u) for u in units)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus-gib", default="40,48,80", help="the fleet's GPU memory sizes, GiB")
    ap.add_argument("--shards", type=int, default=8, help="shards per GPU of the slot schemes")
    ap.add_argument("--units-gib", default="5,10", help="fixed shard units to try, GiB")
    ap.add_argument("--genai-dir", type=Path, default=real_trace.DEFAULT_DIR)
    args = ap.parse_args()
    gpus = [int(float(x) * GIB) for x in args.gpus_gib.split(",")]
    units = [int(float(x) * GIB) for x in args.units_gib.split(",")]
    cfg = Config()
    # the estimator's charges with the device taken as the largest GPU (a run above it stays whole)
    gpu = GpuConfig(memory_bytes=max(gpus), shards_per_gpu=args.shards, link=cfg.gpu.link)
    print(f"fleet: {', '.join(f'{g / GIB:g} GiB' for g in gpus)}; trace: {args.genai_dir}")
    for window in (1800.0, 7200.0):
        classes = real_trace.load_classes(args.genai_dir, window)
        runs = [(r[4], r[5]) for c in classes for r in real_trace.replay_class(c, cfg.estimator, gpu)
                if r[0] == "shared"]
        print(f"\n{window / 60:.0f}-minute runs: {len(runs)} shared runs")
        print(f"{'scheme':<16} {'GPU':>6} {'fit':>7} {'jobs/GPU':>9} {'over-runs':>10} {'got/peak':>9}")
        for sc in schemes(gpus, args.shards, units):
            for g in gpus:
                r = evaluate(sc, g, runs)
                print(f"{r.scheme:<16} {r.gpu_gib:>5g}G {r.fit / r.runs:>7.1%} {r.jobs_per_gpu:>9.2f} "
                      f"{r.over:>4} ({r.over / r.runs:>5.2%}) {r.got_per_peak:>8.2f}x")


if __name__ == "__main__":
    main()
