"""Measured per-container GPU memory series (Alibaba ``cluster-trace-v2026-GenAI``), and runs cut
from them.

The trace has no job boundaries: a container's series is cut into consecutive windows of a fixed
length, each window taken as one run of a recurring job class (the container). A run's peak is the
window's largest sample; its samples are kept so that within-run growth can be studied.

Files (folder given by the caller, never built in):
  * ``pod_gpu_memory_used_bytes_anon.csv``: ``timestamp_anon,value,container_ip`` (bytes in use)
  * ``pod_gpu_duty_cycle_anon.csv``: ``value,timestamp_anon,container_ip`` (GPU duty cycle)
A header that differs raises ``SchemaError``; a missing file raises ``DataNotFound``.
"""
from __future__ import annotations

import csv
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from policy_service.sim.loaders import DataNotFound, SchemaError, check_columns

MEMORY_FILE = "pod_gpu_memory_used_bytes_anon.csv"
DUTY_FILE = "pod_gpu_duty_cycle_anon.csv"
MEMORY_COLUMNS = ("timestamp_anon", "value", "container_ip")
DUTY_COLUMNS = ("value", "timestamp_anon", "container_ip")


@dataclass(frozen=True)
class Series:
    """One container's samples, in time order."""

    container: str
    t: tuple[float, ...]  # seconds (anonymised epoch)
    v: tuple[float, ...]  # bytes in use (memory) or duty cycle (0..1 or 0..100, as published)


@dataclass(frozen=True)
class Run:
    """One window of a container's memory series, taken as one run of its class."""

    container: str
    index: int  # window number within the container's series (0-based)
    start_s: float  # window start (seconds, trace clock)
    t: tuple[float, ...]  # sample times, seconds from the window start
    v: tuple[int, ...]  # bytes in use at each sample

    @property
    def peak_bytes(self) -> int:
        return max(self.v)

    @property
    def first_bytes(self) -> int:
        return self.v[0]


def _read(path: Path, expected: tuple[str, ...], what: str) -> list[Series]:
    if not path.is_file():
        raise DataNotFound(f"{what}: {path} is not there (expected the file {path.name} of "
                           "alibaba/clusterdata cluster-trace-v2026-GenAI)")
    by: dict[str, list[tuple[float, float]]] = defaultdict(list)
    with path.open(newline="") as fh:
        reader = csv.reader(fh)
        header = next(reader, [])
        check_columns(path, header, expected, what)
        it, iv, ic = expected.index("timestamp_anon"), expected.index("value"), expected.index("container_ip")
        for line, row in enumerate(reader, start=2):
            if len(row) != len(expected):
                raise SchemaError(f"{path}:{line}: {len(row)} fields, expected {len(expected)}")
            try:
                t, v = float(row[it]), float(row[iv])
            except ValueError as exc:
                raise SchemaError(f"{path}:{line}: not a number: {exc}") from None
            if not (math.isfinite(t) and math.isfinite(v)) or v < 0:
                raise SchemaError(f"{path}:{line}: value must be finite and >= 0 (got t={t}, v={v})")
            by[row[ic]].append((t, v))
    out = []
    for container in sorted(by):
        pts = sorted(by[container])
        out.append(Series(container, tuple(p[0] for p in pts), tuple(p[1] for p in pts)))
    return out


def load_memory(data_dir: Path) -> list[Series]:
    """Every container's GPU memory series (bytes), sorted by container id."""
    return _read(Path(data_dir) / MEMORY_FILE, MEMORY_COLUMNS, "GenAI GPU memory series")


def load_duty(data_dir: Path) -> list[Series]:
    """Every container's GPU duty-cycle series, sorted by container id."""
    return _read(Path(data_dir) / DUTY_FILE, DUTY_COLUMNS, "GenAI GPU duty-cycle series")


def cut_runs(series: Series, window_s: float, min_samples: int = 2, min_peak_bytes: int = 1) -> list[Run]:
    """Consecutive windows of ``window_s`` seconds from the series' first sample; a window with
    fewer than ``min_samples`` samples or a peak below ``min_peak_bytes`` (an idle container) is
    skipped. Windows keep their index, so a skipped window leaves a gap."""
    if window_s <= 0:
        raise ValueError("window_s must be > 0")
    if not series.t:
        return []
    t0 = series.t[0]
    buckets: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for t, v in zip(series.t, series.v):
        buckets[int((t - t0) // window_s)].append((t, v))
    runs = []
    for idx in sorted(buckets):
        pts = buckets[idx]
        start = t0 + idx * window_s
        run = Run(series.container, idx, start, tuple(t - start for t, _ in pts), tuple(int(v) for _, v in pts))
        if len(pts) >= min_samples and run.peak_bytes >= min_peak_bytes:
            runs.append(run)
    return runs


def hindsight_charge_floor(peaks_by_class: list[list[int]], over_frac: float) -> float:
    """The smallest mean charge/peak over all runs that ONE charge per class, chosen knowing every
    run's peak in advance, can reach while at most ``over_frac`` of the runs exceed their charge.

    Each class gives up its j largest peaks (charge = its (j+1)-th largest peak, cost = sum of
    charge/peak over its runs); the j's are spread over the classes by a knapsack over the
    over-run budget floor(over_frac * runs). A predictor that sees only a class's past has less to
    go on than this one, unless it can tell in advance which of a class's runs will peak high, so
    a target below this floor asks for that foresight. Classes with no run are ignored; NaN when
    there is no run at all."""
    classes = [sorted((p for p in peaks if p > 0), reverse=True) for peaks in peaks_by_class]
    classes = [c for c in classes if c]
    n = sum(len(c) for c in classes)
    if n == 0:
        return math.nan
    budget = int(math.floor(over_frac * n + 1e-9))
    best = [0.0] + [math.inf] * budget  # best[b]: least total cost with b over-runs so far
    for desc in classes:
        inv = sum(1.0 / p for p in desc)
        costs = [desc[j] * inv for j in range(min(len(desc) - 1, budget) + 1)]
        best = [min((best[b - j] + c for j, c in enumerate(costs) if j <= b), default=math.inf)
                for b in range(budget + 1)]
    return min(best) / n
