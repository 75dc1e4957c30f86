"""Slurm access behind one interface.

* ``CliSlurm``: the Slurm command-line tools (``scontrol``, ``sacct --json``, ``sacctmgr``);
  works on 22.05, where ``scontrol`` has no ``--json`` (that arrives in 23.02), and speaks the
  running release's dialect (``sacct --json=v0.0.4X`` pinned per release).
* ``PyslurmSlurm`` (slurm_pyslurm.py): pyslurm, used only where its version matches the cluster's (pyslurm
  25.11 builds against Slurm 25.11 only).

``open_slurm`` picks one. The parsers are pure functions tested on real-shaped output.
"""
from __future__ import annotations

import logging
import os
import re
import subprocess
from dataclasses import dataclass
from typing import Mapping, Protocol, Sequence

from policy_service.slurm.slurm_text import (  # noqa: F401  (the parsers are part of this module's API)
    SINFO_NODE_FORMAT,
    SQUEUE_PENDING_FORMAT,
    SQUEUE_TIME_ENV,
    AccountingJob,
    JobInstance,
    PendingJob,
    SlurmError,
    decision_ids_in,
    gres_detail_indices,
    job_gpu_indices,
    parse_qos_priorities,
    parse_sacct_instances,
    parse_sacct_json,
    NodeGres,
    parse_sinfo_gpus,
    parse_sinfo_nodes,
    parse_squeue_instances,
    parse_squeue_pending,
    scontrol_field,
    squeue_instance_format,
)
from policy_service.slurm.slurm_comments import (
    TIME_ENV,
    CommentedJob,
    QueueRows,
    parse_commented,
    parse_queue_rows,
    queue_argv,
    sacct_argv,
    squeue_argv,
)
from policy_service.slurm.slurm_hosts import (
    SCONTROL_JSON_SINCE,
    node_hosts,
    parse_admin_level,
    parse_config,
    parse_nodes_json,
    parse_nodes_oneliner,
    resolve_ipv4,
)
from policy_service.slurm.slurm_hosts import controller_hosts as _controller_hosts
from policy_service.slurm.slurm_hosts import slurm_user as _slurm_user
from policy_service.config import SlurmBackend
from policy_service.core.dialect import SlurmDialect, dialect_for, parse_release

log = logging.getLogger(__name__)


class SlurmAccess(Protocol):
    def job_admin_comment(self, job_id: int) -> str | None: ...

    def pending_jobs(self) -> list[PendingJob]: ...

    def cluster_gpus(self) -> int: ...

    def cluster_nodes(self) -> NodeGres: ...

    def qos_priorities(self) -> dict[str, int]: ...

    def update_pending_job(self, job_id: int, tres_per_node: str, admin_comment: str) -> None: ...

    def accounting_jobs(self, job_ids: Sequence[int] = (), start: str = "", end: str = "") -> list[AccountingJob]: ...

    def set_admin_comment(self, job_id: int, text: str) -> None: ...

    # A requeue (core/requeue.py): hold it pending, set its fields, let it go.
    def requeue_hold(self, job_id: int) -> None: ...

    def update_held_job(self, job_id: int, fields: Mapping[str, str], admin_comment: str) -> None: ...

    def release_job(self, job_id: int) -> None: ...

    def job_state(self, job_id: int) -> str: ...

    def live_instances(self, job_ids: Sequence[int]) -> list[JobInstance]: ...

    def ended_instances(self, job_ids: Sequence[int]) -> list[JobInstance]: ...

    def held_decision_ids(self, since: float) -> set[str]: ...

    # Every job's AdminComment (the admission catch-up, admission/catchup.py).
    def live_commented_jobs(self) -> list[CommentedJob]: ...

    # Both from one squeue (the queue monitor's poll when the catch-up follows it).
    def queue_with_comments(self) -> tuple[list[PendingJob], list[CommentedJob]]: ...

    def accounted_commented_jobs(self, since: float) -> list[CommentedJob]: ...

    # Access checks (policy_service.trust.access); a backend without them counts as "unknown".
    def node_addresses(self) -> dict[str, str]: ...

    def controller_addresses(self) -> dict[str, str]: ...

    def slurm_user(self) -> tuple[str, int | None]: ...

    def admin_level(self, user: str) -> str: ...


# scontrol update's names of the job fields a requeue sets (JobRewrite's names -> scontrol's).
SCONTROL_FIELDS = {"tres_per_node": "TresPerNode", "tres_per_job": "TresPerJob", "tres_per_task": "TresPerTask",
                   "tres_per_socket": "TresPerSocket", "tres_bind": "TresBind"}


class CliSlurm:
    """Slurm through its command-line tools (every call bounded by ``timeout_s``)."""

    def __init__(self, timeout_s: float = 5.0, env: dict[str, str] | None = None,
                 dialect: SlurmDialect | None = None):
        self.timeout_s = timeout_s
        self.env = env
        self.dialect = dialect  # None: the release is unknown; plain `sacct --json` works on all
        self._queue_rows: QueueRows = {}  # the last queue poll's rows (parse_queue_rows)

    @property
    def sacct_json_arg(self) -> str:
        return self.dialect.sacct_json_arg if self.dialect is not None else "--json"

    def _run(self, argv: list[str], env_extra: dict[str, str] | None = None) -> str:
        env = self.env if not env_extra else {**(self.env if self.env is not None else os.environ), **env_extra}
        try:
            res = subprocess.run(argv, capture_output=True, text=True, timeout=self.timeout_s, env=env)
        except FileNotFoundError:
            raise SlurmError(f"{argv[0]} not found on PATH") from None
        except subprocess.TimeoutExpired:
            raise SlurmError(f"{' '.join(argv)} timed out after {self.timeout_s}s") from None
        if res.returncode != 0:
            raise SlurmError(f"{' '.join(argv)} exited {res.returncode}: {res.stderr.strip()[:300]}")
        return res.stdout

    def job_admin_comment(self, job_id: int) -> str | None:
        try:
            out = self._run(["scontrol", "show", "job", "-o", str(job_id)])
            value = scontrol_field(out, "AdminComment")
            if value is not None and value != "(null)":
                return value
        except SlurmError as exc:
            log.debug("scontrol lookup of job %s failed: %s", job_id, exc)
        jobs = self.accounting_jobs(job_ids=[job_id])
        return jobs[0].admin_comment if jobs else None

    def accounting_jobs(self, job_ids: Sequence[int] = (), start: str = "", end: str = "") -> list[AccountingJob]:
        argv = ["sacct", self.sacct_json_arg, "-X", "--allusers"]
        if job_ids:
            argv += ["-j", ",".join(str(j) for j in job_ids)]
        if start:
            argv += ["-S", start]
        if end:
            argv += ["-E", end]
        return parse_sacct_json(self._run(argv))

    def live_instances(self, job_ids: Sequence[int]) -> list[JobInstance]:
        """The jobs of these ids that slurmctld holds (pending, running, or ended within MinJobAge):
        one ``squeue`` for all of them. With a single id squeue asks for that job alone and fails
        once it has gone: that is an empty answer."""
        if not job_ids:
            return []
        sluid = self.dialect is not None and self.dialect.has_sluid
        argv = ["squeue", "-h", "-a", "-t", "all", "-j", ",".join(str(j) for j in sorted(set(job_ids))),
                "-O", squeue_instance_format(sluid)]
        try:
            out = self._run(argv, SQUEUE_TIME_ENV)
        except SlurmError as exc:
            if "Invalid job id" in str(exc):
                return []
            raise
        return parse_squeue_instances(out, sluid)

    def ended_instances(self, job_ids: Sequence[int]) -> list[JobInstance]:
        """Every accounting record of these ids, in one ``sacct``: ``-D`` keeps the older jobs of an
        id that a state reset made repeat (sacct -j shows only the newest otherwise)."""
        if not job_ids:
            return []
        return parse_sacct_instances(self._run(["sacct", self.sacct_json_arg, "-X", "-D", "--allusers", "-j",
                                                ",".join(str(j) for j in sorted(set(job_ids)))]))

    def held_decision_ids(self, since: float) -> set[str]:
        """The decision ids named by the AdminComment of every job slurmctld holds (one squeue) and
        of every job in the accounting since ``since`` (one sacct)."""
        jobs = self.live_commented_jobs() + self.accounted_commented_jobs(since)
        return decision_ids_in("\n".join(j.admin_comment for j in jobs))

    def live_commented_jobs(self) -> list[CommentedJob]:
        """Every job slurmctld holds (any state: pending, running, ended within MinJobAge) with its
        AdminComment, one squeue."""
        return parse_commented(self._run(squeue_argv(), TIME_ENV), "squeue")

    def accounted_commented_jobs(self, since: float) -> list[CommentedJob]:
        """Every job in the accounting submitted, running or ended since ``since``, with its
        AdminComment, one sacct. The states are named: without ``-s`` sacct lists only jobs that
        became eligible, and a job held and cancelled never did (measured on 22.05)."""
        return parse_commented(self._run(sacct_argv(since), TIME_ENV), "sacct")

    def queue_with_comments(self) -> tuple[list[PendingJob], list[CommentedJob]]:
        """``pending_jobs()`` and ``live_commented_jobs()`` from one squeue: slurmctld packs every job
        it holds once per poll, not twice."""
        pending, commented, self._queue_rows = parse_queue_rows(self._run(queue_argv(), TIME_ENV), self._queue_rows)
        return pending, commented

    def pending_jobs(self) -> list[PendingJob]:
        return parse_squeue_pending(self._run(["squeue", "-h", "-a", "-t", "PENDING", "-O", SQUEUE_PENDING_FORMAT]))

    def cluster_gpus(self) -> int:
        return self.cluster_nodes().gpus

    def cluster_nodes(self) -> NodeGres:
        return parse_sinfo_nodes(self._run(["sinfo", "-h", "-N", "-o", SINFO_NODE_FORMAT]))

    def qos_priorities(self) -> dict[str, int]:
        return parse_qos_priorities(self._run(["sacctmgr", "-n", "-P", "show", "qos", "format=name,priority"]))

    def update_pending_job(self, job_id: int, tres_per_node: str, admin_comment: str) -> None:
        """Rewrite a pending job's GPU request and decision record (root / SlurmUser only).
        Slurm refuses once the job has started; that surfaces as ``SlurmError``."""
        self._run(["scontrol", "update", f"JobId={job_id}", f"TresPerNode={tres_per_node}",
                   f"AdminComment={admin_comment}"])

    def requeue_hold(self, job_id: int) -> None:
        """Requeue a finished, completing or running batch job and hold it (root / SlurmUser).
        Slurm refuses a job that does not allow it (--no-requeue, JobRequeue=0), an interactive
        job and one it no longer knows: ``SlurmError`` with scontrol's words."""
        self._run(["scontrol", "requeuehold", str(job_id)])

    def update_held_job(self, job_id: int, fields: Mapping[str, str], admin_comment: str) -> None:
        """Set a pending job's GPU fields (``core.requeue.GPU_FIELDS`` names; "" clears) and
        AdminComment."""
        argv = ["scontrol", "update", f"JobId={job_id}"]
        argv += [f"{SCONTROL_FIELDS[name]}={value}" for name, value in fields.items()]
        self._run([*argv, f"AdminComment={admin_comment}"])

    def release_job(self, job_id: int) -> None:
        self._run(["scontrol", "release", str(job_id)])

    def job_state(self, job_id: int) -> str:
        """The job's state as scontrol shows it (COMPLETING while its epilogs run, also once
        requeued)."""
        return scontrol_field(self._run(["scontrol", "show", "job", "-o", str(job_id)]), "JobState") or ""

    def set_admin_comment(self, job_id: int, text: str) -> None:
        """Set AdminComment on a running job, or on a finished one through accounting."""
        try:
            self._run(["scontrol", "update", f"JobId={job_id}", f"AdminComment={text}"])
        except SlurmError:
            self._run(["sacctmgr", "-i", "modify", "job", "where", f"jobid={job_id}", "set", f"AdminComment={text}"])

    # ------------------------------------------------------------------ hosts and users (access checks)
    def node_addresses(self) -> dict[str, str]:
        """IPv4 address -> node name, for every node slurmctld knows (NodeAddr and NodeHostName)."""
        if self.dialect is not None and self.dialect.release < SCONTROL_JSON_SINCE:
            nodes = parse_nodes_oneliner(self._run(["scontrol", "-o", "show", "nodes"]))
        else:
            try:
                nodes = parse_nodes_json(self._run(["scontrol", "show", "nodes", self.sacct_json_arg]))
            except SlurmError:
                if self.dialect is not None:
                    raise
                nodes = parse_nodes_oneliner(self._run(["scontrol", "-o", "show", "nodes"]))  # release unknown
        addrs, failed = resolve_ipv4(node_hosts(nodes))
        if failed:
            log.warning("node address(es) that do not resolve to IPv4: %s", ", ".join(failed[:10]))
        return addrs

    def controller_addresses(self) -> dict[str, str]:
        """IPv4 address -> host name of the controllers (SlurmctldHost, SlurmctldAddr)."""
        hosts = _controller_hosts(parse_config(self._run(["scontrol", "show", "config"])))
        addrs, failed = resolve_ipv4((h, h) for h in hosts)
        if failed:
            log.warning("controller address(es) that do not resolve to IPv4: %s", ", ".join(failed))
        return addrs

    def slurm_user(self) -> tuple[str, int | None]:
        """SlurmUser: (name, uid) from ``scontrol show config``."""
        return _slurm_user(parse_config(self._run(["scontrol", "show", "config"])))

    def admin_level(self, user: str) -> str:
        """The user's Slurm AdminLevel ('Administrator', 'Operator', 'None'; '' without a record)."""
        return parse_admin_level(self._run(["sacctmgr", "-n", "-P", "show", "user", user, "format=adminlevel"]))


# Commands that print the installed Slurm's version, tried in order. Slurm 22.05's clients need a
# configuration even for --version (they fail with "Could not establish a configuration source"
# where slurm.conf is missing or not yet written); the daemons' -V does not.
VERSION_COMMANDS = (("scontrol", "--version"), ("slurmctld", "-V"), ("slurmd", "-V"))


def slurm_version_from(timeout_s: float = 5.0) -> tuple[tuple[int, int] | None, str]:
    """(major, minor) of the installed Slurm and the command that told it; (None, why) when none
    did. ``scontrol --version`` prints 'slurm 22.05.8' (Debian: 'slurm-wlm 22.05.8')."""
    tried = []
    for argv in VERSION_COMMANDS:
        try:
            res = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s)
        except (OSError, subprocess.TimeoutExpired) as exc:
            tried.append(f"{' '.join(argv)}: {type(exc).__name__}")
            continue
        version = parse_version(res.stdout) if res.returncode == 0 else None
        if version is not None:
            return version, " ".join(argv)
        tried.append(f"{' '.join(argv)}: exit {res.returncode} {res.stderr.strip()[-120:]}")
    return None, "; ".join(tried)


def slurm_version(timeout_s: float = 5.0) -> tuple[int, int] | None:
    """(major, minor) of the installed Slurm, or None."""
    return slurm_version_from(timeout_s)[0]


def parse_version(text: str) -> tuple[int, int] | None:
    m = re.search(r"(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def choose_backend(wanted: SlurmBackend, cluster: tuple[int, int] | None, pyslurm_version: str | None) -> SlurmBackend:
    """Pure choice: pyslurm only where its major.minor equals the cluster's."""
    if wanted is not SlurmBackend.AUTO:
        return wanted
    pv = parse_version(pyslurm_version or "")
    if cluster is not None and pv is not None and pv == cluster:
        return SlurmBackend.PYSLURM
    return SlurmBackend.CLI


@dataclass(frozen=True)
class ClusterRelease:
    """The running Slurm's release, and where it came from (for the start-up log)."""

    version: tuple[int, int] | None  # None: unknown
    source: str

    @property
    def dialect(self) -> SlurmDialect:
        return dialect_for(self.version)


def cluster_release(configured: str, timeout_s: float) -> ClusterRelease:
    """``service.slurm_release`` when set, else the installed Slurm's (``VERSION_COMMANDS``)."""
    if configured.strip():
        return ClusterRelease(parse_release(configured), "service.slurm_release")
    version, source = slurm_version_from(timeout_s)
    if version is None:
        return ClusterRelease(None, f"no Slurm command told its version ({source})")
    return ClusterRelease(version, source)


def open_slurm(wanted: SlurmBackend, timeout_s: float, release: ClusterRelease | None = None) -> SlurmAccess:
    release = release if release is not None else cluster_release("", timeout_s)
    dialect = release.dialect if release.version is not None else None
    try:
        import importlib.metadata

        pv: str | None = importlib.metadata.version("pyslurm")
    except Exception:
        pv = None
    choice = choose_backend(wanted, release.version, pv)
    if choice is SlurmBackend.PYSLURM:
        from policy_service.slurm.slurm_pyslurm import PyslurmSlurm

        try:
            return PyslurmSlurm(timeout_s, dialect)
        except ImportError as exc:
            if wanted is SlurmBackend.PYSLURM:
                raise SlurmError(f"slurm_backend=pyslurm but pyslurm does not import: {exc}") from None
    log.info("slurm access: command-line tools (pyslurm %s)", pv or "not installed")
    return CliSlurm(timeout_s=timeout_s, dialect=dialect)
