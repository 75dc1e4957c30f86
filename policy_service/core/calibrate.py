"""Fit the swap-cost model's link bandwidth and fault latency to measured slowdowns.

Each measurement is one job run alone with part of its memory kept off the device (victim
placement) or oversubscribed under demand paging (naive), against its time fully resident.
The model says ``extra = moved / B + faulting * (moved / granularity) * L`` seconds per solo
second; with ``x1 = 1/B`` and ``x2 = L`` that is linear, so least squares has a closed form.
Pure: rows in, parameters and residuals out.
"""
from __future__ import annotations

import csv
import math
from dataclasses import dataclass, replace
from typing import Iterable, TextIO

from policy_service.config import AccessClass, LinkKind, SwapCostConfig
from policy_service.core.swapcost import SwapMode, traffic
from policy_service.core.types import CoJob

FIELDS = ("mode", "access", "footprint_bytes", "working_set_bytes", "offloaded_bytes", "sweeps_per_s",
          "solo_s", "measured_s")


class CalibrationError(ValueError):
    pass


@dataclass(frozen=True)
class Measurement:
    mode: SwapMode
    job: CoJob
    offloaded_bytes: int
    solo_s: float
    measured_s: float

    @property
    def extra_per_solo_s(self) -> float:
        return (self.measured_s - self.solo_s) / self.solo_s


@dataclass(frozen=True)
class Fit:
    link_bytes_per_s: float
    fault_latency_s: float
    rms_error: float  # of predicted vs measured slowdown
    n: int

    def apply(self, cfg: SwapCostConfig, link: LinkKind) -> SwapCostConfig:
        field = {LinkKind.PCIE_GEN4: "pcie_gen4_bytes_per_s", LinkKind.PCIE_GEN5: "pcie_gen5_bytes_per_s",
                 LinkKind.NVLINK_C2C: "nvlink_c2c_bytes_per_s"}[link]
        return replace(cfg, **{field: self.link_bytes_per_s, "fault_latency_s": self.fault_latency_s})


def read_measurements(f: TextIO) -> list[Measurement]:
    reader = csv.DictReader(f)
    missing = [c for c in FIELDS if c not in (reader.fieldnames or [])]
    if missing:
        raise CalibrationError(f"measurement CSV lacks column(s): {', '.join(missing)}; needs {', '.join(FIELDS)}")
    out = []
    for i, row in enumerate(reader, start=2):
        try:
            job = CoJob(name=f"row{i}", footprint_bytes=int(row["footprint_bytes"]),
                        working_set_bytes=int(row["working_set_bytes"]), access=AccessClass(row["access"]),
                        priority=0.0, sweeps_per_s=float(row["sweeps_per_s"]))
            m = Measurement(SwapMode(row["mode"]), job, int(row["offloaded_bytes"]), float(row["solo_s"]),
                            float(row["measured_s"]))
        except (ValueError, KeyError) as exc:
            raise CalibrationError(f"line {i}: {exc}") from None
        if m.solo_s <= 0 or m.measured_s <= 0:
            raise CalibrationError(f"line {i}: times must be > 0")
        out.append(m)
    return out


def fit(measurements: Iterable[Measurement], cfg: SwapCostConfig) -> Fit:
    rows = []
    for m in measurements:
        moved, faulting = traffic(m.job, m.offloaded_bytes, m.mode)
        if moved <= 0:
            continue
        rows.append((moved, (moved / cfg.fault_granularity_bytes) if faulting else 0.0, m.extra_per_solo_s))
    if not rows:
        raise CalibrationError("no measurement moved any bytes: nothing to fit")
    a11 = sum(r[0] * r[0] for r in rows)
    a12 = sum(r[0] * r[1] for r in rows)
    a22 = sum(r[1] * r[1] for r in rows)
    b1 = sum(r[0] * r[2] for r in rows)
    b2 = sum(r[1] * r[2] for r in rows)
    if a22 == 0:  # no faulting runs: bandwidth only, latency stays as configured
        x1, x2 = b1 / a11, cfg.fault_latency_s
    else:
        det = a11 * a22 - a12 * a12
        if abs(det) <= 1e-12 * a11 * a22:
            raise CalibrationError("measurements cannot separate bandwidth from fault cost: add victim-mode runs")
        x1, x2 = (b1 * a22 - b2 * a12) / det, (a11 * b2 - a12 * b1) / det
    if x1 <= 0 or x2 < 0:
        raise CalibrationError(f"fit gave non-physical parameters (1/B={x1:.3g}, L={x2:.3g}): check the data")
    rms = math.sqrt(sum((r[0] * x1 + r[1] * x2 - r[2]) ** 2 for r in rows) / len(rows))
    return Fit(link_bytes_per_s=1.0 / x1, fault_latency_s=x2, rms_error=rms, n=len(rows))
