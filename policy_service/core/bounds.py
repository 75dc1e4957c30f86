"""The ranges every value that reaches the model must lie in. Pure: no I/O.

Events outside them are refused at the door (``policy_service.trust.event_bounds``); statistics read
back from the history are brought inside them (``sane_stats``), so that a row written into the
database by other means cannot make a prediction absurd or a reply unencodable.

The bounds are physical, not tuned: no GPU sold has more than ``MAX_DEVICE_BYTES`` of memory
(the largest in 2025 hold 288 GB), no node more than ``MAX_GPUS_PER_NODE`` GPUs (the largest
hold 16), no run lasts longer than ``MAX_RUNTIME_S``.
"""
from __future__ import annotations

import math
from dataclasses import asdict, fields
from typing import Any, Mapping

from policy_service.core.types import ClassStats, UserFigure

MAX_DEVICE_BYTES = 1 << 40  # 1 TiB: one GPU's memory
MAX_GPUS_PER_NODE = 64  # GPU indices on a node are 0..63
MAX_NODE_BYTES = MAX_GPUS_PER_NODE * MAX_DEVICE_BYTES  # 64 TiB: what one job can use on one node
MAX_RUNTIME_S = 366 * 86400.0  # a year and a day
MIN_RUNTIME_S = 1e-3  # shorter is not a measured run time (and would make ratios of runtimes explode)
MAX_COUNT = 2**31 - 1
MAX_CORUNNERS = 1024.0
MAX_RATIO = 64.0  # a run's peak / the estimate made before it
MAX_MARGIN_MULTIPLIER = 64.0
MAX_RECENT = 256  # EstimatorConfig.recent_runs is at most this
DEVICE_TOLERANCE = 0.02  # what a GPU is said to hold vs what its jobs were measured to use
MAX_WIDE_USERS = 64  # per-user figures a wide key keeps (the most recently seen)
MAX_USER_CHARS = 256  # a user name in them (Slurm's are at most 32 characters on Linux)

_BYTES = ("ewma_peak_bytes", "ewma_absdev_bytes", "max_peak_bytes", "last_peak_bytes")
_COUNTS = ("samples", "runs", "oom_count", "whole_gpu_runs_left", "solo_runs", "shared_runs", "util_runs")
_RUNTIMES = ("ewma_solo_runtime_s", "ewma_shared_runtime_s")


def clamp(x: object, lo: float, hi: float) -> float:
    """``x`` within [lo, hi]; ``lo`` for a value that is not a number (NaN, a string, None)."""
    if not isinstance(x, (int, float)) or isinstance(x, bool) or math.isnan(x):
        return lo
    return min(hi, max(lo, x))


def _runtime(x: object) -> float:
    v = float(clamp(x, 0.0, MAX_RUNTIME_S))
    return v if v >= MIN_RUNTIME_S else 0.0


def sane_stats(data: Mapping[str, Any]) -> tuple[ClassStats, tuple[str, ...]]:
    """A key's statistics from their stored form (the JSON object of a ``ClassStats``) with every
    figure in range, and the names of the fields that were not (unknown names are ignored). A
    peak that is not a number or negative voids the key's memory figures (the estimator then does
    not use the key: nothing is predicted from it); one beyond ``MAX_NODE_BYTES`` is held at that
    bound (too large to share: the job keeps a whole GPU)."""
    base = ClassStats()
    raw = {f.name: data.get(f.name, getattr(base, f.name)) for f in fields(ClassStats)}
    fixed: dict[str, Any] = {}
    for name in _COUNTS:
        v = raw[name]
        fixed[name] = int(clamp(v, 0, MAX_COUNT)) if _number(v) else 0
    void = any(not _number(raw[n]) or raw[n] < 0 for n in ("ewma_peak_bytes", "max_peak_bytes"))
    for name in _BYTES:
        v = clamp(raw[name], 0, MAX_NODE_BYTES)
        fixed[name] = int(v) if isinstance(getattr(base, name), int) else float(v)
    if void:
        fixed.update(samples=0, ewma_peak_bytes=0.0, ewma_absdev_bytes=0.0, max_peak_bytes=0, last_peak_bytes=0)
    for name in _RUNTIMES:
        fixed[name] = _runtime(raw[name])
    fixed["ewma_corunners"] = float(clamp(raw["ewma_corunners"], 0.0, MAX_CORUNNERS))
    fixed["ewma_solo_util"] = float(clamp(raw["ewma_solo_util"], 0.0, 1.0))
    fixed["margin_multiplier"] = float(clamp(raw["margin_multiplier"], 1.0, MAX_MARGIN_MULTIPLIER))
    ratios, peaks = ((), ()) if void else (_numbers(raw["recent_ratios"]), _numbers(raw["recent_peaks"]))
    fixed["recent_ratios"] = tuple(float(clamp(r, 0.0, MAX_RATIO)) for r in ratios)
    fixed["recent_peaks"] = tuple(int(clamp(p, 0, MAX_NODE_BYTES)) for p in peaks)
    fixed["users"] = () if void else _user_figures(raw["users"])
    out = ClassStats(**fixed)
    changed = tuple(name for name, v in raw.items() if not _same(v, getattr(out, name)))
    return out, changed


def _user_figures(items: object) -> tuple[UserFigure, ...]:
    """A wide key's stored per-user figures: the last ``MAX_WIDE_USERS`` well-formed ones, one per
    user (the last), figures in range."""
    out: dict[str, UserFigure] = {}
    for item in items if isinstance(items, (list, tuple)) else []:
        user = item.get("user") if isinstance(item, dict) else None
        if not isinstance(user, str) or len(user) > MAX_USER_CHARS:
            continue
        samples, peak = item.get("samples"), item.get("max_peak_bytes")
        out.pop(user, None)
        out[user] = UserFigure(user, int(clamp(samples, 0, MAX_COUNT)) if _number(samples) else 0,
                               int(clamp(peak, 0, MAX_NODE_BYTES)) if _number(peak) else 0)
    return tuple(out.values())[-MAX_WIDE_USERS:]


def _number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _numbers(items: object) -> list:
    """The last ``MAX_RECENT`` finite numbers of a stored list (anything else: none)."""
    return [x for x in items if _number(x)][-MAX_RECENT:] if isinstance(items, (list, tuple)) else []


def _same(stored: object, kept: object) -> bool:
    if isinstance(kept, tuple) and kept and isinstance(kept[0], UserFigure):
        return isinstance(stored, (list, tuple)) and list(stored) == [asdict(u) for u in kept]
    if isinstance(kept, tuple):
        return isinstance(stored, (list, tuple)) and len(stored) == len(kept) and all(
            _number(a) and a == b for a, b in zip(stored, kept))
    return _number(stored) and stored == kept
