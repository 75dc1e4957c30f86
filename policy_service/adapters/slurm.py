"""Slurm access behind one interface.

* ``CliSlurm``: the Slurm command-line tools (``scontrol``, ``sacct --json``, ``sacctmgr``);
  works on 22.05, where ``scontrol`` has no ``--json`` (that arrives in 23.02).
* ``PyslurmSlurm``: pyslurm, used only where its version matches the cluster's (pyslurm
  25.11 builds against Slurm 25.11 only).

``open_slurm`` picks one. The parsers are pure functions tested on real-shaped output.
"""
from __future__ import annotations

import json
import logging
import re
import subprocess
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

from policy_service.config import SlurmBackend

log = logging.getLogger(__name__)


class SlurmError(RuntimeError):
    pass


@dataclass(frozen=True)
class AccountingJob:
    """One job as accounting (sacct) reports it."""

    job_id: int
    user: str
    account: str
    partition: str
    job_name: str
    state: str
    exit_code: int
    submit_time: int
    start_time: int
    end_time: int
    admin_comment: str
    tres_alloc: str  # e.g. "billing=1,cpu=1,gres/gpu=1,mem=1G,node=1" or with gres/shard=2
    tres_req: str


@dataclass(frozen=True)
class PendingJob:
    """One pending job as squeue shows it (GRES fields as Slurm stores them)."""

    job_id: int
    tres_per_node: str
    tres_per_job: str
    tres_per_task: str
    nodes: int
    tasks: int
    reason: str
    qos: str = ""


class SlurmAccess(Protocol):
    def job_admin_comment(self, job_id: int) -> str | None: ...

    def pending_jobs(self) -> list[PendingJob]: ...

    def cluster_gpus(self) -> int: ...

    def qos_priorities(self) -> dict[str, int]: ...

    def update_pending_job(self, job_id: int, tres_per_node: str, admin_comment: str) -> None: ...

    def accounting_jobs(self, job_ids: Sequence[int] = (), start: str = "", end: str = "") -> list[AccountingJob]: ...

    def set_admin_comment(self, job_id: int, text: str) -> None: ...


# ----------------------------------------------------------------------------- parsers
def scontrol_field(oneliner: str, key: str) -> str | None:
    """Value of ``key`` in ``scontrol show job -o`` output. Values may contain spaces (comments),
    so a value runs until the next `` Key=`` of a known scontrol key shape."""
    m = re.search(rf"(?:^|\s){re.escape(key)}=(.*?)(?=\s[A-Z][A-Za-z:/]*=|$)", oneliner.strip())
    return None if m is None else m.group(1)


def _tres_text(tres: Any) -> str:
    if isinstance(tres, str):
        return tres
    if isinstance(tres, list):  # 22.05 sacct --json: [{"type": "gres", "name": "gpu", "count": 1}, ...]
        parts = []
        for t in tres:
            name = t.get("type", "") + (f"/{t['name']}" if t.get("name") else "")
            parts.append(f"{name}={t.get('count', 0)}")
        return ",".join(parts)
    return ""


def _exit_code(value: Any) -> int:
    if isinstance(value, dict):
        rc = value.get("return_code", 0)
        if isinstance(rc, dict):  # newer schemas: {"set": true, "number": 0}
            rc = rc.get("number", 0)
        return int(rc or 0)
    return int(value or 0)


def _time(value: Any) -> int:
    if isinstance(value, dict):
        value = value.get("number", 0)
    return int(value or 0)


def parse_sacct_json(text: str) -> list[AccountingJob]:
    """Parse ``sacct --json`` (schemas of 22.05 through 25.x)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SlurmError(f"sacct --json printed invalid JSON: {exc}") from None
    out = []
    for j in data.get("jobs", []):
        comment = j.get("comment") or {}
        tres = j.get("tres") or {}
        time = j.get("time") or {}
        state = j.get("state") or {}
        state_text = state.get("current", "") if isinstance(state, dict) else str(state)
        if isinstance(state_text, list):
            state_text = ",".join(state_text)
        out.append(AccountingJob(
            job_id=int(j.get("job_id", 0)), user=j.get("user", "") or "", account=j.get("account", "") or "",
            partition=j.get("partition", "") or "", job_name=j.get("name", "") or "", state=state_text,
            exit_code=_exit_code(j.get("exit_code")), submit_time=_time(time.get("submission")),
            start_time=_time(time.get("start")), end_time=_time(time.get("end")),
            admin_comment=(comment.get("administrator") if isinstance(comment, dict) else "") or "",
            tres_alloc=_tres_text(tres.get("allocated", "")), tres_req=_tres_text(tres.get("requested", "")),
        ))
    return out


# ----------------------------------------------------------------------------- CLI
SQUEUE_PENDING_FORMAT = ("JobID:|,tres-per-node:|,tres-per-job:|,tres-per-task:|,NumNodes:|,NumTasks:|,QOS:|,"
                         "Reason:")
SINFO_NODE_FORMAT = "%N|%G|%T"
# Node states (sinfo %T, lower case, without the "*"/"~"/"#" suffixes) that take no new jobs.
_UNAVAILABLE_NODE_STATES = ("down", "drain", "fail", "future", "inval", "powered_down", "power_down", "unknown")


def _na(value: str) -> str:
    value = value.strip()
    return "" if value in ("N/A", "(null)") else value


def parse_squeue_pending(text: str) -> list[PendingJob]:
    """Rows of ``squeue -h -t PENDING -O SQUEUE_PENDING_FORMAT`` (the reason is the last column
    and may itself contain "|")."""
    out = []
    for line in text.splitlines():
        if not line.strip():
            continue
        cols = line.split("|", 7)
        if len(cols) < 8:
            raise SlurmError(f"unexpected squeue line: {line!r}")
        try:
            job_id = int(cols[0].strip().split("_")[0])
            nodes, tasks = int(cols[4] or 1), int(cols[5] or 1)
        except ValueError:
            raise SlurmError(f"unexpected squeue line: {line!r}") from None
        out.append(PendingJob(job_id, _na(cols[1]), _na(cols[2]), _na(cols[3]), max(1, nodes), max(1, tasks),
                              cols[7].strip(), _na(cols[6])))
    return out


def parse_qos_priorities(text: str) -> dict[str, int]:
    """``sacctmgr -n -P show qos format=name,priority`` -> {name: priority}."""
    out = {}
    for line in text.splitlines():
        name, _, prio = line.strip().partition("|")
        if not name:
            continue
        try:
            out[name] = int(prio or 0)
        except ValueError:
            raise SlurmError(f"unexpected sacctmgr qos line: {line!r}") from None
    return out


def _split_gres(text: str) -> list[str]:
    """'gpu:a100:4(S:0-1),shard:32' -> ['gpu:a100:4(S:0-1)', 'shard:32'] (commas inside () kept)."""
    parts, depth, cur = [], 0, []
    for ch in text:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def parse_sinfo_gpus(text: str) -> int:
    """GPUs on the nodes that take jobs, from ``sinfo -h -N -o SINFO_NODE_FORMAT`` (a node in
    several partitions is listed once per partition and counted once)."""
    seen: dict[str, int] = {}
    for line in text.splitlines():
        cols = line.split("|")
        if len(cols) < 3 or not cols[0].strip():
            continue
        node, gres, state = cols[0].strip(), cols[1], cols[2].strip().lower().rstrip("*~#!%$@^-")
        if state.startswith(_UNAVAILABLE_NODE_STATES):
            seen.setdefault(node, 0)
            continue
        gpus = 0
        for entry in _split_gres("" if gres.strip() == "(null)" else gres):
            fields = entry.split("(", 1)[0].split(":")
            if fields[0] == "gpu" and len(fields) > 1 and fields[-1].isdigit():
                gpus += int(fields[-1])
        seen[node] = gpus
    return sum(seen.values())


class CliSlurm:
    """Slurm through its command-line tools (every call bounded by ``timeout_s``)."""

    def __init__(self, timeout_s: float = 5.0, env: dict[str, str] | None = None):
        self.timeout_s = timeout_s
        self.env = env

    def _run(self, argv: list[str]) -> str:
        try:
            res = subprocess.run(argv, capture_output=True, text=True, timeout=self.timeout_s, env=self.env)
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
        argv = ["sacct", "--json", "-X", "--allusers"]
        if job_ids:
            argv += ["-j", ",".join(str(j) for j in job_ids)]
        if start:
            argv += ["-S", start]
        if end:
            argv += ["-E", end]
        return parse_sacct_json(self._run(argv))

    def pending_jobs(self) -> list[PendingJob]:
        return parse_squeue_pending(self._run(["squeue", "-h", "-a", "-t", "PENDING", "-O", SQUEUE_PENDING_FORMAT]))

    def cluster_gpus(self) -> int:
        return parse_sinfo_gpus(self._run(["sinfo", "-h", "-N", "-o", SINFO_NODE_FORMAT]))

    def qos_priorities(self) -> dict[str, int]:
        return parse_qos_priorities(self._run(["sacctmgr", "-n", "-P", "show", "qos", "format=name,priority"]))

    def update_pending_job(self, job_id: int, tres_per_node: str, admin_comment: str) -> None:
        """Rewrite a pending job's GPU request and decision record (root / SlurmUser only).
        Slurm refuses once the job has started; that surfaces as ``SlurmError``."""
        self._run(["scontrol", "update", f"JobId={job_id}", f"TresPerNode={tres_per_node}",
                   f"AdminComment={admin_comment}"])

    def set_admin_comment(self, job_id: int, text: str) -> None:
        """Set AdminComment on a running job, or on a finished one through accounting."""
        try:
            self._run(["scontrol", "update", f"JobId={job_id}", f"AdminComment={text}"])
        except SlurmError:
            self._run(["sacctmgr", "-i", "modify", "job", "where", f"jobid={job_id}", "set", f"AdminComment={text}"])


# ----------------------------------------------------------------------------- pyslurm
class PyslurmSlurm:
    """Slurm through pyslurm (only where pyslurm's version matches the cluster)."""

    def __init__(self, timeout_s: float = 5.0) -> None:
        import pyslurm  # noqa: F401  (import error -> caller falls back)

        self._pyslurm = pyslurm
        # The queue snapshot reads squeue/sinfo, which every Slurm version has.
        self._cli = CliSlurm(timeout_s)

    def pending_jobs(self) -> list[PendingJob]:
        return self._cli.pending_jobs()

    def cluster_gpus(self) -> int:
        return self._cli.cluster_gpus()

    def qos_priorities(self) -> dict[str, int]:
        return self._cli.qos_priorities()

    def update_pending_job(self, job_id: int, tres_per_node: str, admin_comment: str) -> None:
        self._cli.update_pending_job(job_id, tres_per_node, admin_comment)

    def job_admin_comment(self, job_id: int) -> str | None:
        try:
            return self._pyslurm.Job.load(job_id).admin_comment
        except Exception:  # pyslurm raises RPCError for unknown/finished jobs
            jobs = self.accounting_jobs(job_ids=[job_id])
            return jobs[0].admin_comment if jobs else None

    def accounting_jobs(self, job_ids: Sequence[int] = (), start: str = "", end: str = "") -> list[AccountingJob]:
        flt = self._pyslurm.db.JobFilter(ids=list(job_ids) or None, start_time=start or None, end_time=end or None)
        out = []
        for j in self._pyslurm.db.Jobs.load(flt).values():
            out.append(AccountingJob(
                job_id=j.id, user=j.user_name or "", account=j.account or "", partition=j.partition or "",
                job_name=j.name or "", state=j.state or "", exit_code=int(j.exit_code or 0),
                submit_time=int(j.submit_time or 0), start_time=int(j.start_time or 0), end_time=int(j.end_time or 0),
                admin_comment=j.admin_comment or "", tres_alloc=str(j.allocated_tres or ""),
                tres_req=str(j.requested_tres or "")))
        return out

    def set_admin_comment(self, job_id: int, text: str) -> None:
        self._pyslurm.db.Job(job_id).modify(self._pyslurm.db.Job(admin_comment=text))


def slurm_version(timeout_s: float = 5.0) -> tuple[int, int] | None:
    """(major, minor) of the installed Slurm, from ``scontrol --version`` ('slurm 22.05.8')."""
    try:
        out = subprocess.run(["scontrol", "--version"], capture_output=True, text=True, timeout=timeout_s).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_version(out)


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


def open_slurm(wanted: SlurmBackend, timeout_s: float) -> SlurmAccess:
    try:
        import importlib.metadata

        pv: str | None = importlib.metadata.version("pyslurm")
    except Exception:
        pv = None
    choice = choose_backend(wanted, slurm_version(timeout_s), pv)
    if choice is SlurmBackend.PYSLURM:
        try:
            return PyslurmSlurm(timeout_s)
        except ImportError as exc:
            if wanted is SlurmBackend.PYSLURM:
                raise SlurmError(f"slurm_backend=pyslurm but pyslurm does not import: {exc}") from None
    log.info("slurm access: command-line tools (pyslurm %s)", pv or "not installed")
    return CliSlurm(timeout_s=timeout_s)
