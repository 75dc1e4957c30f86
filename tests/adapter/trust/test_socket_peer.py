"""The local socket's identity checks: its file mode (0660) keeps other users out, and the kernel's
word on a peer (SO_PEERCRED) decides what a peer that got in may do."""
from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import grpc
import pytest

from policy_service.serving.local_socket import handle_line, may_send, peer_cred
from policy_service.config import load_config
from policy_service.serving.handler import Method
from policy_service.serving.server import start_service
from tests.adapter.as_user import NOBODY, ChildError, run_as
from tests.adapter.conftest import socket_call

SLURM_UID = 64030  # SlurmUser in the fake scontrol's config (tests/adapter/conftest.py)
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: connects as other users (setuid)")


def test_peer_cred_is_the_kernels_word():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        assert peer_cred(a) == (os.getuid(), os.getgid())


@pytest.mark.parametrize("method", list(Method))
@pytest.mark.parametrize("uid", [0, 990, 1000, SLURM_UID, None])
def test_may_send(method, uid):
    assert may_send(method, uid, own_uid=990) is (not method.is_event or uid in (0, 990))


@pytest.mark.parametrize("name", ["JobStarted", "JobFinished", "ReportEvents"])
def test_events_from_another_uid_are_refused_before_the_handler(name):
    line = json.dumps({"method": name, "request": {"jobId": 1}}).encode()
    out = json.loads(handle_line(None, line, uid=os.geteuid() + 12345, gid=100))  # no handler needed: refused first
    assert out["error"]["code"] == "PERMISSION_DENIED"
    assert "over the local socket is for root and the service's user" in out["error"]["message"]


@pytest.fixture
def open_socket_service(service_env, slurm_jobs, short_dir: Path):
    """The service with its socket where other users can reach the directory; each test opens the
    socket file itself as far as it needs."""
    short_dir.chmod(0o755)
    env = {**service_env, "SWAPAWARE_SERVICE__SOCKET_PATH": str(short_dir / "policy.sock")}
    svc = start_service(load_config(env=env), slurm=slurm_jobs)
    yield svc
    svc.stop(0)


def call_as(uid: int, path: Path, payload: dict) -> dict:
    return run_as(uid, uid, lambda: socket_call(path, payload))


def admit(user: str, uid: int) -> dict:
    return {"method": "Admit", "request": {"job": {"user": user, "uid": uid, "tresPerNode": "gres:gpu:1"}}}


@needs_root
def test_the_file_mode_keeps_other_users_out(open_socket_service):
    path = open_socket_service.socket_path
    assert oct(path.stat().st_mode & 0o777) == "0o660"
    with pytest.raises(ChildError, match="PermissionError"):
        call_as(NOBODY, path, admit("nobody", NOBODY))


@needs_root
def test_a_peer_that_is_not_slurmctld_gets_dry_runs_and_no_events(open_socket_service):
    """As if nobody were in the socket's group: it may connect, and SO_PEERCRED names it."""
    svc = open_socket_service
    path = svc.socket_path
    path.chmod(0o666)
    out = call_as(NOBODY, path, {"method": "JobFinished", "request": {"jobId": 1, "eventId": "f1"}})
    assert out["error"]["code"] == "PERMISSION_DENIED"
    d = call_as(NOBODY, path, admit("nobody", NOBODY))["response"]["decision"]
    dry = [r["message"] for r in d["reasons"] if r["code"] == "dry_run_not_slurmctld"]
    assert dry and f"local-socket peer uid {NOBODY} is not root, SlurmUser (uid {SLURM_UID})" in dry[0]
    # slurmctld (SlurmUser) and root: recorded
    by_slurm = call_as(SLURM_UID, path, admit("alice", 4321))["response"]["decision"]
    by_root = socket_call(path, admit("nobody", NOBODY))["response"]["decision"]
    for rec in (by_slurm, by_root):
        assert "dry_run_not_slurmctld" not in [r["code"] for r in rec.get("reasons", [])]
    # SlurmUser's events go over gRPC (the hooks run as root): not over this socket
    out = call_as(SLURM_UID, path, {"method": "JobFinished", "request": {"jobId": 2, "eventId": "f2"}})
    assert out["error"]["code"] == "PERMISSION_DENIED"
    # Explain: the peer's own job, not another user's
    mine = call_as(NOBODY, path, {"method": "Explain", "request": {"decisionId": by_root["decisionId"]}})
    assert mine["response"]["decision"]["decisionId"] == by_root["decisionId"]
    theirs = call_as(NOBODY, path, {"method": "Explain", "request": {"decisionId": by_slurm["decisionId"]}})
    assert theirs["error"]["code"] == grpc.StatusCode.PERMISSION_DENIED.name
    assert f"you are uid {NOBODY} (nobody)" in theirs["error"]["message"]
    svc.handler.flush()
    assert svc.store.decision(d["decisionId"]) is None
    assert svc.store.decision(by_slurm["decisionId"]) is not None
    assert [o.job_id for o in svc.store.observations()] == []
