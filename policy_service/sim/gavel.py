"""Loader of Gavel's (OSDI'20) ``simulation_throughputs.json``: measured throughput of job types
alone and co-located in pairs, and the compute interference fitted to those pairs.
"""
from __future__ import annotations

import ast
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from policy_service.sim.loaders import DataNotFound, SchemaError, sha256_file


@dataclass(frozen=True)
class InterferenceCalibration:
    """Per-co-runner compute slowdown fitted to Gavel's measured pairs (one worker type)."""

    worker: str
    per_corunner: float  # median over measured pairs of (solo / co-located throughput - 1)
    pairs: int
    pairs_failed: int  # [0, 0]: the pair failed together (most likely out of GPU memory)
    quantiles: dict[str, float]
    source: dict[str, Any]


def load_gavel_throughputs(path: Path) -> dict[str, dict[str, dict[str, Any]]]:
    path = Path(path)
    if path.is_dir():
        for candidate in (path / "simulation_throughputs.json", path / "gavel" / "simulation_throughputs.json"):
            if candidate.is_file():
                path = candidate
                break
    if not path.is_file():
        raise DataNotFound(f"{path}: Gavel simulation_throughputs.json not found "
                           "(github.com/stanford-futuredata/gavel, scheduler/simulation_throughputs.json)")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise SchemaError(f"{path}: not JSON: {exc}") from None
    if not isinstance(data, dict) or not data:
        raise SchemaError(f"{path}: expected an object {{worker: {{job: {{...}}}}}}")
    for worker, jobs in data.items():
        if not isinstance(jobs, dict):
            raise SchemaError(f"{path}: worker {worker!r}: expected an object of job types")
        for job, entry in jobs.items():
            if not isinstance(entry, dict) or "null" not in entry:
                raise SchemaError(f"{path}: {worker}/{job}: expected an object with a 'null' (solo) throughput")
            for other, v in entry.items():
                if other == "null":
                    if not isinstance(v, (int, float)):
                        raise SchemaError(f"{path}: {worker}/{job}: solo throughput {v!r} is not a number")
                elif not (isinstance(v, list) and len(v) == 2 and all(isinstance(x, (int, float)) for x in v)):
                    raise SchemaError(f"{path}: {worker}/{job}/{other}: expected [self, other] throughputs, got {v!r}")
    return data


def _scale(key: str) -> int:
    try:
        return int(ast.literal_eval(key)[1])
    except (ValueError, SyntaxError, IndexError, TypeError):
        return 0


def calibrate_interference(path: Path, worker: str = "v100") -> InterferenceCalibration:
    """Fit the per-co-runner compute interference to Gavel's measured pairs (single-GPU jobs).

    For job a co-located with b, Gavel measured a's throughput x_ab (and b's); a's slowdown is
    solo_a / x_ab. Pairs recorded as [0, 0] failed together and are counted, not fitted.
    """
    data = load_gavel_throughputs(path)
    if worker not in data:
        raise SchemaError(f"{path}: no worker type {worker!r}; found: {', '.join(sorted(data))}")
    slow: list[float] = []
    failed = 0
    for job, entry in data[worker].items():
        if _scale(job) != 1:
            continue
        solo = float(entry["null"])
        for other, v in entry.items():
            if other == "null" or _scale(other) != 1:
                continue
            if v[0] <= 0 or v[1] <= 0:
                failed += 1
                continue
            if solo > 0:
                slow.append(solo / v[0] - 1.0)
    if not slow:
        raise SchemaError(f"{path}: worker {worker!r} has no measured co-located pairs")
    slow.sort()
    q = {f"p{int(p * 100)}": slow[min(len(slow) - 1, int(p * len(slow)))] for p in (0.05, 0.25, 0.5, 0.75, 0.95)}
    real = Path(path) if Path(path).is_file() else Path(path) / "simulation_throughputs.json"
    if not real.is_file():
        real = Path(path) / "gavel" / "simulation_throughputs.json"
    return InterferenceCalibration(
        worker=worker, per_corunner=statistics.median(slow), pairs=len(slow), pairs_failed=failed, quantiles=q,
        source={"path": str(real), "sha256": sha256_file(real),
                "citation": "Narayanan et al., Heterogeneity-Aware Cluster Scheduling Policies for Deep Learning "
                            "Workloads (Gavel), USENIX OSDI'20 (github.com/stanford-futuredata/gavel)"})


def gavel_pair_slowdowns(path: Path, worker: str = "v100") -> list[float]:
    """solo / co-located throughput - 1 of every measured single-GPU pair (failed pairs left out)."""
    data = load_gavel_throughputs(path)
    if worker not in data:
        raise SchemaError(f"{path}: no worker type {worker!r}; found: {', '.join(sorted(data))}")
    out = []
    for job, entry in data[worker].items():
        if _scale(job) != 1:
            continue
        solo = float(entry["null"])
        for other, v in entry.items():
            if other != "null" and _scale(other) == 1 and v[0] > 0 and v[1] > 0 and solo > 0:
                out.append(solo / v[0] - 1.0)
    return out
