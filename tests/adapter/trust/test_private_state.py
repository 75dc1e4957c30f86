"""Bounded, private state: an oversize request is refused with INVALID_ARGUMENT on both transports
and leaves nothing in the history; the history is created 0600 and a foreign-owned one is refused;
spooled events are 0600. Real service, real SQLite, real gRPC on loopback, real Unix socket."""
import json
import os
import sqlite3
import stat

import grpc
import pytest

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.history.store import HistoryOwnerError, HistoryStore
from policy_service.config import load_config
from policy_service.serving.server import start_service
from slurm_plugin.hooks.spool import spool_event

from tests.adapter.conftest import socket_call

BIG = "x" * (4 * 1024 * 1024)  # what an unprivileged user sent as work_dir, 10 times
LONG = "x" * (100 * 1024)  # within one request's bound, over the field's


def _decisions(db_path) -> int:
    with sqlite3.connect(f"file:{db_path}?mode=ro", uri=True) as db:
        return db.execute("SELECT COUNT(*) FROM decisions").fetchone()[0]


def test_oversize_admit_is_refused_over_grpc_and_the_socket_and_not_stored(service, client, service_env):
    before = _decisions(service_env["SWAPAWARE_SERVICE__DB_PATH"])
    for _ in range(3):
        with pytest.raises(grpc.RpcError) as err:  # refused by the transport, before parsing
            client.admit(pb.JobFacts(user="mallory", tres_per_node="gres/gpu:1", work_dir=BIG))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.RpcError) as err:  # refused by the field's limit
            client.admit(pb.JobFacts(user="mallory", tres_per_node="gres/gpu:1", work_dir=LONG))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "job.work_dir is 102400 bytes, at most 4096" in err.value.details()
    reply = socket_call(service.socket_path, {"method": "Admit", "request": {
        "job": {"user": "mallory", "tresPerNode": "gres/gpu:1", "comment": "c" * 5000}}})
    assert reply["error"]["code"] == "INVALID_ARGUMENT" and "job.comment is 5000 bytes" in reply["error"]["message"]
    # a request within the limits is answered as before, and only it is recorded
    ok = client.admit(pb.JobFacts(user="alice", tres_per_node="gres/gpu:1", work_dir="/home/alice"))
    assert ok.decision.decision_id
    service.handler.flush()
    assert _decisions(service_env["SWAPAWARE_SERVICE__DB_PATH"]) == before + 1


def test_oversize_event_is_refused(service, client):
    with pytest.raises(grpc.RpcError) as err:
        client.call("JobFinished", pb.JobFinishedRequest(job_id=1, node="n" * 2000, event_id="e1"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "node is 2000 bytes" in err.value.details()


def test_history_is_created_owner_only(tmp_path):
    path = tmp_path / "state" / "history.sqlite3"
    HistoryStore(path).close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    for side in path.parent.glob("history.sqlite3-*"):  # -wal / -shm take the database's mode
        assert stat.S_IMODE(side.stat().st_mode) & 0o077 == 0, side


def test_a_readable_history_is_narrowed_to_0600(tmp_path):
    path = tmp_path / "history.sqlite3"
    HistoryStore(path).close()
    os.chmod(path, 0o644)
    HistoryStore(path).close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_service_refuses_a_history_another_user_owns(tmp_path, service_env, slurm_jobs):
    path = tmp_path / "history.sqlite3"
    HistoryStore(path).close()
    os.chown(path, 65534, 65534)  # nobody: a file this service does not own
    with pytest.raises(HistoryOwnerError, match="belongs to uid 65534"):
        start_service(load_config(env=dict(service_env, SWAPAWARE_SERVICE__DB_PATH=str(path))), slurm=slurm_jobs)
    assert path.stat().st_uid == 65534  # untouched


def test_spooled_events_are_owner_only(tmp_path):
    spool = tmp_path / "spool"
    f = spool_event(spool, "JobFinished", pb.JobFinishedRequest(job_id=3, node="n1", event_id="e3"), "e3")
    assert stat.S_IMODE(f.stat().st_mode) == 0o600
    assert stat.S_IMODE(spool.stat().st_mode) == 0o700


PEER = r"""
import json, os, socket, sys
os.setgid(65534); os.setuid(65534)  # nobody
with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
    s.settimeout(5)
    s.connect(sys.argv[1])
    for line in sys.stdin:
        s.sendall(line.encode())
        print(s.makefile("rb").readline().decode(), end="", flush=True)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="a peer of another uid needs root to create")
def test_local_socket_takes_events_only_from_root_and_the_service_user(short_dir, service_env, slurm_jobs):
    import subprocess
    import sys

    sock = short_dir / "policy.sock"
    svc = start_service(load_config(env=dict(service_env, SWAPAWARE_SERVICE__SOCKET_PATH=str(sock))),
                        slurm=slurm_jobs)
    try:
        os.chmod(short_dir, 0o711)
        os.chmod(sock, 0o666)  # let another user connect: the peer check is what is tested here
        event = {"method": "JobFinished", "request": {"jobId": 7, "node": "n1", "eventId": "ev-7"}}
        admit = {"method": "Admit", "request": {"job": {"user": "bob", "tresPerNode": "gres/gpu:1"}}}
        r = subprocess.run([sys.executable, "-c", PEER, str(sock)], capture_output=True, text=True, timeout=60,
                           input=json.dumps(event) + "\n" + json.dumps(admit) + "\n")
        replies = [json.loads(line) for line in r.stdout.splitlines()]
        assert len(replies) == 2, r.stderr
        assert replies[0]["error"]["code"] == "PERMISSION_DENIED"
        assert replies[1]["response"]["decision"]["decisionId"]  # Admit stays open to the socket's group
        as_root = socket_call(sock, event)
        assert "error" not in as_root or as_root["error"]["code"] != "PERMISSION_DENIED", as_root
    finally:
        svc.stop(0)
