"""Pure parsers of the Slurm command-line tools' output, tested on real-shaped text (22.05, 24.11
and 26.05 shapes; SLURM_VERSIONS.md). ``policy_service.slurm.slurm`` runs the tools."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Mapping


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


# ----------------------------------------------------------------------------- parsers
def scontrol_field(oneliner: str, key: str) -> str | None:
    """Value of ``key`` in ``scontrol show job -o`` output. Values may contain spaces (comments),
    so a value runs until the next `` Key=`` of a known scontrol key shape."""
    m = re.search(rf"(?:^|\s){re.escape(key)}=(.*?)(?=\s[A-Z][A-Za-z:/]*=|$)", oneliner.strip())
    return None if m is None else m.group(1).strip()  # 24.11 leaves a space before StdErr=


_GPU_GRES = ("gpu", "shard", "mps")
_GRES_DETAIL_RE = re.compile(r"(?:^|\s)GRES=(\S+)")


def _index_list(text: str) -> list[int]:
    """'0-1,3' -> [0, 1, 3]."""
    out: list[int] = []
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def gres_detail_indices(value: str) -> tuple[int, ...]:
    """GPU indices in one ``GRES=`` value of ``scontrol show job -d``: ``gpu:1(IDX:0)``,
    ``gpu:a100:2(IDX:0-1)``, or on 24.11+ ``shard:8(0/8,8/8,0/8,0/8)`` (per GPU: this job's
    count / the GPU's total; a GPU is the job's where its count is above 0)."""
    found: set[int] = set()
    for entry in _split_gres(value):
        name, _, detail = entry.partition("(")
        if name.split(":")[0] not in _GPU_GRES or not detail.endswith(")"):
            continue
        detail = detail[:-1]
        try:
            if detail.startswith("IDX:"):
                found.update(_index_list(detail[len("IDX:"):]))
            elif "/" in detail:
                found.update(i for i, used_total in enumerate(detail.split(","))
                             if int(used_total.partition("/")[0] or 0) > 0)
        except ValueError:
            raise SlurmError(f"unexpected GRES detail {entry!r}") from None
    return tuple(sorted(found))


def job_gpu_indices(text: str) -> tuple[int, ...]:
    """The GPU indices a job holds, from ``scontrol show job -d`` (every node's ``GRES=``;
    ``JOB_GRES=`` is the job's total and names no index)."""
    found: set[int] = set()
    for value in _GRES_DETAIL_RE.findall(text):
        found.update(gres_detail_indices(value))
    return tuple(sorted(found))


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


def _number(value: Any) -> int:
    """A plain number (22.05) or data_parser v0.0.40+'s {set, infinite, number}; unset -> 0."""
    if isinstance(value, dict):
        if value.get("set") is False or value.get("infinite"):
            return 0
        value = value.get("number", 0)
    return int(value or 0)


def _exit_code(value: Any) -> int:
    if isinstance(value, dict):  # {"status": ..., "return_code": 0 or {"set", "infinite", "number"}}
        return _number(value.get("return_code", 0))
    return int(value or 0)


def _time(value: Any) -> int:
    return _number(value)


def _sacct_jobs(text: str) -> list[dict]:
    """The job records of ``sacct --json`` output, whichever release printed it."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SlurmError(f"sacct --json printed invalid JSON: {exc}") from None
    jobs = data.get("jobs", []) if isinstance(data, dict) else []
    return [j for j in jobs if isinstance(j, dict)]


def _sacct_states(job: dict) -> list[str]:
    """A record's state(s): 22.05 a string, 24.11+ a list (state.current)."""
    state = job.get("state") or {}
    current = state.get("current", "") if isinstance(state, dict) else str(state)
    if isinstance(current, list):
        return [str(c) for c in current]
    return [current] if current else []


def parse_sacct_json(text: str) -> list[AccountingJob]:
    """Parse ``sacct --json``: 22.05 (state.current a string, plain numbers) and data_parser
    v0.0.42 (24.11) to v0.0.45 (26.05): state.current a list, exit_code.return_code and times
    as {set, infinite, number} or plain, tres lists of {type, name, count}."""
    out = []
    for j in _sacct_jobs(text):
        comment = j.get("comment") or {}
        tres = j.get("tres") or {}
        time = j.get("time") or {}
        state_text = ",".join(_sacct_states(j))
        out.append(AccountingJob(
            job_id=int(j.get("job_id", 0)), user=j.get("user", "") or "", account=j.get("account", "") or "",
            partition=j.get("partition", "") or "", job_name=j.get("name", "") or "", state=state_text,
            exit_code=_exit_code(j.get("exit_code")), submit_time=_time(time.get("submission")),
            start_time=_time(time.get("start")), end_time=_time(time.get("end")),
            admin_comment=(comment.get("administrator") if isinstance(comment, dict) else "") or "",
            tres_alloc=_tres_text(tres.get("allocated", "")), tres_req=_tres_text(tres.get("requested", "")),
        ))
    return out


# ----------------------------------------------------------------------------- squeue, sacctmgr, sinfo
SQUEUE_PENDING_FORMAT = ("JobID:|,tres-per-node:|,tres-per-job:|,tres-per-task:|,NumNodes:|,NumTasks:|,QOS:|,"
                         "Reason:")
SINFO_NODE_FORMAT = "%N|%G|%T"
# Node states (sinfo %T, lower case, without the "*"/"~"/"#" suffixes) that take no new jobs.
_UNAVAILABLE_NODE_STATES = ("down", "drain", "fail", "future", "inval", "powered_down", "power_down", "unknown")
# A node the controller in control shows as UNKNOWN has not registered with it since it started (a
# slurmctld restart, or a reconfigure, which restarts slurmctld on 23.11+): measured on 24.11 and
# 26.05, sinfo already shows the node's typed shards then, and slurmctld refuses typed shard jobs
# ("Requested node configuration is not available") until the node registers.
_UNREGISTERED_NODE_STATE = "unknown"


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


@dataclass(frozen=True)
class NodeGres:
    """What one ``sinfo -h -N -o SINFO_NODE_FORMAT`` says of the nodes that take jobs: their GPUs
    and, per node, the shards the controller reports (LiveShards.by_node)."""

    gpus: int
    shards: Mapping[str, Mapping[str, int]]
    unregistered: frozenset[str] = frozenset()  # nodes in State=UNKNOWN (LiveShards.unregistered)


def parse_sinfo_nodes(text: str) -> NodeGres:
    """GPUs and shards of the nodes that take jobs (a node in several partitions is listed once per
    partition and counted once; a node down, drained, ... counts no GPU and lists no shards)."""
    gpus: dict[str, int] = {}
    shards: dict[str, dict[str, int]] = {}
    unregistered: set[str] = set()
    for line in text.splitlines():
        cols = line.split("|")
        if len(cols) < 3 or not cols[0].strip():
            continue
        node, gres, state = cols[0].strip(), cols[1], cols[2].strip().lower().rstrip("*~#!%$@^-")
        if state.startswith(_UNAVAILABLE_NODE_STATES):
            gpus.setdefault(node, 0)
            if state.startswith(_UNREGISTERED_NODE_STATE):
                unregistered.add(node)
            continue
        n, by_type = 0, {}
        for entry in _split_gres("" if gres.strip() == "(null)" else gres):
            fields = entry.split("(", 1)[0].split(":")
            if len(fields) < 2 or not fields[-1].isdigit():
                continue
            if fields[0] == "gpu":
                n += int(fields[-1])
            elif fields[0] == "shard":
                kind = fields[1].lower() if len(fields) > 2 else ""
                by_type[kind] = by_type.get(kind, 0) + int(fields[-1])
        gpus[node] = n
        if by_type:
            shards[node] = by_type
    return NodeGres(sum(gpus.values()), shards, frozenset(unregistered))


def parse_sinfo_gpus(text: str) -> int:
    """GPUs on the nodes that take jobs, from ``sinfo -h -N -o SINFO_NODE_FORMAT``."""
    return parse_sinfo_nodes(text).gpus


# ----------------------------------------------------------------------------- job instances
# A job id repeats after a state reset (and a requeue gives the job a new submit time): one run of
# a job is named by its cluster, id and submit time, or by its SLUID (25.11+) when the event has one.
# Read in bulk for many ids: live jobs from squeue, ended ones from sacct.
@dataclass(frozen=True)
class JobInstance:
    """One instance of a job id as Slurm reports it."""

    job_id: int
    cluster: str
    submit_time: int  # Unix seconds; 0: unknown
    start_time: int  # 0: not started (or unknown)
    end_time: int  # 0: not ended
    admin_comment: str
    state: str = ""
    sluid: str = ""  # squeue on 25.11+; sacct's JSON has none for jobs
    source: str = ""  # "squeue" or "sacct"

    @property
    def key(self) -> str:
        return instance_key(self.cluster, self.job_id, self.submit_time)


def instance_key(cluster: str, job_id: int, submit_time: int) -> str:
    """'<cluster>/<job id>/<submit time>': what tells two jobs of one id apart."""
    return f"{cluster}/{job_id}/{submit_time}"


def sluid_key(sluid: str) -> str:
    return f"sluid/{sluid}"


# States in which a job's end time is real (squeue prints an expected one before).
ENDED_STATES = frozenset({"COMPLETING", "COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
                          "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY", "REQUEUED", "REVOKED", "SPECIAL_EXIT"})
# squeue -O fields, "|"-separated (width 0: never cut). admin_comment last: it may hold anything.
# "JobId" is the raw id on every release (JobArrayId prints 12_3). SLUID exists since 25.11.
_SQUEUE_INSTANCE_FIELDS = ("JobId", "Cluster", "SubmitTime", "StartTime", "EndTime", "State")


def squeue_instance_format(with_sluid: bool) -> str:
    fields = _SQUEUE_INSTANCE_FIELDS + (("SLUID",) if with_sluid else ()) + ("admin_comment",)
    return ",".join(f"{f}:|" for f in fields[:-1]) + f",{fields[-1]}:"


# The environment squeue runs with: times as Unix seconds (SLURM_TIME_FORMAT is a strftime format).
SQUEUE_TIME_ENV = {"SLURM_TIME_FORMAT": "%s"}


def _clock_time(text: str) -> int:
    """A squeue time: Unix seconds (SQUEUE_TIME_ENV), or the default local '2026-12-03T07:56:33';
    'N/A', 'Unknown', 'None', 'NONE' -> 0."""
    import time

    text = text.strip()
    if text.isdigit():
        return int(text)
    try:
        return int(time.mktime(time.strptime(text, "%Y-%m-%dT%H:%M:%S")))
    except (ValueError, OverflowError):
        return 0


def parse_squeue_instances(text: str, with_sluid: bool) -> list[JobInstance]:
    """Rows of ``squeue -h -a -t all -j <ids> -O squeue_instance_format(with_sluid)``."""
    width = len(_SQUEUE_INSTANCE_FIELDS) + (1 if with_sluid else 0) + 1
    out = []
    for line in text.splitlines():
        if not line.strip():
            continue
        cols = line.split("|", width - 1)
        if len(cols) < width or not cols[0].strip().isdigit():
            raise SlurmError(f"unexpected squeue line: {line!r}")
        state = cols[5].strip().split()[0] if cols[5].strip() else ""
        ended = state in ENDED_STATES
        comment = cols[-1].strip()
        out.append(JobInstance(
            job_id=int(cols[0]), cluster=_na(cols[1]), submit_time=_clock_time(cols[2]),
            start_time=_clock_time(cols[3]) if state != "PENDING" else 0,
            end_time=_clock_time(cols[4]) if ended else 0, admin_comment="" if comment == "(null)" else comment,
            state=state, sluid=_na(cols[6]) if with_sluid else "", source="squeue"))
    return out


def parse_sacct_instances(text: str) -> list[JobInstance]:
    """``sacct --json[=v0.0.4X] -X -D -j <ids>`` (every record of each id: -D keeps the jobs of an
    id that a state reset made repeat): 22.05 plain numbers, 24.11+ {set, infinite, number}."""
    out = []
    for j in _sacct_jobs(text):
        comment = j.get("comment") or {}
        times = j.get("time") or {}
        current = (_sacct_states(j) or [""])[0]
        out.append(JobInstance(
            job_id=int(j.get("job_id", 0)), cluster=j.get("cluster", "") or "",
            submit_time=_time(times.get("submission")), start_time=_time(times.get("start")),
            end_time=_time(times.get("end")),
            admin_comment=(comment.get("administrator") if isinstance(comment, dict) else "") or "",
            state=current or "", source="sacct"))
    return out


_DECISION_ID_RE = re.compile(r"swapaware:v1 id=([0-9a-f]{8,32})\b")


def decision_ids_in(text: str) -> set[str]:
    """The swapaware decision ids named in AdminComment text (one job per line, any release)."""
    return set(_DECISION_ID_RE.findall(text))
