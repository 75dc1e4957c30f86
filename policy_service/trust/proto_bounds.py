"""Figures read from the history, made fit for the reply's fields: a protobuf integer field refuses a
value beyond its type ("Value out of range", which would fail the whole call with INTERNAL), so the
reply builders saturate what they copy (a row written into the history by other means, a figure
computed from one). Values within range pass unchanged."""
from __future__ import annotations

import math

from policy_service._generated.swapaware.v1 import policy_pb2 as pb

U64_MAX = 2**64 - 1
U32_MAX = 2**32 - 1
I32_MIN, I32_MAX = -(2**31), 2**31 - 1


def _int(x, lo: int, hi: int) -> int:
    if isinstance(x, float):
        x = 0 if math.isnan(x) else (hi if x > hi else lo if x < lo else int(x))
    if not isinstance(x, int):
        return 0
    return min(hi, max(lo, x))


def u64(x) -> int:
    return _int(x, 0, U64_MAX)


def u32(x) -> int:
    return _int(x, 0, U32_MAX)


def i32(x) -> int:
    return _int(x, I32_MIN, I32_MAX)


def real(x, default: float = 0.0) -> float:
    """A float for a double field (None or a non-number: ``default``; inf and NaN are valid there)."""
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else default


def observation_to_proto(o) -> pb.Observation:
    """An ``ObservationRow`` as Explain shows it; a peak out of range is shown as unknown, GPU
    indices out of range are left out."""
    gpus = o.gpu_indices if isinstance(o.gpu_indices, (list, tuple)) else ()
    ob = pb.Observation(job_id=u64(o.job_id), decision_id=str(o.decision_id), node=str(o.node),
                        started_at=real(o.started_at), finished_at=real(o.finished_at),
                        runtime_s=real(o.runtime_s), exit_code=i32(o.exit_code), oom_detected=bool(o.oom),
                        co_runners=u32(o.co_runners),
                        gpu_indices=[i for i in gpus if isinstance(i, int) and 0 <= i <= U32_MAX])
    if isinstance(o.peak_bytes, int) and 0 <= o.peak_bytes <= U64_MAX:
        ob.peak_gpu_bytes = o.peak_bytes
    return ob
