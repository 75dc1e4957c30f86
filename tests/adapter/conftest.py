"""Adapter fixtures: a real service (real SQLite, real gRPC on loopback port 0, real Unix socket).

Slurm itself is replaced only where the service would read a job's AdminComment or the queue: a
stateful stand-in that holds what slurmctld would have stored (the Lua plugin's admin comment,
the pending jobs). The integration tests use the real Slurm."""
from __future__ import annotations

import contextlib
import json
import socket
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pytest

from policy_service.slurm.slurm import JobInstance, PendingJob, SlurmError
from policy_service.slurm.slurm_hosts import (controller_hosts, node_hosts, parse_config, parse_nodes_oneliner,
                                               resolve_ipv4)
from policy_service.slurm.slurm_hosts import slurm_user as _slurm_user
from policy_service.serving.client import PolicyClient
from policy_service.config import load_config
from policy_service.serving.server import start_service


@dataclass
class SlurmJobs:
    """What slurmctld knows: job id -> AdminComment (filled by 'submitting')."""

    comments: dict[int, str] = field(default_factory=dict)
    lookups: int = 0

    def job_admin_comment(self, job_id: int) -> str | None:
        self.lookups += 1
        return self.comments.get(job_id)

    def accounting_jobs(self, job_ids=(), start="", end=""):
        return []

    def set_admin_comment(self, job_id: int, text: str) -> None:
        self.comments[job_id] = text

    # Job instances as squeue shows them (correlation of hook events). A job id whose comment the
    # test changes is a new job of that id: it gets a later submit time. Ended jobs: none.
    submits: dict[int, tuple[str, int]] = field(default_factory=dict)
    instance_reads: int = 0
    _last_submit: int = 0

    def _instance(self, job_id: int) -> JobInstance | None:
        comment = self.comments.get(job_id)
        if comment is None:
            return None
        known = self.submits.get(job_id)
        if known is None or known[0] != comment:
            self._last_submit = max(int(time.time()), self._last_submit + 1)
            known = self.submits[job_id] = (comment, self._last_submit)
        return JobInstance(job_id, "test", known[1], 1, 0, comment, "RUNNING", source="squeue")

    def live_instances(self, job_ids) -> list[JobInstance]:
        self.instance_reads += 1
        return [inst for inst in map(self._instance, job_ids) if inst is not None]

    def ended_instances(self, job_ids) -> list[JobInstance]:
        return []

    # What squeue/sacct show of every job's AdminComment (reconciliation); None makes it fail.
    held_failure: str | None = None

    def held_decision_ids(self, since: float) -> set[str]:
        from policy_service.slurm.slurm_text import decision_ids_in
        if self.held_failure:
            raise SlurmError(self.held_failure)
        return decision_ids_in("\n".join(self.comments.values()))

    # Every job's AdminComment as squeue (live) and sacct (accounting) show it: the catch-up of
    # decisions the plugin made from the admission table. Live: every job the test submitted.
    def live_commented_jobs(self):
        from policy_service.slurm.slurm_comments import CommentedJob
        return [CommentedJob(i.job_id, i.submit_time, None, "test", "", "", i.state, i.admin_comment, "squeue")
                for i in map(self._instance, list(self.comments)) if i is not None]

    def accounted_commented_jobs(self, since: float):
        return []

    # The queue as squeue/sinfo would show it; tests set these, None makes the call fail.
    pending: list[PendingJob] | None = field(default_factory=list)
    gpus: int = 4
    queue_reads: int = 0

    def pending_jobs(self) -> list[PendingJob]:
        self.queue_reads += 1
        if self.pending is None:
            raise SlurmError("squeue: error: slurm_load_jobs error: Unable to contact slurm controller")
        return list(self.pending)

    def queue_with_comments(self):
        """The queue monitor's one squeue when the catch-up follows it: pending_jobs() and
        live_commented_jobs() (SlurmAccess.queue_with_comments)."""
        return self.pending_jobs(), self.live_commented_jobs()

    def cluster_gpus(self) -> int:
        return self.gpus

    # node -> lower-case type -> shards, as sinfo %G shows them (LiveShards.by_node)
    node_shards: dict[str, dict[str, int]] = field(default_factory=dict)
    # nodes in State=UNKNOWN (not registered with the controller since it started)
    node_unregistered: set[str] = field(default_factory=set)

    def cluster_nodes(self):
        from policy_service.slurm.slurm_text import NodeGres
        return NodeGres(self.gpus, {n: dict(c) for n, c in self.node_shards.items()}, frozenset(self.node_unregistered))

    qos_table: dict[str, int] = field(default_factory=dict)  # {}: no per-QoS view

    def qos_priorities(self) -> dict[str, int]:
        return dict(self.qos_table)

    # scontrol update of a pending job: refused (like Slurm for a job that started) when listed
    started: set[int] = field(default_factory=set)
    tres: dict[int, str] = field(default_factory=dict)

    def update_pending_job(self, job_id: int, tres_per_node: str, admin_comment: str) -> None:
        if job_id in self.started:
            raise SlurmError(f"scontrol update JobId={job_id} exited 1: Job is no longer pending execution")
        self.tres[job_id] = tres_per_node
        self.comments[job_id] = admin_comment

    # A requeue (slurm/requeue.py), as scontrol does it: refused for a job listed in
    # ``no_requeue`` (--no-requeue: ESLURM_DISABLED) and a job Slurm does not know; the job is then
    # held (``held``) until released; every call in ``requeue_calls``.
    no_requeue: set[int] = field(default_factory=set)
    held: set[int] = field(default_factory=set)
    requeue_calls: list[tuple] = field(default_factory=list)

    def requeue_hold(self, job_id: int) -> None:
        self.requeue_calls.append(("requeuehold", job_id))
        if job_id in self.no_requeue:
            raise SlurmError(f"scontrol requeuehold {job_id} exited 1: Requested operation is presently disabled "
                             f"for job {job_id}")
        if job_id not in self.comments:
            raise SlurmError(f"scontrol requeuehold {job_id} exited 1: Invalid job id specified")
        self.held.add(job_id)

    def update_held_job(self, job_id: int, fields, admin_comment: str) -> None:
        self.requeue_calls.append(("update", job_id, dict(fields), admin_comment))
        assert job_id in self.held, "a requeued job is updated while held"
        assert self.completing_reads == 0, "a requeued job is updated once its epilogs ended"
        self.tres[job_id] = fields.get("tres_per_node", self.tres.get(job_id, ""))
        self.comments[job_id] = admin_comment

    def release_job(self, job_id: int) -> None:
        self.requeue_calls.append(("release", job_id))
        self.held.discard(job_id)

    # A requeued job stays COMPLETING while its epilogs run: this many state reads say so.
    completing_reads: int = 0

    def job_state(self, job_id: int) -> str:
        self.requeue_calls.append(("state", job_id))
        if self.completing_reads > 0:
            self.completing_reads -= 1
            return "COMPLETING"
        return "PENDING"

    # The cluster's hosts and users, for the access checks, as scontrol and sacctmgr print them and
    # parsed and resolved as CliSlurm does (policy_service.slurm.slurm_hosts): a MUNGE
    # credential's origin must be a node's address (events) or a controller's (a recorded Admit).
    # Like the single-host dev cluster: one node and the controller, both on this host (127.0.0.1).
    # Tests change these to move hosts in or out of the cluster; ``hosts_failure`` makes scontrol fail.
    nodes_text: str = ("NodeName=node1 Arch=x86_64 CoresPerSocket=1 CPUAlloc=0 NodeAddr=127.0.0.1 "
                       "NodeHostName=localhost Version=22.05.8 OS=Linux State=IDLE Partitions=debug\n")
    config_text: str = "SlurmctldHost[0]    = ctl(127.0.0.1)\nSlurmctldAddr       = (null)\nSlurmUser           = slurm(64030)\n"
    admin_levels: dict[str, str] = field(default_factory=dict)  # user name -> sacctmgr AdminLevel
    hosts_failure: str | None = None
    host_reads: int = 0

    def _scontrol(self, text: str) -> str:
        self.host_reads += 1
        if self.hosts_failure:
            raise SlurmError(self.hosts_failure)
        return text

    def node_addresses(self) -> dict[str, str]:
        return resolve_ipv4(node_hosts(parse_nodes_oneliner(self._scontrol(self.nodes_text))))[0]

    def controller_addresses(self) -> dict[str, str]:
        return resolve_ipv4((h, h) for h in controller_hosts(parse_config(self._scontrol(self.config_text))))[0]

    def slurm_user(self) -> tuple[str, int | None]:
        return _slurm_user(parse_config(self._scontrol(self.config_text)))

    def admin_level(self, user: str) -> str:
        return self.admin_levels.get(user, "None")


@pytest.fixture
def service_env(tmp_path: Path) -> dict[str, str]:
    return {
        "SWAPAWARE_SERVICE__DB_PATH": str(tmp_path / "history.sqlite3"),
        "SWAPAWARE_SERVICE__SOCKET_PATH": str(tmp_path / "policy.sock"),
        "SWAPAWARE_SERVICE__GRPC_ADDRESS": "127.0.0.1:0",
        "SWAPAWARE_HOOKS__SPOOL_DIR": str(tmp_path / "spool"),
        "SWAPAWARE_HOOKS__AGENT_SOCKET": str(tmp_path / "no-agent.sock"),
        "SWAPAWARE_HOOKS__DEADLINE_S": "2",
        # the partitions' per-GPU defaults come from this slurm.conf (none unless a test writes it),
        # never from the machine's
        "SWAPAWARE_SERVICE__SLURM_CONF": str(tmp_path / "slurm.conf"),
        # Decisions here are about memory; the queue rules have their own tests
        # (test_queue_monitor.py, test_compute_aware_service.py).
        "SWAPAWARE_POLICY__SHARE_MIN_QUEUE": "0",
        "SWAPAWARE_POLICY__OVERCOMMIT_COMPUTE_MIN_QUEUE": "0",
        "SWAPAWARE_POLICY__REDECIDE_PENDING": "false",
        # No admission table (on by default, beside the socket) unless a test publishes one: its
        # publisher and catch-up have their own tests (test_admission_*.py).
        "SWAPAWARE_ADMISSION__TABLE_PATH": "",
        # A class shares from its second run (the default, 3, has its own test in test_estimator.py).
        "SWAPAWARE_ESTIMATOR__MIN_SAMPLES": "1",
        # The dev stack's release (the tests spell GRES as 22.05 does); never ask this host's scontrol.
        "SWAPAWARE_SERVICE__SLURM_RELEASE": "22.05",
        # No MUNGE unless a test starts its own munged (test_munge.py): "auto" would turn it on
        # wherever this host runs a munged at the default socket.
        "SWAPAWARE_AUTH__MUNGE": "off",
    }


@pytest.fixture
def slurm_jobs() -> SlurmJobs:
    return SlurmJobs()


@contextlib.contextmanager
def served(env: dict[str, str], slurm_jobs: SlurmJobs):
    """A service of ``env``'s config on ``slurm_jobs`` and a gRPC client of it: (service, client),
    the service stopped after."""
    svc = start_service(load_config(env=env), slurm=slurm_jobs)
    try:
        with PolicyClient(f"127.0.0.1:{svc.grpc_port}", 5.0) as c:
            yield svc, c
    finally:
        svc.stop(0)


@pytest.fixture
def service(service_env, slurm_jobs):
    cfg = load_config(env=service_env)
    svc = start_service(cfg, slurm=slurm_jobs)
    yield svc
    svc.stop(0)


@pytest.fixture
def client(service):
    with PolicyClient(f"127.0.0.1:{service.grpc_port}", 5.0) as c:
        yield c


def socket_call(path: Path, payload: dict | bytes, timeout_s: float = 5.0) -> dict:
    raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode() + b"\n"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        s.connect(str(path))
        s.sendall(raw)
        return json.loads(s.makefile("rb").readline())


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short directory: Unix socket paths are limited to 107 bytes."""
    with tempfile.TemporaryDirectory(prefix="sa-", dir="/tmp") as d:
        yield Path(d)


from tests.mariadb_server import history_backend, mariadb_backend, mariadb_server  # noqa: E402,F401  (fixtures)
