"""Controller-local Unix socket: canonical proto3 JSON of the same messages as gRPC.

Framing: one line each way per request; a client may keep the connection open and send
further requests on it (job_submit.lua does, to keep slurmctld's cost per job low).
  request:  {"method": "Admit", "request": {<AdmitRequest as proto3 JSON>}}\n
  response: {"response": {<AdmitResponse as proto3 JSON>}}\n
        or  {"error": {"code": "INVALID_ARGUMENT", "message": "..."}}\n
Used by job_submit.lua (Lua 5.1 speaks no gRPC); answered by the same ``PolicyHandler``.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import socketserver
import struct
import threading
import time
from pathlib import Path

import grpc
from google.protobuf import json_format

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.atomic_file import listening_unix_server
from policy_service.serving import json_codec
from policy_service.trust.authz import Caller
from policy_service.serving.handler import Method, PolicyHandler
from policy_service.serving.handler_error import HandlerError
from policy_service.trust.limits import MAX_REQUEST_BYTES, oversize

log = logging.getLogger(__name__)
IDLE_TIMEOUT_S = 600.0  # a kept connection with no request is closed after this


# Events feed the model: over this socket only root and the service's own user may send them
# (job_submit.lua, inside slurmctld, only sends Admit). The peer's uid and gid come from the
# kernel; the handler's authorizer decides with them whether an Admit is recorded (root,
# SlurmUser, the service's user: slurmctld) and whose jobs an Explain may show.


def peer_cred(sock: socket.socket) -> tuple[int | None, int | None]:
    """(uid, gid) of the process at the other end of a Unix socket (SO_PEERCRED), or (None, None)."""
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None, None
    _pid, uid, gid = struct.unpack("3i", creds)
    return uid, gid


def peer_uid(sock: socket.socket) -> int | None:
    """The uid of the process at the other end of a Unix socket (SO_PEERCRED), or None."""
    return peer_cred(sock)[0]


def idle_timeout(sock: socket.socket, seconds: float) -> None:
    """A blocking ``sock`` whose recv and send give up after ``seconds`` (the kernel's SO_RCVTIMEO,
    SO_SNDTIMEO: a read then ends as at the end of the stream, a write fails), without Python's
    timeout mode, which polls before each of them (two system calls more per Admit)."""
    sock.settimeout(None)
    whole = int(seconds)
    idle = struct.pack("ll", whole, int((seconds - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, idle)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, idle)


def peer_closed(sock: socket.socket) -> bool:
    """Whether the other end of ``sock`` closed it (its end of stream is there to read), without waiting."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except OSError:
        return False


def may_send(method: Method, uid: int | None, own_uid: int) -> bool:
    """Whether a peer with ``uid`` may call ``method`` here (None: unknown, trusted for nothing
    but Admit and Explain)."""
    return not method.is_event or uid in (0, own_uid)


# Admit lines parsed before -> their request: slurmctld sends a class's jobs as the same line
# (the facts, brief, the plugin's counters), and reading one was a fifth of an Admit's CPU. The
# request is a pure function of the line, and only lines whose request is within the size limits
# are kept (a hit skips that check); the handler never changes a request it is given.
PARSED_MAX, PARSED_LINE_MAX = 4096, 8192  # lines kept (forgotten all at once when full), bytes each
_PARSED: dict[bytes, pb.AdmitRequest] = {}


def handle_line(handler: PolicyHandler, line: bytes, uid: int | None = None, gid: int | None = None) -> bytes:
    """One request line -> one response line. Never raises. ``uid``, ``gid``: the peer's."""
    try:
        method, msg, sized = _request(line, uid)
        t0 = time.perf_counter()
        if method is Method.ADMIT:  # the reply line: a remembered brief decision's is made without a message
            out = method.call(handler, msg, Caller.peer(uid, gid), sized, encode=_response_line)
            if not msg.dry_run and handler.on_local_admit is not None:
                handler.on_local_admit(uid)  # only the slurmctld in control runs job_submit (docs/ha.md)
            handler.metrics.admit_by["socket"].observe(time.perf_counter() - t0)
            return out
        return _response_line(method.call(handler, msg, Caller.peer(uid, gid), sized))
    except HandlerError as exc:
        body = {"error": {"code": exc.code.name, "message": exc.message}}
    except Exception:
        log.exception("local socket request failed")
        body = {"error": {"code": "INTERNAL", "message": "request failed inside the service; see its log"}}
    return _ENCODE(body).encode() + b"\n"


def _response_line(reply) -> bytes:
    """The line of ``reply``: a message, or its proto3 JSON dict already made (Admit's brief replies)."""
    return _ENCODE({"response": reply if type(reply) is dict else json_codec.to_dict(reply)}).encode() + b"\n"


def _request(line: bytes, uid: int | None) -> tuple[Method, object, bool]:
    """(method, request, known to be within the size limits) of a request line from a peer with
    ``uid``; raises HandlerError."""
    msg = _PARSED.get(line)
    if msg is not None:
        return Method.ADMIT, msg, True
    try:
        envelope = json.loads(line)
    except (ValueError, RecursionError) as exc:  # not JSON, not UTF-8, nested too deep, a 5000-digit number
        raise HandlerError(grpc.StatusCode.INVALID_ARGUMENT, f"request is not JSON: {str(exc)[:200]}") from None
    if (not isinstance(envelope, dict) or not isinstance(envelope.get("method"), str)
            or not isinstance(envelope.get("request", {}), (dict, type(None)))):
        raise HandlerError(grpc.StatusCode.INVALID_ARGUMENT, 'request must be {"method": ..., "request": {...}}')
    method = Method.by_name(envelope["method"])
    if not may_send(method, uid, os.geteuid()):
        log.warning("local socket: %s from uid %s refused (events only from root or uid %d)",
                    method.value[0], uid, os.geteuid())
        raise HandlerError(grpc.StatusCode.PERMISSION_DENIED,
                           f"{method.value[0]} over the local socket is for root and the service's user")
    try:
        msg = json_codec.parsed(envelope.get("request") or {}, method.value[1])
    except (json_format.ParseError, ValueError, TypeError, RecursionError) as exc:
        raise HandlerError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"bad {method.value[0]} request: {str(exc)[:300]}") from None
    sized = method is Method.ADMIT and len(line) <= PARSED_LINE_MAX and not oversize(msg)
    if sized:
        if len(_PARSED) >= PARSED_MAX:
            _PARSED.clear()
        _PARSED[line] = msg
    return method, msg, sized


_ENCODE = json.JSONEncoder(separators=(",", ":")).encode  # json.dumps's, made once


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    allow_reuse_address = True
    # A burst of submissions must not see EAGAIN on connect (the default backlog is 5).
    request_queue_size = 256


def start_local_socket(handler: PolicyHandler, path: Path, mode: int = 0o660) -> tuple[socketserver.BaseServer, threading.Thread]:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() or path.is_symlink():
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.settimeout(0.2)
            probe.connect(str(path))
            raise OSError(f"{path} is in use by another running service")
        except (ConnectionRefusedError, FileNotFoundError, socket.timeout):
            path.unlink()  # stale socket from a previous run
        finally:
            probe.close()

    class Handler(socketserver.StreamRequestHandler):
        timeout = None  # the idle timeout is kept by the kernel (setup), not by a poll() before each recv and send

        def setup(self) -> None:
            idle_timeout(self.request, IDLE_TIMEOUT_S)
            super().setup()

        def handle(self) -> None:
            uid, gid = peer_cred(self.connection)
            while True:
                try:
                    line = self.rfile.readline(MAX_REQUEST_BYTES + 1)
                except (socket.timeout, OSError):
                    return
                if not line:
                    return  # the client closed the connection, or kept it idle past IDLE_TIMEOUT_S
                if len(line) > MAX_REQUEST_BYTES and not line.endswith(b"\n"):
                    self._reply(json.dumps({"error": {"code": "INVALID_ARGUMENT",
                                                      "message": "request too large"}}).encode() + b"\n")
                    return  # the rest of that line cannot be framed: drop the connection
                if not line.endswith(b"\n") and not peer_closed(self.connection):
                    return  # a line cut by the idle timeout is dropped (a last one before the client closed is answered)
                if not line.strip():
                    continue
                if not self._reply(handle_line(handler, line, uid, gid)):
                    return

        def _reply(self, data: bytes) -> bool:
            try:
                self.wfile.write(data)
                self.wfile.flush()
                return True
            except OSError:
                return False  # the client gave up (its deadline passed)

    # the path appears once the socket listens with its mode: slurmctld's Lua is never refused meanwhile
    server = listening_unix_server(lambda address: _Server(address, Handler), path, mode)
    thread = threading.Thread(target=server.serve_forever, name="local-socket", daemon=True)
    thread.start()
    return server, thread
