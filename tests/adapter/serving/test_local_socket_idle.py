"""The local socket's idle timeout, kept by the kernel (SO_RCVTIMEO, SO_SNDTIMEO) on a blocking
socket: a kept connection with no request is closed after IDLE_TIMEOUT_S, a line cut by it is
dropped unanswered, and a last line the client sent without its newline before closing is answered."""
from __future__ import annotations

import socket
import struct
import time

import pytest

from policy_service.config import load_config
from policy_service.history.store import HistoryStore
from policy_service.serving import local_socket
from policy_service.serving.handler import PolicyHandler

ADMIT = b'{"method":"Admit","request":{"job":{"user":"u","tresPerNode":"gres:gpu:1"}}}'


@pytest.fixture
def sock_path(tmp_path, monkeypatch):
    monkeypatch.setattr(local_socket, "IDLE_TIMEOUT_S", 0.3)
    h = PolicyHandler(load_config(env={}), HistoryStore(":memory:"), None)
    server, _thread = local_socket.start_local_socket(h, tmp_path / "s.sock")
    yield tmp_path / "s.sock"
    server.shutdown()
    server.server_close()
    h.close()


def _connect(path) -> socket.socket:
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    c.settimeout(10)
    c.connect(str(path))
    return c


def _read_all(c: socket.socket) -> bytes:
    out = b""
    while chunk := c.recv(65536):
        out += chunk
    return out


def test_a_kept_connection_answers_until_it_is_idle_past_the_timeout(sock_path):
    with _connect(sock_path) as c:
        f = c.makefile("rb")
        for _ in range(3):
            c.sendall(ADMIT + b"\n")
            assert f.readline().startswith(b'{"response"')
            time.sleep(0.1)  # (well within the timeout: each request starts it again)
        t0 = time.monotonic()
        assert f.read() == b""  # closed by the service
        assert 0.2 < time.monotonic() - t0 < 5


def test_a_line_cut_by_the_idle_timeout_is_dropped_unanswered(sock_path):
    with _connect(sock_path) as c:
        c.sendall(ADMIT[:20])
        assert _read_all(c) == b""


def test_a_last_line_without_its_newline_is_answered_when_the_client_closes(sock_path):
    with _connect(sock_path) as c:
        c.sendall(ADMIT)
        c.shutdown(socket.SHUT_WR)
        assert _read_all(c).startswith(b'{"response"')


def test_the_connection_is_blocking_with_the_kernels_timeouts(sock_path):
    a, b = socket.socketpair()
    with a, b:
        a.settimeout(5)
        local_socket.idle_timeout(a, 1.25)
        assert a.gettimeout() is None
        for opt in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
            seconds, micros = struct.unpack("ll", a.getsockopt(socket.SOL_SOCKET, opt, struct.calcsize("ll")))
            assert seconds == 1 and abs(micros - 250000) < 20000  # (the kernel keeps it in clock ticks)
