"""Client of the node agent, for the prolog and epilog.

Both calls are bounded by ``HookConfig.agent_timeout_s`` (one deadline for connect, send and
receive together) and never raise: a hook must always exit 0, so failures are logged and
reported as ``False`` / ``None``.
"""
from __future__ import annotations

import json
import logging
import socket
import time
from pathlib import Path
from typing import Any, Sequence

from policy_service.config import HookConfig

log = logging.getLogger("swapaware.agent_client")

MAX_REPLY_BYTES = 1024 * 1024


class AgentUnavailable(Exception):
    """The agent did not answer within the deadline, or answered nonsense."""


def _remaining_s(deadline_s: float) -> float:
    left_s = deadline_s - time.monotonic()
    if left_s <= 0:
        raise AgentUnavailable("deadline exceeded")
    return left_s


def request(socket_path: Path, payload: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Send one JSON line, read one JSON line. Raises ``AgentUnavailable`` on any failure."""
    deadline_s = time.monotonic() + timeout_s
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(_remaining_s(deadline_s))
        sock.connect(str(socket_path))
        sock.settimeout(_remaining_s(deadline_s))
        sock.sendall((json.dumps(payload) + "\n").encode())
        data = b""
        while not data.endswith(b"\n") and len(data) <= MAX_REPLY_BYTES:
            sock.settimeout(_remaining_s(deadline_s))
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except OSError as exc:
        raise AgentUnavailable(f"{socket_path}: {exc.strerror or exc}") from exc
    finally:
        sock.close()
    try:
        reply = json.loads(data.decode())
    except ValueError as exc:
        raise AgentUnavailable(f"{socket_path}: unreadable reply {data[:200]!r}") from exc
    if not isinstance(reply, dict):
        raise AgentUnavailable(f"{socket_path}: reply is not an object")
    return reply


def _call(cfg: HookConfig, payload: dict[str, Any]) -> dict[str, Any] | None:
    what = f"agent {payload['op']}" + (f" for job {payload['job_id']}" if "job_id" in payload else "")
    try:
        reply = request(cfg.agent_socket, payload, cfg.agent_timeout_s)
    except AgentUnavailable as exc:
        log.warning("%s failed: %s", what, exc)
        return None
    except Exception as exc:  # noqa: BLE001 - never raise into a hook
        log.warning("%s failed: %s: %s", what, type(exc).__name__, exc)
        return None
    if reply.get("ok") is not True:
        log.warning("%s refused: %s", what, reply.get("error"))
        return None
    return reply


def _uid(uid: int | str | None) -> int | None:
    """The uid as the agent wants it: ``SLURM_JOB_UID`` text is accepted; anything else is None."""
    if isinstance(uid, int) and not isinstance(uid, bool) and uid >= 0:
        return uid
    if isinstance(uid, str) and uid.strip().isdigit():
        return int(uid)
    return None


def notify_start(cfg: HookConfig, job_id: int, gpus: Sequence[int], uid: int | str | None, *,
                 sluid: str | None = None) -> bool:
    """Tell the agent job ``job_id`` started on ``gpus`` (NVML indices). True when it acknowledged.

    ``sluid`` (``SLURM_JOB_SLUID``, Slurm 25.11+) lets the agent find the job's processes by their
    cgroup v2 directory on 26.05; sent only when given, so older agents see the request they know."""
    try:
        payload = {"op": "start", "job_id": job_id, "gpus": list(gpus), "uid": _uid(uid)}
    except TypeError as exc:
        log.warning("agent start for job %s: bad gpus %r: %s", job_id, gpus, exc)
        return False
    if isinstance(sluid, str) and sluid.strip():
        payload["sluid"] = sluid.strip()
    return _call(cfg, payload) is not None


def collect(cfg: HookConfig, job_id: int) -> dict[str, Any] | None:
    """Stop sampling ``job_id`` and return its telemetry object, or None when the agent failed."""
    reply = _call(cfg, {"op": "stop", "job_id": job_id})
    if reply is None:
        return None
    telemetry = reply.get("telemetry")
    if not isinstance(telemetry, dict):
        log.warning("agent stop for job %s: reply without telemetry", job_id)
        return None
    return telemetry


def status(cfg: HookConfig) -> dict[str, Any] | None:
    """The agent's status reply (for ``swapaware doctor``), or None when it does not answer."""
    return _call(cfg, {"op": "status"})
