"""What the workload-data loaders share: the errors they raise, the trace job record
(``TraceJob``, ``LoadedTrace``) and the header and number checks.

The loaders are ``alibaba`` (Alibaba GPU trace v2023 and PAI trace v2020), ``gavel`` (Gavel's
measured throughputs) and ``colocation`` (measured co-located pairs). No paths are built in:
every loader takes the folder (or file) it reads. A file whose header does not match raises
``SchemaError`` naming the file, the expected and the found columns, and what is missing or
unexpected.
"""
from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

# The knee's distribution fit lives with the other interference fits; also named here (docs cite it so).
from policy_service.sim.interference_fit import KneeFit, fit_knee, knee_slowdown  # noqa: F401


class SchemaError(ValueError):
    """A data file does not have the columns (or structure) its loader expects."""


class DataNotFound(FileNotFoundError):
    """A data file the loader needs is not there (message says where it looked and why)."""


@dataclass(frozen=True)
class TraceJob:
    """One GPU job as a trace records it (requests and times, no truth about memory)."""

    job_id: str
    submit_s: float
    duration_s: float
    num_gpu: int  # GPUs per job (all on one node)
    gpu_milli: int  # per-GPU share requested, 1000 = a whole GPU
    qos: str = ""  # trace's QoS label ("" when the trace has none)
    class_key: str = ""  # repeated-job tag when the trace has one (PAI group), else ""
    user: str = ""
    signature: str = ""  # resource-request signature (used to form classes when class_key is "")
    measured_peak_bytes: int | None = None  # per-GPU measured peak, when the trace has it


@dataclass
class LoadedTrace:
    jobs: list[TraceJob]
    source: dict[str, Any]  # name, files (path, sha256, rows), citation
    skipped: Counter = field(default_factory=Counter)  # reason -> rows


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def check_columns(path: Path | str, found: Sequence[str], expected: Sequence[str], what: str) -> None:
    """Raise SchemaError unless ``found`` equals ``expected`` (same names, same order)."""
    found = [c.strip().lstrip("\ufeff") for c in found]
    if list(found) == list(expected):
        return
    missing = [c for c in expected if c not in found]
    unexpected = [c for c in found if c not in expected]
    detail = []
    if missing:
        detail.append(f"missing: {', '.join(missing)}")
    if unexpected:
        detail.append(f"unexpected: {', '.join(unexpected)}")
    if not missing and not unexpected:
        detail.append("same columns in a different order")
    raise SchemaError(f"{path}: header does not match the {what} schema ({'; '.join(detail)}).\n"
                      f"  expected: {','.join(expected)}\n  found:    {','.join(found)}")


def _int(path: Path, line: int, col: str, text: str) -> int:
    try:
        return int(float(text))
    except ValueError:
        raise SchemaError(f"{path}:{line}: column {col}: {text!r} is not a number") from None


def _float(path: Path, line: int, col: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise SchemaError(f"{path}:{line}: column {col}: {text!r} is not a number") from None
