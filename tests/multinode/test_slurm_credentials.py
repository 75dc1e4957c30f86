"""A credential Slurm mints is no credential for swapaware: what a user's ``srun`` receives from
slurmctld, captured without privilege and replayed at every method of the service, is refused.

slurmctld answers a job-step request with the step's credential, signed by a MUNGE credential that
SlurmUser encodes on the controller (cred/munge: TTL 300, no uid restriction, the packed step
credential as its payload), and every reply carries slurmctld's own MUNGE credential (auth/munge).
A user sees those bytes by pointing their own ``srun`` (``SLURM_CONF``, a copy of slurm.conf) at
a relay they run, which passes everything on to slurmctld and keeps what comes back: no privilege
is needed. ``srun`` runs on a compute node, so the controller's munged (the service's) has never
decoded these credentials: the service's refusal is for their payload, not munged's replay cache.
"""
from __future__ import annotations

import re
import socket
import tempfile
import threading
import uuid
from pathlib import Path

import grpc
import pytest

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from tests.multinode.test_identity import NOBODY, call, held_job
from tests.waiting import wait_for

MUNGE_CRED = re.compile(rb"MUNGE:[A-Za-z0-9+/]+=*:")


class Relay:
    """A TCP relay to slurmctld that keeps every byte slurmctld sends back (what ``srun`` receives)."""

    def __init__(self, host: str, upstream: tuple[str, int]):
        self.upstream = upstream
        self.server = socket.create_server((host, 0))
        self.port = self.server.getsockname()[1]
        self._received = bytearray()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:  # closed
                return
            ctld = socket.create_connection(self.upstream, timeout=30)
            threading.Thread(target=self._pump, args=(client, ctld, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(ctld, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, keep: bool) -> None:
        try:
            while chunk := src.recv(65536):
                if keep:
                    with self._lock:
                        self._received += chunk
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def credentials(self) -> list[str]:
        with self._lock:
            return [m.decode() for m in MUNGE_CRED.findall(bytes(self._received))]

    def close(self) -> None:
        self.server.close()


def ctld_address(conf: str) -> tuple[str, int]:
    host = re.search(r"^SlurmctldHost=[^(\s]+\(([^)]+)\)", conf, re.M).group(1)
    port = int(re.search(r"^SlurmctldPort=(\d+)", conf, re.M).group(1))
    return host, port


@pytest.fixture
def user_conf(cluster):
    """A user's own copy of Slurm's configuration directory (what anyone may read of it: srun
    reads cli_filter.lua beside slurm.conf) whose SlurmctldPort is a relay's, and the relay."""
    etc = cluster.state / "etc"
    conf = (etc / "slurm.conf").read_text()
    host, port = ctld_address(conf)
    relay = Relay(host, (host, port))
    with tempfile.TemporaryDirectory(prefix="user-conf-", dir=cluster.state) as d:
        Path(d).chmod(0o755)
        for f in etc.iterdir():
            if f.is_file() and f.stat().st_mode & 0o004:
                (Path(d) / f.name).write_bytes(f.read_bytes())
                (Path(d) / f.name).chmod(0o644)
        copy = Path(d) / "slurm.conf"
        copy.write_text(re.sub(r"^SlurmctldPort=\d+", f"SlurmctldPort={relay.port}", conf, flags=re.M))
        copy.chmod(0o644)
        yield copy, relay
    relay.close()


def captured(cluster, relay: Relay, conf: Path) -> list[str]:
    """The MUNGE credentials a user's ``srun`` on node1 receives from slurmctld for one step."""
    before = len(relay.credentials())
    # srun's own outcome does not matter: the step's credential came with the step
    r = cluster.node("node1", "runuser", "-u", NOBODY, "--", "env", f"SLURM_CONF={conf}", "srun", "-N1",
                     "--chdir=/tmp", f"--job-name=cap-{uuid.uuid4().hex[:6]}", "true", timeout=120, check=False)
    return wait_for(lambda: relay.credentials()[before:] or None, 10,
                    lambda: f"srun's credentials through the relay (srun: {r.returncode} {r.stderr[-2000:]})")


SLURM_UID = 0  # SlurmUser=root on the dev cluster (contrib/dev-cluster/templates/slurm.conf.in)


def forged(method: str, tag: str, job: int, roots_job: int):
    """What a user holding SlurmUser's credential would send: a recorded Admit for root, Explain of
    root's job, events for a job and a batch of 500."""
    finished = lambda j: pb.JobFinishedRequest(job_id=j, node="node1", event_id=f"{tag}-f{j}",  # noqa: E731
                                                finished_at=2.0)
    return {
        "Admit": lambda: pb.AdmitRequest(job=pb.JobFacts(user="root", uid=0, tres_per_node="gres:gpu:1",
                                                         job_name=tag)),
        "Explain": lambda: pb.ExplainRequest(job_id=roots_job),
        "JobStarted": lambda: pb.JobStartedRequest(job_id=job, node="node1", event_id=f"{tag}-s", gpu_indices=[0],
                                                   started_at=1.0),
        "JobFinished": lambda: finished(job),
        "ReportEvents": lambda: pb.ReportEventsRequest(events=[pb.JobEvent(finished=finished(job + i))
                                                               for i in range(500)]),
    }[method]()


@pytest.mark.parametrize("method", ["Admit", "Explain", "JobStarted", "JobFinished", "ReportEvents"])
def test_a_credential_srun_receives_is_refused_at_every_method(cluster, user_conf, method):
    """Before: the step credential decoded as SlurmUser's from the controller and was accepted
    (events applied, decisions recorded, any job explained)."""
    conf, relay = user_conf
    ctld = ctld_address(conf.read_text())[0]
    tag, job = f"cap-{uuid.uuid4().hex[:8]}", 800000 + uuid.uuid4().int % 90000
    roots_job, _ = held_job(cluster)
    try:
        creds = captured(cluster, relay, conf)
        details = []
        for cred in sorted(creds, key=len, reverse=True):  # the step credential first: the longest payload
            with pytest.raises(grpc.RpcError) as err:
                call(cluster, method, forged(method, tag, job, roots_job), cred)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, (method, err.value.details())
            details.append(err.value.details())
        # the step credential decoded (a fresh SlurmUser credential from the controller) and was
        # refused for what it is, none of swapaware's, and for its TTL (munged's default)
        assert re.fullmatch(re.escape(f"MUNGE credential of uid {SLURM_UID} from {ctld} refused: its payload is not "
                                      f"swapaware's (a credential made for something else, such as one of Slurm's "
                                      f"own); made to live ") + r"\d+ s, more than auth\.max_ttl_s = 60",
                            details[0]), (len(creds), details)
        held, decision = held_job(cluster)  # decisions and events are written in order: ours would be in by now
        cluster.run("scancel", str(held))
    finally:
        cluster.run("scancel", str(roots_job))
    with cluster.history() as db:
        assert db.execute("SELECT 1 FROM decisions WHERE decision_id=?", (decision,)).fetchone()
        assert db.execute("SELECT count(*) FROM decisions WHERE job_name=?", (tag,)).fetchone() == (0,)
        assert db.execute("SELECT count(*) FROM events WHERE event_id LIKE ?", (f"{tag}%",)).fetchone() == (0,)
        assert db.execute("SELECT count(*) FROM runs WHERE job_id=?", (job,)).fetchone() == (0,)
