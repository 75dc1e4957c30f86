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

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.serving.client import RETRYABLE
from policy_service.trust.limits import MAX_REQUEST_BYTES

log = logging.getLogger("swapaware.spool")
# The RPCs a hook spools: proto method name -> (request message, its field in a batched JobEvent).
# The node side needs no more of the service than the proto.
EVENT_REQUESTS: dict[str, tuple[type[Message], str]] = {"JobStarted": (pb.JobStartedRequest, "started"),
                                                        "JobFinished": (pb.JobFinishedRequest, "finished")}


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


# EventResult codes (google.rpc numbers) an event is set aside for: it will never be taken.
PERMANENT = {grpc.StatusCode.INVALID_ARGUMENT.value[0], grpc.StatusCode.FAILED_PRECONDITION.value[0]}
BATCH_EVENTS = 500  # the service's limit per ReportEvents call (policy_service.trust.limits)
# A batch also stays under the service's message size (else RESOURCE_EXHAUSTED for every try, and
# the spool never drains): 500 finished events with 8 GPUs' telemetry and OOM evidence are ~450 KB.
BATCH_BYTES = MAX_REQUEST_BYTES - 4096
_STOPPING = RETRYABLE | {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED}


def _status(exc: grpc.RpcError) -> tuple[grpc.StatusCode, str]:
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    return code, f"{code.name}: {exc.details() if hasattr(exc, 'details') else exc}"


def _load(spool_dir: Path, path: Path) -> tuple[str, Message] | None:
    try:
        data = json.loads(path.read_text())
        method = data["method"]
        if method not in EVENT_REQUESTS:
            raise ValueError(f"{method!r} is not an event a hook spools")
        msg = EVENT_REQUESTS[method][0]()
        json_format.ParseDict(data["request"], msg)
        return method, msg
    except Exception as exc:  # unreadable file: keep it aside, never drop it silently
        _reject(spool_dir, path, f"unreadable spool file: {exc}")
        return None


def _as_event(method: str, msg: Message) -> pb.JobEvent:
    return pb.JobEvent(**{EVENT_REQUESTS[method][1]: msg})


_CODE_NAMES = {c.value[0]: c.name for c in grpc.StatusCode}


def _chunk(items: list, start: int, most: int) -> list:
    """The next batch from ``items[start:]``: at most ``most`` events and ``BATCH_BYTES`` (at least one)."""
    size, end = 0, start
    while end < len(items) and end - start < most:
        _path, m, msg = items[end]
        size += msg.ByteSize() + 8  # the JobEvent and events field framing
        if end > start and size > BATCH_BYTES:
            break
        end += 1
    return items[start:end]


class _Tally:
    def __init__(self) -> None:
        self.sent = self.rejected = 0
        self.stopped = ""


def _one(spool_dir: Path, send, path: Path, method: str, msg: Message, t: _Tally) -> bool:
    """Send one event by its own RPC; False when replay must stop (the service cannot take it now)."""
    try:
        send(method, msg)
    except grpc.RpcError as exc:
        code, text = _status(exc)
        if code in _STOPPING:
            t.stopped = text
            return False
        _reject(spool_dir, path, text)
        t.rejected += 1
        return True
    path.unlink()
    t.sent += 1
    return True


def _batch(spool_dir: Path, send, chunk: list, t: _Tally) -> bool | None:
    """Send ``chunk`` ([(path, method, msg)]) as one ReportEvents. False: stop; None: the service
    has no ReportEvents (older release): send these one by one."""
    req = pb.ReportEventsRequest(events=[_as_event(m, msg) for _, m, msg in chunk])
    try:
        resp = send("ReportEvents", req)
    except grpc.RpcError as exc:
        code, text = _status(exc)
        if code == grpc.StatusCode.UNIMPLEMENTED:
            return None
        if code in _STOPPING:
            t.stopped = text
            return False
        return None  # the batch as a whole was refused: find the event at fault one by one
    if len(resp.results) != len(chunk):
        t.stopped = f"ReportEvents answered {len(resp.results)} results for {len(chunk)} events"
        return False
    go_on = True
    for (path, _m, _msg), res in zip(chunk, resp.results):
        if res.code == 0:
            path.unlink()
            t.sent += 1
        elif res.code in PERMANENT:
            _reject(spool_dir, path, f"{_CODE_NAMES.get(res.code, res.code)}: {res.message}")
            t.rejected += 1
        else:  # the service failed on it (INTERNAL): keep it, and try again later
            t.stopped = f"code {res.code}: {res.message}"
            go_on = False
    return go_on


def _lock(lock, wait_s: float) -> bool:
    """The spool's lock, waiting up to ``wait_s`` for a replay that holds it to end."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)


def replay(spool_dir: Path, send: Callable[[str, Message], object], max_events: int,
           batch: int = BATCH_EVENTS, wait_s: float = 0.0) -> ReplayResult:
    """Send spooled events through ``send(method, request)``, oldest first, at most ``max_events``:
    ``batch`` at a time in one ReportEvents (the service resolves a batch with one Slurm query),
    one RPC each against a service without it. Holds the spool's lock (one replay at a time);
    ``wait_s``: how long to wait for another replay (the agent's) to end before giving up."""
    files = pending(spool_dir)
    if not files:
        return ReplayResult(0, 0, 0, "")
    lock_path = spool_dir / ".lock"
    with open(lock_path, "a") as lock:
        if not _lock(lock, wait_s):
            return ReplayResult(0, 0, len(pending(spool_dir)), "another replay holds the spool lock")
        t = _Tally()
        items = []
        for path in pending(spool_dir)[:max_events]:
            loaded = _load(spool_dir, path)
            if loaded is None:
                t.rejected += 1
            else:
                items.append((path, *loaded))
        batched = batch > 1
        i = 0
        while i < len(items):
            chunk = _chunk(items, i, batch if batched else 1)
            if batched:
                done = _batch(spool_dir, send, chunk, t)
                if done is None:  # send these one by one (and later ones too, on an older service)
                    batched = False
                    continue
            else:
                chunk = chunk[:1]
                path, m, msg = chunk[0]
                done = _one(spool_dir, send, path, m, msg, t)
            if not done:
                break
            i += len(chunk)
        return ReplayResult(t.sent, t.rejected, len(pending(spool_dir)), t.stopped)


def _reject(spool_dir: Path, path: Path, why: str) -> None:
    dest = spool_dir / "rejected"
    dest.mkdir(exist_ok=True, mode=0o700)
    os.replace(path, dest / path.name)
    (dest / (path.name + ".why")).write_text(why + "\n")
    log.error("spooled event %s rejected: %s (kept in %s)", path.name, why, dest)
