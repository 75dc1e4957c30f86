"""job_submit's Lua module, the socket to the service: a service down or hung fails open and opens
the breaker, an invalid reply applies nothing, a kept connection is reused and a stale one replaced,
only a closed kept connection is retried (a hung one sends the request once).

The harness (run_lua, gpu_job...) is test_lua_plugin.py's."""
import json
import socket
import threading
from pathlib import Path

import pytest

from tests.adapter.plugin.test_lua_plugin import gpu_job, run_lua


def test_service_down_fails_open_and_opens_the_breaker(tmp_path):
    out = run_lua(tmp_path, [gpu_job(), gpu_job()], tmp_path / "missing.sock")
    for res in out["results"]:
        assert res["rc"] == 0 and res["job"]["tres_per_node"] == "gres:gpu:1" and "admin_comment" not in res["job"]
    assert any("fail-open" in line for line in out["logs"])
    assert any("circuit open" in line for line in out["logs"])


def hung_server(path: Path):
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(8)
    held = []
    stop = threading.Event()

    def loop():
        srv.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
                held.append(conn)  # read nothing, answer nothing
            except socket.timeout:
                pass
            except OSError:
                return

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    return srv, stop, held


def test_hung_service_costs_one_timeout_then_breaker_skips(tmp_path):
    path = tmp_path / "hung.sock"
    srv, stop, held = hung_server(path)
    try:
        out = run_lua(tmp_path / "s", [gpu_job(), gpu_job(), gpu_job()], path, timeout_ms=200)
    finally:
        stop.set()
        srv.close()
    first = out["results"][0]
    assert 0.15 <= first["elapsed_s"] < 5.0  # the one timeout (the upper bound: it did not hang)
    # the other two were skipped by the open breaker: the service was sent one request in all
    assert sum(received(conn).count(b"\n") for conn in held) == 1
    assert sum("circuit open" in line for line in out["logs"]) == 1
    assert all(r["job"]["tres_per_node"] == "gres:gpu:1" for r in out["results"])


def received(conn: socket.socket) -> bytes:
    """What a held connection was sent (it is read only now)."""
    conn.setblocking(False)
    out = b""
    while True:
        try:
            chunk = conn.recv(65536)
        except BlockingIOError:
            return out
        if not chunk:
            return out
        out += chunk


@pytest.mark.parametrize("reply", [
    {"response": {"decision": {"rewrite": {"tresPerNode": 5}}}},
    {"response": {"decision": {"rewrite": {"siteFactor": 2**40}}}},
    {"response": {"decision": {"rewrite": {"tresPerNode": "gres:shard:1;rm -rf", "adminComment": "x"}}}},
    {"response": {"decision": {"rewrite": {"tresPerNode": "gres:shard:1", "evil": "x"}}}},
    {"response": {}},
    {"error": {"code": "INTERNAL", "message": "boom"}},
])
def test_invalid_reply_applies_nothing(tmp_path, reply):
    path = tmp_path / "fake.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(1)

    def answer():
        conn, _ = srv.accept()
        conn.makefile("rb").readline()
        conn.sendall(json.dumps(reply).encode() + b"\n")
        conn.close()

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    out = run_lua(tmp_path / "s", [gpu_job()], path)
    t.join(5)
    srv.close()
    job = out["results"][0]["job"]
    assert job["tres_per_node"] == "gres:gpu:1" and "admin_comment" not in job and "site_factor" not in job
    assert any("passes unchanged" in line for line in out["logs"])


def unix_server(path: Path, serve) -> tuple[socket.socket, threading.Event, dict]:
    """A service stand-in on ``path``: each connection handled by ``serve(conn)`` in its own thread;
    counts connections."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(8)
    srv.settimeout(0.1)
    stats = {"connections": 0}
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            stats["connections"] += 1
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=loop, daemon=True).start()
    return srv, stop, stats


def counting_server(path: Path, close_after_each: bool):
    """Answers every line with a share decision; counts connections and requests."""
    reply = json.dumps({"response": {"decision": {"decisionId": "x", "rewrite": {"tresPerNode": "gres:shard:2"}}}})
    requests = {"requests": 0}

    def serve(conn):
        with conn:
            for _line in conn.makefile("rb"):
                requests["requests"] += 1
                conn.sendall(reply.encode() + b"\n")
                if close_after_each:
                    return

    srv, stop, stats = unix_server(path, serve)
    return srv, stop, (stats, requests)


@pytest.mark.parametrize("close_after_each,connections", [(False, 1), (True, 3)])
def test_connection_is_kept_and_a_stale_one_replaced(tmp_path, close_after_each, connections):
    path = tmp_path / "svc.sock"
    srv, stop, stats = counting_server(path, close_after_each)
    try:
        out = run_lua(tmp_path / "s", [gpu_job(), gpu_job(), gpu_job()], path)
    finally:
        stop.set()
        srv.close()
    assert [r["job"]["tres_per_node"] for r in out["results"]] == ["gres:shard:2"] * 3
    assert (stats[0]["connections"], stats[1]["requests"]) == (connections, 3)
    assert not any("fail-open" in line for line in out["logs"])


def test_service_socket_serves_many_requests_on_one_connection(service):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(str(service.socket_path))
        f = s.makefile("rb")
        for _ in range(3):
            s.sendall(b'{"method":"Admit","request":{"job":{"user":"u","tresPerNode":"gres:gpu:1"}}}\n')
            assert b'"decision"' in f.readline()


@pytest.mark.parametrize("err, stale", [
    ("receive: closed", True), ("send: closed", True), ("send: Broken pipe", True),
    ("receive: Connection reset by peer", True),
    ("timeout", False), ("receive: timeout", False), ("send: timeout", False), ("connect x: refused", False),
])
def test_only_a_closed_kept_connection_is_retried(tmp_path, err, stale):
    """Before: the retry compared the error with "timeout", but a timed-out receive says "receive:
    timeout": an Admit the service was still deciding was sent twice."""
    out = run_lua(tmp_path, [{"stale_error": err}], tmp_path / "none.sock")
    assert out["results"][0]["stale"] is stale


def test_a_hung_kept_connection_sends_the_request_once(tmp_path):
    """The first Admit is answered on a kept connection, then the service hangs: the second Admit
    times out and is not sent again on a fresh connection (the service would decide it twice)."""
    path = tmp_path / "s.sock"
    lines: list[bytes] = []
    reply = {"response": {"decision": {"decisionId": "d1", "rewrite": {"adminComment": "swapaware:v1 id=d1"}}}}

    def serve(conn):
        f = conn.makefile("rb")
        first = True
        while not stop.is_set():
            line = f.readline()
            if not line:
                return
            lines.append(line)
            if first:
                conn.sendall(json.dumps(reply).encode() + b"\n")
                first = False  # then hang: read on, answer nothing

    srv, stop, _stats = unix_server(path, serve)
    try:
        out = run_lua(tmp_path / "s", [gpu_job(), gpu_job(name="second")], path, timeout_ms=300)
    finally:
        stop.set()
        srv.close()
    first, second = out["results"]
    assert first["job"]["admin_comment"] == "swapaware:v1 id=d1"
    assert "admin_comment" not in second["job"]
    assert len(lines) == 2 and b"second" in lines[1], lines
