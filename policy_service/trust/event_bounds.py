"""Whether a hook event (JobStarted, JobFinished, each event of ReportEvents) may reach the model:
every value it carries within its range, else a ``Refusal`` that says which value and why. The
caller answers INVALID_ARGUMENT with the message (the hooks drop such an event: retrying cannot
help), logs it and counts it by ``Refusal.why`` (swapaware_events_refused_total).

Ranges (the physical ones are in ``core.bounds``):
  * times: finite Unix seconds, 0 for unknown, before 2100 and not in the future (more than
    ``MAX_CLOCK_SKEW_S`` past the service's clock); a finish not before its start; a run not
    longer than ``MAX_RUNTIME_S``. (Not checked against the job's submit time: the service does
    not always know it when the event arrives.)
  * GPUs: indices below ``MAX_GPUS_PER_NODE`` (Slurm numbers a node's GPUs from 0), at most that
    many of them.
  * memory: a GPU's size (``GpuUsage.total_bytes``, the node's NVML reading) at most
    ``MAX_DEVICE_BYTES``; its peak and mean at most that size; the job's peak at most the sum of
    its GPUs' sizes: each the node's reading, or for a GPU the event gives no size of, the larger
    of ``gpu.memory_bytes`` and the largest size the event reports (``DEVICE_TOLERANCE`` on top).
  * utilisation: a percentage in [0, 100]; exit code and derived exit code in [0, 255], signal in
    [0, 127] (what a wait status holds).
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from policy_service.core.bounds import DEVICE_TOLERANCE, MAX_DEVICE_BYTES, MAX_GPUS_PER_NODE, MAX_RUNTIME_S
from policy_service.trust.limits import oversize

MAX_JOB_ID = 0xFFFFFFFF  # Slurm job ids are 32-bit
MAX_TIME_S = 4102444800.0  # 2100-01-01: later "times" are garbage
MAX_CLOCK_SKEW_S = 600.0  # a node's clock ahead of the service's (MUNGE allows 300 s of TTL)
GIB = 1024**3


class Refused(enum.Enum):
    """Why an event was refused: the metric's label."""

    FIELDS = "fields"  # a required field missing, a field too large, not an event at all
    TIME = "time"
    GPUS = "gpus"
    PEAK = "peak_bytes"  # the job's peak beyond what its GPUs hold
    DEVICE = "device_bytes"  # one GPU's size, peak or mean out of range
    UTILISATION = "utilisation"
    EXIT_STATUS = "exit_status"


@dataclass(frozen=True)
class Refusal:
    why: Refused
    message: str


def _gib(n: float) -> str:
    return f"{n / GIB:.1f}GiB"


def check_event(kind: str | None, req, *, now: float, gpu_memory_bytes: int) -> Refusal | None:
    """None when the event may be applied. ``gpu_memory_bytes``: the configured GPU size, for a
    GPU the event gives no size of."""
    if kind is None:
        return Refusal(Refused.FIELDS, "the event is neither started nor finished")
    too_big = oversize(req)
    if too_big:
        return Refusal(Refused.FIELDS, f"a field is too large: {'; '.join(too_big[:3])}")
    if req.job_id == 0:
        return Refusal(Refused.FIELDS, "job_id is required")
    if req.job_id > MAX_JOB_ID:
        return Refusal(Refused.FIELDS, f"job_id {req.job_id} is not a Slurm job id (at most {MAX_JOB_ID})")
    if kind == "finished" and not req.event_id:
        return Refusal(Refused.FIELDS, "event_id is required (replays must be idempotent)")
    return (_times(req, now) or _gpus(req)
            or (_finished(req, gpu_memory_bytes) if kind == "finished" else None))


def _times(req, now: float) -> Refusal | None:
    for name in ("started_at", "finished_at"):
        t = getattr(req, name, 0.0)
        if not (math.isfinite(t) and 0.0 <= t <= MAX_TIME_S):
            return Refusal(Refused.TIME, f"{name} {t} is not a time (Unix seconds, 0 for unknown)")
        if t > now + MAX_CLOCK_SKEW_S:
            return Refusal(Refused.TIME, f"{name} {t:.0f} is {t - now:.0f} s in the future of the service's clock")
    start, end = req.started_at, getattr(req, "finished_at", 0.0)
    return runtime_refusal(start, end) if start and end else None


def runtime_refusal(started_at: float, finished_at: float, start_from: str = "started_at") -> Refusal | None:
    """A finish before its start, or a run longer than ``MAX_RUNTIME_S``."""
    if finished_at < started_at:
        return Refusal(Refused.TIME, f"finished_at {finished_at:.0f} is before the job's {start_from} "
                                     f"{started_at:.0f}")
    if finished_at - started_at > MAX_RUNTIME_S:
        return Refusal(Refused.TIME, f"a run of {(finished_at - started_at) / 86400:.0f} days (finished_at - "
                                     f"{start_from}) is longer than any job runs ({MAX_RUNTIME_S / 86400:.0f})")
    return None


def _gpus(req) -> Refusal | None:
    named = set(req.gpu_indices) | {g.gpu_index for g in getattr(req, "gpus", ())}
    if len(named) > MAX_GPUS_PER_NODE:
        return Refusal(Refused.GPUS, f"{len(named)} GPUs named: a node has at most {MAX_GPUS_PER_NODE}")
    wrong = sorted(i for i in named if i >= MAX_GPUS_PER_NODE)
    if wrong:
        return Refusal(Refused.GPUS, f"GPU index {wrong[-1]} is not a GPU of a node "
                                     f"(indices 0..{MAX_GPUS_PER_NODE - 1})")
    return None


def _finished(req, gpu_memory_bytes: int) -> Refusal | None:
    for name, top in (("exit_code", 255), ("exit_signal", 127), ("derived_exit_code", 255)):
        v = getattr(req, name)
        if not 0 <= v <= top:
            return Refusal(Refused.EXIT_STATUS, f"{name} {v} is not in 0..{top}")
    sizes: dict[int, int] = {}
    for g in req.gpus:
        if g.total_bytes > MAX_DEVICE_BYTES:
            return Refusal(Refused.DEVICE, f"GPU {g.gpu_index}: total_bytes {g.total_bytes} is more memory than any "
                                           f"GPU has (at most {_gib(MAX_DEVICE_BYTES)})")
        if g.HasField("util_mean_pct") and not (math.isfinite(g.util_mean_pct) and 0.0 <= g.util_mean_pct <= 100.0):
            return Refusal(Refused.UTILISATION, f"GPU {g.gpu_index}: util_mean_pct {g.util_mean_pct} is not a "
                                                "percentage (0..100)")
        if g.total_bytes:
            sizes[g.gpu_index] = g.total_bytes
    fallback = max([gpu_memory_bytes, *sizes.values()])
    for g in req.gpus:
        size = sizes.get(g.gpu_index, fallback)
        for name in ("peak_bytes", "mean_bytes"):
            v = getattr(g, name)
            if v > size * (1 + DEVICE_TOLERANCE):
                return Refusal(Refused.DEVICE, f"GPU {g.gpu_index}: {name} {v} is more than the GPU's "
                                               f"{_gib(size)}")
    if req.HasField("peak_gpu_bytes"):
        gpus = set(req.gpu_indices) | {g.gpu_index for g in req.gpus} or {0}
        most = sum(sizes.get(i, fallback) for i in gpus)
        if req.peak_gpu_bytes > most * (1 + DEVICE_TOLERANCE):
            return Refusal(Refused.PEAK, f"peak_gpu_bytes {req.peak_gpu_bytes} is more than the job's "
                                         f"{len(gpus)} GPU(s) hold ({_gib(most)})")
    return None
