"""Local spool of hook events the service could not take: nothing observed is lost.

Each event is one JSON file ``<spool>/<time_ns>-<event_id>.json`` holding
``{"method": "JobFinished", "request": {...proto3 JSON...}}``, written atomically. Replay sends
them oldest first and stops at the first transient failure; the service applies an event id
once, so a replay after a lost reply is harmless. Events the service rejects as invalid move to
``<spool>/rejected/`` with the reason, for an admin to read.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message

from policy_service.client import RETRYABLE
from policy_service.handler import Method

log = logging.getLogger("swapaware.spool")


@dataclass(frozen=True)
class ReplayResult:
    sent: int
    rejected: int
    left: int
    stopped_by: str  # "" when the spool was drained or the batch ended


def spool_event(spool_dir: Path, method: str, request: Message, event_id: str) -> Path:
    spool_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    body = json.dumps({"method": method, "request": json_format.MessageToDict(request)}, sort_keys=True)
    final = spool_dir / f"{time.time_ns():020d}-{event_id}.json"
    tmp = spool_dir / f".{final.name}.tmp"
    # 0600: an event names the job's user, node and GPUs; only root (the hooks) reads the spool
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        f.write(body)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    return final


def reject_event(spool_dir: Path, method: str, request: Message, event_id: str, why: str) -> Path:
    """Keep an event the service refused in ``rejected/`` with the reason (never drop it)."""
    path = spool_event(spool_dir, method, request, event_id)
    _reject(spool_dir, path, why)
    return spool_dir / "rejected" / path.name


def pending(spool_dir: Path) -> list[Path]:
    if not spool_dir.is_dir():
        return []
    return sorted(p for p in spool_dir.glob("*.json") if not p.name.startswith("."))


def replay(spool_dir: Path, send: Callable[[str, Message], object], max_events: int) -> ReplayResult:
    """Send spooled events through ``send(method, request)``; bounded by ``max_events``."""
    files = pending(spool_dir)
    if not files:
        return ReplayResult(0, 0, 0, "")
    lock_path = spool_dir / ".lock"
    with open(lock_path, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return ReplayResult(0, 0, len(files), "another replay holds the spool lock")
        sent = rejected = 0
        stopped = ""
        for path in pending(spool_dir)[:max_events]:
            try:
                data = json.loads(path.read_text())
                method = Method.by_name(data["method"])
                msg = method.value[1]()
                json_format.ParseDict(data["request"], msg)
            except Exception as exc:  # unreadable file: keep it aside, never drop it silently
                _reject(spool_dir, path, f"unreadable spool file: {exc}")
                rejected += 1
                continue
            try:
                send(method.value[0], msg)
            except grpc.RpcError as exc:
                code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
                if code in RETRYABLE or code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                    stopped = f"{code.name}: {exc.details() if hasattr(exc, 'details') else exc}"
                    break
                _reject(spool_dir, path, f"{code.name}: {exc.details()}")
                rejected += 1
                continue
            path.unlink()
            sent += 1
        return ReplayResult(sent, rejected, len(pending(spool_dir)), stopped)


def _reject(spool_dir: Path, path: Path, why: str) -> None:
    dest = spool_dir / "rejected"
    dest.mkdir(exist_ok=True, mode=0o700)
    os.replace(path, dest / path.name)
    (dest / (path.name + ".why")).write_text(why + "\n")
    log.error("spooled event %s rejected: %s (kept in %s)", path.name, why, dest)
