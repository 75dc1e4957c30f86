"""The node agent's wire protocol and the checks a request's fields must pass.

JSON lines over the Unix socket ``agent.socket_path`` (mode 0600, so only root, i.e. the
prolog/epilog, can talk to it); one request line, one response line, then close::

    {"op":"start","job_id":N,"gpus":[0,2],"uid":U,"sluid":S}  -> {"ok":true}   ("sluid" optional)
    {"op":"stop","job_id":N}                       -> {"ok":true,"telemetry":{...}}
    {"op":"status"}                                -> {"ok":true,"source":...,"jobs":[...]}
    anything malformed                             -> {"ok":false,"error":"..."}

``gpus`` are NVML indices; the prolog passes the numbers in ``SLURM_JOB_GPUS`` (the N of the
gres.conf ``File=/dev/nvidiaN``), which is the same assumption ``swapaware gres-conf`` makes
(NVML index == device minor number; true unless the driver enumerates otherwise).
"""
from __future__ import annotations

from typing import Any, Mapping

MAX_REQUEST_BYTES = 64 * 1024


class RequestError(ValueError):
    """A request the agent cannot act on; becomes ``{"ok": false, "error": ...}``."""


def int_field(request: Mapping[str, Any], key: str) -> int:
    value = request.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise RequestError(f"{key!r} must be a non-negative integer")
    return value


def optional_int_field(request: Mapping[str, Any], key: str) -> int | None:
    return None if request.get(key) is None else int_field(request, key)


def sluid_field(request: Mapping[str, Any]) -> str | None:
    """The optional ``sluid`` as given (absent or null: None); only its type is checked here."""
    value = request.get("sluid")
    if value is not None and not isinstance(value, str):
        raise RequestError("'sluid' must be a string")
    return value


def gpus_field(request: Mapping[str, Any]) -> list[int]:
    gpus = request.get("gpus", [])
    if not isinstance(gpus, list) or any(not isinstance(g, int) or isinstance(g, bool) or g < 0 for g in gpus):
        raise RequestError("'gpus' must be a list of non-negative integers")
    return gpus
