"""doctor's checks of the processes behind the sockets (policy_service/admin/peers.py): the
service's user read with SO_PEERCRED from a real Unix socket server, the node agent (and the line
it gives where this user may not ask it), and the origin of this host's MUNGE credentials judged
by the service's own rule (authz.event_verdict)."""
from __future__ import annotations

import json
import os
import socket
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from policy_service.admin.host import agent_probe
from policy_service.admin.peers import (PERMISSION_DENIED, agent_check, munge_origin_check, parse_unmunge, peer_uid,
                                        service_user_check)
from policy_service.admin.perms import Who, me, stat_chain, user_name
from policy_service.slurm.slurm_files import parse_slurm_conf
from policy_service.trust.authz import Addresses, Caller, Trust, Via, event_verdict
from policy_service.config import AgentConfig, Config, HookConfig
from tests.adapter.as_user import NOBODY, run_as

from tests.unit.doctor_layout import open_dir  # noqa: F401  (fixture)
from tests.unit.admin.test_doctor import GOOD_SLURM_CONF

SLURM = Who("slurm", 64030, frozenset({64030}))
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: a peer of another uid (setuid child)")


class LineServer:
    """A Unix socket server in a thread answering each line with ``reply`` (the service's and the
    agent's framing: one JSON line each way)."""

    def __init__(self, path: Path, reply: bytes = b'{"ok": true}\n', mode: int = 0o660):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        os.chmod(path, mode)
        self.sock.listen(8)
        self.reply = reply
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                try:
                    if conn.recv(65536):
                        conn.sendall(self.reply)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self.thread.join(5)


def serve_as(uid: int, gid: int, path: Path) -> int:
    """A child that binds ``path``, becomes ``uid``/``gid``, then listens (SO_PEERCRED gives a
    client the listener's credentials as of listen()) and serves one connection. Its pid."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind(str(path))
            os.chmod(path, 0o660)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            s.listen(1)
            os.write(w, b"1")
            conn, _ = s.accept()
            conn.recv(1)
        finally:
            os._exit(0)
    os.close(w)
    assert os.read(r, 1) == b"1"
    os.close(r)
    return pid


# ------------------------------------------------------------------------ 5. the service's user
def test_a_root_service_shuts_slurmctld_out_then_one_run_as_slurm_user_does_not(open_dir):
    path = open_dir / "policy.sock"
    server = LineServer(path)  # this process: root where the tests run as root
    try:
        uid, error = peer_uid(str(path))
        assert (uid, error) == (os.geteuid(), "")
        chain, _ = stat_chain(path)
        c = service_user_check(str(path), uid, error, chain, SLURM, me())
        if os.geteuid() == 0:
            assert not c.ok and "the service runs as root (SO_PEERCRED uid 0)" in c.detail
            assert "mode 0660" in c.detail and "SlurmUser slurm is neither" in c.detail and "no uid rule" in c.detail.lower()
            assert "every GPU job passes unchanged" in c.detail and "EACCES" in c.detail
            assert "the socket's owner and mode shut it out" in c.detail
            assert "User=slurm" in c.fix and "chown -R slurm: /var/lib/swapaware" in c.fix
        else:
            assert c.ok and f"runs as {user_name(uid)}" in c.detail
    finally:
        server.close()
    if os.geteuid() == 0:  # mended: the service runs as SlurmUser (here: nobody)
        path.unlink()
        pid = serve_as(NOBODY, NOBODY, path)
        try:
            uid, error = peer_uid(str(path))
        finally:
            os.waitpid(pid, 0)
        nobody = Who(user_name(NOBODY), NOBODY, frozenset({NOBODY}))
        c = service_user_check(str(path), uid, error, stat_chain(path)[0], nobody, me())
        assert uid == NOBODY and c.ok and not c.warn and c.detail.endswith(", SlurmUser"), c


@as_root
def test_not_checked_as_a_user_the_socket_refuses(open_dir):
    path = open_dir / "policy.sock"
    server = LineServer(path)  # root:root 0660
    try:
        uid, error = run_as(NOBODY, NOBODY, lambda: peer_uid(str(path)))
    finally:
        server.close()
    assert (uid, error) == (None, PERMISSION_DENIED)
    nobody = Who("nobody", NOBODY, frozenset({NOBODY}))
    c = service_user_check(str(path), uid, error, [], SLURM, nobody)
    assert c.ok and c.skipped and c.detail.startswith("not checked as nobody"), c


def test_service_user_cases():
    sock = [("/run/swapaware/policy.sock", SimpleNamespace(st_mode=0o140660, st_uid=0, st_gid=64030))]
    # root, but the socket's group is SlurmUser's (chgrp by hand, or Group=slurm): works, warned
    c = service_user_check("/p", 0, "", sock, SLURM, me())
    assert c.ok and c.warn and "only through its group or mode" in c.detail and "User=slurm" in c.fix
    root = Who("root", 0, frozenset({0}))
    assert service_user_check("/p", 0, "", sock, root, me()).detail.endswith("(SlurmUser=root)")
    c = service_user_check("/p", None, "connection refused", [], SLURM, me())
    assert not c.ok and "nothing listens on /p" in c.detail
    assert service_user_check("/p", None, "no such socket", [], SLURM, me()).skipped
    c = service_user_check("/p", 1234, "", sock, SLURM, me())
    assert c.ok and "uid 1234" in c.detail and "SlurmUser" not in c.detail


# --------------------------------------------------------------------------------- 6. the agent
def _agent_cfg(path: Path) -> Config:
    return Config(hooks=HookConfig(agent_socket=path, agent_timeout_s=2.0), agent=AgentConfig(socket_path=path))


def test_the_agent_as_a_user_who_may_not_ask_it_is_not_a_failure(open_dir):
    path = open_dir / "agent.sock"
    server = LineServer(path, mode=0o600)  # as the agent makes it: root's, 0600
    conf = parse_slurm_conf(GOOD_SLURM_CONF)
    try:
        c = agent_probe(_agent_cfg(path), conf, "gpu01", SLURM)  # doctor run as the service's user
        assert c.ok and c.skipped, c
        assert c.detail == (f"not checkable as slurm (socket owned by {user_name(os.geteuid())}, 0600): run doctor as "
                            "root on the node")
        c = agent_probe(_agent_cfg(path), conf, "gpu01", me())  # as its owner: asked, and it answers
        assert c.ok and not c.skipped and c.detail == f"node agent at {path} answers"
    finally:
        server.close()
    c = agent_probe(_agent_cfg(path), conf, "gpu01", me())  # the socket left behind, no agent behind it
    assert not c.ok and "does not answer" in c.detail
    path.unlink()
    c = agent_probe(_agent_cfg(path), conf, "gpu01", me())
    assert not c.ok and "swapaware-agent is not running on this GPU node" in c.detail and "systemctl" in c.fix
    c = agent_probe(_agent_cfg(path), conf, "login01", me())  # no GPU node: no agent needed
    assert c.ok and c.skipped and "login01 is no GPU node" in c.detail


def test_the_agent_refusing_its_status_fails(open_dir):
    path = open_dir / "agent.sock"
    server = LineServer(path, reply=json.dumps({"ok": False, "error": "x"}).encode() + b"\n", mode=0o600)
    try:
        assert not agent_probe(_agent_cfg(path), parse_slurm_conf(GOOD_SLURM_CONF), "gpu01", me()).ok
    finally:
        server.close()


def test_hooks_and_agent_on_different_sockets_fail():
    c = agent_check("/run/a.sock", [], "", me(), None, True, "gpu01", "/run/b.sock")
    assert not c.ok and "the prolog and epilog never reach it" in c.detail


# ----------------------------------------------------------------------------------- 7. MUNGE
# unmunge -N (munge 0.5.15) of a munged without and with its origin resolved, and unmunge without -N
UNMUNGE_NULL = "STATUS:          0\nENCODE_HOST:     0.0.0.0\nENCODE_TIME:     1796550608\n"
UNMUNGE_NODE = "STATUS:          0\nENCODE_HOST:     10.0.0.11\nENCODE_TIME:     1796550608\n"
UNMUNGE_NAMED = "STATUS:          Success (0)\nENCODE_HOST:     ??? (10.9.8.7)\nTTL:             300\n"
ADDRS = Addresses(nodes={"10.0.0.11": "gpu01", "10.0.0.12": "gpu02"}, controllers={"10.0.0.1": "ctl01"})
TRUST = Trust(munge=True, token=False, slurm_uid=64030, service_uid=64030)


def _origin(origin: str | None, addrs: Addresses = ADDRS, token: bool = False, error: str = ""):
    verdict = event_verdict("JobFinished", Caller(Via.MUNGE, 0, 0, origin), TRUST, addrs) if origin else None
    return munge_origin_check(origin, error, verdict, addrs, "gpu01", token, "/run/munge/munge.socket.2")


def test_parse_unmunge():
    assert parse_unmunge(UNMUNGE_NULL) == "0.0.0.0"
    assert parse_unmunge(UNMUNGE_NODE) == "10.0.0.11"
    assert parse_unmunge(UNMUNGE_NAMED) == "10.9.8.7"
    assert parse_unmunge("STATUS: 0\n") is None


def test_a_null_origin_fails_with_the_services_words_then_the_nodes_address_passes():
    c = _origin(parse_unmunge(UNMUNGE_NULL))
    assert not c.ok and "0.0.0.0 is not a node or controller of this cluster" in c.detail
    assert "null address" in c.detail and "nothing is learned" in c.detail
    assert "munged with --origin=10.0.0.11" in c.fix and "/etc/default/munge" in c.fix  # gpu01's address
    c = _origin(parse_unmunge(UNMUNGE_NODE))
    assert c.ok and not c.warn and c.detail == "origin 10.0.0.11: MUNGE uid 0 gid 0 from 10.0.0.11 (node gpu01)"


def test_an_address_that_is_no_node_fails_and_the_token_softens_it():
    c = _origin("10.9.8.7")
    assert not c.ok and "10.9.8.7 is not a node or controller of this cluster" in c.detail
    c = _origin("10.9.8.7", token=True)
    assert c.ok and c.warn and "taken on the hooks' token instead" in c.detail


def test_unreadable_addresses_or_no_credential_are_not_failures():
    c = _origin("10.9.8.7", addrs=Addresses(error="reading the nodes from Slurm failed: boom"))
    assert c.ok and c.skipped and "could not be read" in c.detail
    c = _origin("0.0.0.0", addrs=Addresses(error="boom"))  # null: refused whatever Slurm says
    assert not c.ok
    c = _origin(None, error="unmunge: Failed to access socket")
    assert c.ok and c.warn and "gave no credential" in c.detail
