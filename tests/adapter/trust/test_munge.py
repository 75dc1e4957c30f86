"""MUNGE identities against a real, private munged (its own key, socket and replay cache in a
temporary directory), and the service checking them end to end over gRPC on loopback.

Needs root (munged's credentials are made as other users by a child that setuid()s); skipped
otherwise. munge itself (munged, libmunge2) is part of the test host's packages
(contrib/dev-cluster/cluster.sh install).

This module holds the munged fixtures and call helpers the other MUNGE tests import, the credential
binding against munged itself and the service's hook events (who may send them, from which host).
Admit and Explain by identity are test_munge_admit_explain.py's."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import grpc
import pytest

from policy_service.trust import cred_binding, munge
from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.serving.client import MUNGE_METADATA, PolicyClient, message_types, method_path, serialised
from policy_service.config import ConfigError, load_config
from policy_service.serving.server import start_service
from slurm_plugin.hooks import run as hooks
from tests.waiting import wait_for
from tests.adapter.as_user import NOBODY, run_as

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: starts a private munged and makes "
                                                          "MUNGE credentials as other users (setuid)")

MUNGED = shutil.which("munged") or shutil.which("munged", path="/usr/sbin:/sbin")
SLURM_UID = 64030  # SlurmUser in the fake scontrol's config (tests/adapter/conftest.py)


@dataclass
class Munged:
    socket: Path
    pid: int
    log: Path

    def alive(self) -> bool:
        """Running (an exited munged that its parent, init, has not reaped yet counts as gone)."""
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text()
        except OSError:
            return False
        return stat.rpartition(")")[2].split()[0] != "Z"

    def stop(self) -> None:
        if not self.alive():
            return
        os.kill(self.pid, signal.SIGTERM)
        try:
            wait_for(lambda: not self.alive(), 10, f"munged (pid {self.pid}) to exit")
        except AssertionError:
            os.kill(self.pid, signal.SIGKILL)
            wait_for(lambda: not self.alive(), 5, f"munged (pid {self.pid}) to die")


def start_munged(base: Path, name: str, origin: str = "127.0.0.1") -> Munged:
    """munged with a key of its own; its socket directory is open to every user (as /run/munge)."""
    if MUNGED is None or not munge.available():
        pytest.fail("munge is not installed (munged, libmunge2): contrib/dev-cluster/cluster.sh install adds it")
    home, private = base / name, base / f"{name}-key"
    home.mkdir(mode=0o755)
    private.mkdir(mode=0o700)
    key = private / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    log = private / "munged.log"
    argv = [MUNGED, "--force", f"--origin={origin}", f"--key-file={key}", f"--socket={home / 'munge.socket'}",
            f"--pid-file={private / 'munged.pid'}", f"--log-file={log}", f"--seed-file={private / 'munged.seed'}"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)  # it forks its daemon and returns
    assert done.returncode == 0, f"munged failed: {done.stderr}{log.read_text() if log.exists() else ''}"
    pid = int(wait_for(lambda: (private / "munged.pid").exists() and (private / "munged.pid").read_text().strip(),
                       10, "munged's pid file"))
    m = Munged(home / "munge.socket", pid, log)
    wait_for(lambda: m.socket.is_socket(), 10, "munged's socket")
    return m


@pytest.fixture(scope="module")
def munge_dir() -> Iterator[Path]:
    """Under /tmp (short socket paths; open to the users the tests become, unlike pytest's tmp_path)."""
    with tempfile.TemporaryDirectory(prefix="sa-munge-", dir="/tmp") as d:
        os.chmod(d, 0o755)
        yield Path(d)


# One munged per kind for the module (munged takes about 2 s to stop); every credential is new, so
# its replay cache holds no surprise for a later test.
@pytest.fixture(scope="module")
def munged(munge_dir) -> Iterator[Munged]:
    m = start_munged(munge_dir, "cluster")
    yield m
    m.stop()


@pytest.fixture(scope="module")
def other_munged(munge_dir) -> Iterator[Munged]:
    """Another cluster's munged: the same origin, a different key."""
    m = start_munged(munge_dir, "other")
    yield m
    m.stop()


def expired(made_by: float, ttl: int) -> bool:
    """Whether munged surely counts a credential made by ``made_by`` as expired: it stamps whole
    seconds, so a credential of TTL 1 still decoded 1.5 s later in trials; 2 s past its TTL it never did."""
    return time.time() >= made_by + ttl + 2


def cred_as(uid: int, gid: int, sock: Path, ttl: int = 60) -> str:
    return run_as(uid, gid, lambda: munge.encode(socket=str(sock), ttl=ttl))


# ---------------------------------------------------------------- the binding, against munged itself
def test_round_trip_names_uid_gid_origin_and_payload(munged):
    cred = munge.encode(b"hello", socket=str(munged.socket), ttl=30)
    before = time.time()
    c = munge.decode(cred, socket=str(munged.socket))
    assert (c.uid, c.gid, c.addr, c.payload, c.ttl) == (0, 0, "127.0.0.1", b"hello", 30)
    assert before - 5 <= c.encoded_at <= before + 1
    c = munge.decode(cred_as(NOBODY, NOBODY, munged.socket), socket=str(munged.socket))
    assert (c.uid, c.gid, c.payload) == (NOBODY, NOBODY, b"")


def test_a_credential_decodes_once(munged):
    cred = munge.encode(socket=str(munged.socket))
    munge.decode(cred, socket=str(munged.socket))
    with pytest.raises(munge.MungeError) as err:
        munge.decode(cred, socket=str(munged.socket))
    assert err.value.code is munge.MungeCode.CRED_REPLAYED


def test_an_expired_credential_is_refused(munged):
    cred = munge.encode(socket=str(munged.socket), ttl=1)
    made_by = time.time()
    wait_for(lambda: expired(made_by, 1), 10, "the credential's TTL to pass")
    with pytest.raises(munge.MungeError) as err:
        munge.decode(cred, socket=str(munged.socket))
    assert err.value.code is munge.MungeCode.CRED_EXPIRED


def test_a_credential_of_another_key_is_refused(munged, other_munged):
    cred = munge.encode(socket=str(other_munged.socket))
    with pytest.raises(munge.MungeError) as err:
        munge.decode(cred, socket=str(munged.socket))
    assert err.value.code is munge.MungeCode.CRED_INVALID


def test_garbage_and_an_absent_munged(munged, munge_dir):
    for bad in ("not a credential", "MUNGE:AAAA:", "caf\u00e9", "a\0b"):
        with pytest.raises(munge.MungeError) as err:
            munge.decode(bad, socket=str(munged.socket))
        assert err.value.code in (munge.MungeCode.BAD_CRED, munge.MungeCode.BAD_LENGTH, munge.MungeCode.BAD_VERSION)
    with pytest.raises(munge.MungeError) as err:
        munge.encode(socket=str(munge_dir / "absent.socket"))
    assert err.value.code is munge.MungeCode.SOCKET
    assert munge.usable(munged.socket) and not munge.usable(munge_dir / "absent.socket")


# ---------------------------------------------------------------- the service, end to end
@pytest.fixture
def munge_env(service_env, munged) -> dict[str, str]:
    return {**service_env, "SWAPAWARE_AUTH__MUNGE": "on", "SWAPAWARE_AUTH__MUNGE_SOCKET": str(munged.socket),
            # re-read Slurm's host list on every unknown origin, and AdminLevels on every look-up,
            # so the tests can move hosts and users in and out
            "SWAPAWARE_AUTH__ADDRESS_REFRESH_MIN_S": "0", "SWAPAWARE_AUTH__ADMIN_LEVEL_CACHE_S": "0"}


@pytest.fixture
def munge_service(munge_env, slurm_jobs):
    svc = start_service(load_config(env=munge_env), slurm=slurm_jobs)
    yield svc
    svc.stop(0)


Maker = Callable[[str, object], str]  # (method, request) -> a credential for that call


def made_by(sock: Path, uid: int = 0, gid: int = 0, ttl: int = 60) -> Maker:
    """Credentials made as swapaware's clients make them (bound to their call), as ``uid``
    through the munged at ``sock``."""
    def make(method: str, request) -> str:
        payload = cred_binding.payload(method_path(method), serialised(request))
        encode = lambda: munge.encode(payload, socket=str(sock), ttl=ttl)  # noqa: E731
        return run_as(uid, gid, encode) if uid else encode()
    return make


def call_raw(svc, method: str, raw: bytes, cred: str | None = None, timeout_s: float = 5.0):
    """Call ``method`` with the request bytes ``raw`` as they are, and ``cred``."""
    with grpc.insecure_channel(f"127.0.0.1:{svc.grpc_port}") as channel:
        rpc = channel.unary_unary(method_path(method), request_serializer=None,
                                  response_deserializer=message_types(method)[1].FromString)
        return rpc(raw, timeout=timeout_s, metadata=((MUNGE_METADATA, cred),) if cred else None)


def call(svc, method: str, request, cred: str | Maker | None = None, timeout_s: float = 5.0):
    """Call ``method``; ``cred``: a credential, or a maker of one for this call."""
    if callable(cred):
        cred = cred(method, request)
    return call_raw(svc, method, serialised(request), cred, timeout_s)


def refused(svc, method: str, request, cred: str | Maker | None) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call(svc, method, request, cred)
    return err.value


def finish(job_id: int) -> pb.JobFinishedRequest:
    return pb.JobFinishedRequest(job_id=job_id, event_id=f"f{job_id}", finished_at=10.0)


def observed(svc) -> list[int]:
    return sorted(o.job_id for o in svc.store.observations())


FACTS = pb.JobFacts(user="nobody", uid=NOBODY, tres_per_node="gres:gpu:1")


def reason_codes(decision) -> list[str]:
    return [r.code for r in decision.reasons]


def test_munge_on_needs_munged(munge_env, slurm_jobs, munge_dir):
    env = {**munge_env, "SWAPAWARE_AUTH__MUNGE_SOCKET": str(munge_dir / "absent.socket")}
    with pytest.raises(ConfigError, match="munged's socket .* does not exist"):
        start_service(load_config(env=env), slurm=slurm_jobs)


def test_events_from_root_and_slurmuser_on_a_node_once_each(munge_service, munged):
    svc = munge_service
    cred = made_by(munged.socket)("JobFinished", finish(1))
    assert call(svc, "JobFinished", finish(1), cred).applied
    err = refused(svc, "JobFinished", finish(2), cred)  # the same credential again: munged's replay cache
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "CRED_REPLAYED" in err.details()
    assert call(svc, "JobFinished", finish(3), made_by(munged.socket, SLURM_UID, SLURM_UID)).applied
    # the client makes a fresh credential for every call
    with PolicyClient(f"127.0.0.1:{svc.grpc_port}", 5.0, munge_socket=str(munged.socket)) as c:
        assert c.call("JobFinished", finish(4)).applied
        c.call("JobStarted", pb.JobStartedRequest(job_id=5, event_id="s5", node="node1"))
        assert c.call("JobFinished", finish(5)).applied
    assert observed(svc) == [1, 3, 4, 5]


def test_events_from_a_user_or_without_a_good_credential_are_refused(munge_service, munged, other_munged):
    svc = munge_service
    err = refused(svc, "JobFinished", finish(1), made_by(munged.socket, NOBODY, NOBODY))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert f"MUNGE uid {NOBODY}" in err.details() and "neither root nor SlurmUser (uid 64030)" in err.details()
    err = refused(svc, "ReportEvents", pb.ReportEventsRequest(), None)
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "needs a MUNGE credential" in err.details()
    err = refused(svc, "JobFinished", finish(2), made_by(other_munged.socket))
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "CRED_INVALID" in err.details()
    err = refused(svc, "JobFinished", finish(3), made_by(munged.socket, ttl=120))
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "made to live 120 s, more than auth.max_ttl_s = 60" in err.details()
    cred = made_by(munged.socket, ttl=1)("JobFinished", finish(4))
    made_at = time.time()
    wait_for(lambda: expired(made_at, 1), 10, "the credential's TTL to pass")
    err = refused(svc, "JobFinished", finish(4), cred)
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "CRED_EXPIRED" in err.details()
    assert observed(svc) == []


def test_root_on_a_host_slurm_does_not_list_is_refused_until_it_does(munge_service, munged, slurm_jobs):
    svc = munge_service
    slurm_jobs.nodes_text = "NodeName=gpu01 NodeAddr=10.255.0.7 NodeHostName=gpu01 State=IDLE\n"
    slurm_jobs.config_text = "SlurmctldHost[0] = ctl(10.255.0.1)\nSlurmUser = slurm(64030)\n"
    err = refused(svc, "JobFinished", finish(1), made_by(munged.socket))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "127.0.0.1 is not a node or controller of this cluster" in err.details()
    slurm_jobs.nodes_text += "NodeName=node1 NodeAddr=127.0.0.1 NodeHostName=localhost State=IDLE\n"  # node added
    assert call(svc, "JobFinished", finish(2), made_by(munged.socket)).applied
    slurm_jobs.hosts_failure = "scontrol: error: Unable to contact slurm controller"  # what is known stays known
    assert call(svc, "JobFinished", finish(3), made_by(munged.socket)).applied
    assert observed(svc) == [2, 3]


def test_a_node_sends_the_events_of_its_own_node_only(munge_service, munged, slurm_jobs):
    """root on node1 holds a good credential; events naming node2 are still refused (the node
    field is inside the credential's digest: it cannot be changed on the way either)."""
    svc = munge_service
    slurm_jobs.nodes_text = ("NodeName=node1 NodeAddr=127.0.0.1 NodeHostName=localhost State=IDLE\n"
                             "NodeName=node2 NodeAddr=10.255.0.8 NodeHostName=node2 State=IDLE\n")
    slurm_jobs.config_text = "SlurmctldHost[0] = ctl(10.255.0.1)\nSlurmUser = slurm(64030)\n"
    own = pb.JobFinishedRequest(job_id=1, event_id="f1", finished_at=10.0, node="node1")
    assert call(svc, "JobFinished", own, made_by(munged.socket)).applied
    other = pb.JobFinishedRequest(job_id=2, event_id="f2", finished_at=10.0, node="node2")
    err = refused(svc, "JobFinished", other, made_by(munged.socket))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "names other nodes (node2)" in err.details()
    batch = pb.ReportEventsRequest(events=[pb.JobEvent(finished=pb.JobFinishedRequest(
        job_id=3, event_id="f3", finished_at=10.0, node="node1")), pb.JobEvent(started=pb.JobStartedRequest(
            job_id=4, event_id="s4", node="node2"))])
    assert refused(svc, "ReportEvents", batch, made_by(munged.socket)).code() == grpc.StatusCode.PERMISSION_DENIED
    # an event over the size limits is refused for its size (and applied nowhere), before its node counts;
    # beside a foreign-node event it hides nothing
    huge = pb.JobFinishedRequest(job_id=5, event_id="f5", finished_at=10.0, node="n" * 10_000)
    assert refused(svc, "JobFinished", huge, made_by(munged.socket)).code() == grpc.StatusCode.INVALID_ARGUMENT
    batch = pb.ReportEventsRequest(events=[pb.JobEvent(finished=huge), pb.JobEvent(started=pb.JobStartedRequest(
        job_id=6, event_id="s6", node="node2"))])
    assert refused(svc, "ReportEvents", batch, made_by(munged.socket)).code() == grpc.StatusCode.PERMISSION_DENIED
    assert observed(svc) == [1]


def test_events_are_unavailable_while_munged_is_down(service_env, slurm_jobs, munge_dir):
    own = start_munged(munge_dir, "stopped")
    try:
        env = {**service_env, "SWAPAWARE_AUTH__MUNGE": "on", "SWAPAWARE_AUTH__MUNGE_SOCKET": str(own.socket)}
        svc = start_service(load_config(env=env), slurm=slurm_jobs)
        try:
            cred = made_by(own.socket)("JobFinished", finish(1))
            own.stop()
            err = refused(svc, "JobFinished", finish(1), cred)
            assert err.code() == grpc.StatusCode.UNAVAILABLE
            assert "cannot check MUNGE credentials now" in err.details()
        finally:
            svc.stop(0)
    finally:
        own.stop()


def test_hooks_attach_a_credential(munge_env, munge_service):
    cfg = load_config(env={**munge_env, "SWAPAWARE_HOOKS__SERVICE_ADDRESS": f"127.0.0.1:{munge_service.grpc_port}"})
    assert hooks.deliver(cfg.hooks, "JobFinished", finish(7), auth=cfg.auth, tls=cfg.tls)
    assert observed(munge_service) == [7]
