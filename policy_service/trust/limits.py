"""Size limits of every request field, for both transports: a job's facts and events in the history
stay small whatever a user types (a 4 MB ``work_dir`` is refused with INVALID_ARGUMENT, not stored).

Limits are by field name; a string field not listed takes ``DEFAULT_STRING_BYTES``. They are well
above what Slurm itself gives: a path is at most 4096 bytes (PATH_MAX), a fingerprint 16 hex
characters, an event id a few dozen."""
from __future__ import annotations

from typing import Mapping

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

DEFAULT_STRING_BYTES = 1024
STRING_BYTES: Mapping[str, int] = {
    "work_dir": 4096,
    "comment": 4096,
    "oom_evidence": 4096,
    "script_fingerprint": 64,
    "env_mem_hint": 64,
    "event_id": 128,
    "decision_id": 64,
    "telemetry_source": 64,
    "sluid": 64,  # SLURM_JOB_SLUID: 13-14 characters ("sAK5M8XEFWTR00")
}
MAX_REPEATED = 1024  # GPU indices, per-GPU usage entries
# Repeated fields with their own bound. ReportEvents' events are not descended into here: the
# handler checks each event alone, so that one oversized event is refused and the rest applied.
REPEATED_MAX: Mapping[str, int] = {"events": 500}
CHECKED_PER_ITEM = frozenset({"events"})
MAX_REQUEST_BYTES = 256 * 1024  # one whole request, on either transport


def _is_repeated(field: FieldDescriptor) -> bool:
    flag = getattr(field, "is_repeated", None)  # protobuf >= 6 (upb): `label` is gone
    return bool(flag) if flag is not None else field.label == FieldDescriptor.LABEL_REPEATED


_Rule = tuple  # (name, repeated, is_string, is_message, string limit, entries limit, checked per item)
_RULES: dict = {}  # FieldDescriptor -> _Rule: descriptors are looked at once, not per request


def _rule(field: FieldDescriptor) -> _Rule:
    rule = _RULES.get(field)
    if rule is None:
        name = field.name
        rule = _RULES[field] = (name, _is_repeated(field), field.type == FieldDescriptor.TYPE_STRING,
                                field.type == FieldDescriptor.TYPE_MESSAGE,
                                STRING_BYTES.get(name, DEFAULT_STRING_BYTES), REPEATED_MAX.get(name, MAX_REPEATED),
                                name in CHECKED_PER_ITEM)
    return rule


def oversize(msg: Message, prefix: str = "") -> list[str]:
    """What in ``msg`` is over its limit, one line each ('job.work_dir is 4194304 bytes, at most
    4096'); [] when all fits."""
    out: list[str] = []
    for field, value in msg.ListFields():
        name, repeated, is_string, is_message, limit, most, per_item = _RULES.get(field) or _rule(field)
        if not repeated:  # (most fields: one value, checked here without a loop)
            if is_string:
                if len(value) > limit // 4:
                    _too_long(out, prefix, name, value, limit)
            elif is_message:
                out.extend(oversize(value, f"{prefix}{name}."))
            continue
        if len(value) > most:
            out.append(f"{prefix}{name} has {len(value)} entries, at most {most}")
            continue
        if per_item:
            continue
        for v in value:
            if is_string and len(v) > limit // 4:
                _too_long(out, prefix, name, v, limit)
            elif is_message:
                out.extend(oversize(v, f"{prefix}{name}."))
    return out


def _too_long(out: list[str], prefix: str, name: str, text: str, limit: int) -> None:
    """UTF-8 takes at most 4 bytes a character: only a string that might be too long is encoded."""
    size = len(text.encode())
    if size > limit:
        out.append(f"{prefix}{name} is {size} bytes, at most {limit}")
