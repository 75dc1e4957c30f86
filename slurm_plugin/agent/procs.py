"""What /proc and the kernel log say about a GPU process: the node agent's readers of
``/proc/<pid>/cgroup``, ``/proc/<pid>/environ``, ``/proc/<pid>/status``, ``/proc/<pid>/stat`` and
``/dev/kmsg`` (see slurm_plugin/agent/sampler.py for how they are used). ``ProcFacts`` holds what
they say about one process; which job it is charged to is decided from those facts by
``slurm_plugin.agent.attribution`` (the kernel's word only: the environment is the user's). The parsers
are pure; the readers take the /proc root as a parameter (tests give a mirror)."""
from __future__ import annotations

import contextlib
import enum
import errno
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

from slurm_plugin.gpu.nvml import PROC_ROOT

MAX_SLUID_CHARS = 255  # a path component's limit
MAX_KERNEL_LINES_PER_TICK = 1000


class EvidenceKind(enum.Enum):
    JOB_NEAR_CAPACITY = "job_near_capacity"
    DEVICE_FULL = "device_full"
    XID = "xid"
    HOST_OOM = "host_oom"


@dataclass(frozen=True)
class ProcFacts:
    """What /proc says about one process. ``cgroup_job``: the job its cgroup path names (the
    kernel's word: a user cannot move a process out of its job's cgroup); ``env_job``: the
    ``SLURM_JOB_ID`` of its environment (the user's word: anyone can set it); ``uid``: its owner
    (real and effective uid, when they agree; None when they differ or cannot be read)."""

    cgroup_job: int | None
    env_job: int | None
    uid: int | None


@dataclass(frozen=True)
class KernelEvent:
    kind: EvidenceKind  # XID or HOST_OOM
    pid: int | None
    job_id: int | None  # from a memory-cgroup path in the line
    code: int | None  # Xid number
    text: str


# --------------------------------------------------------------------------- parsers

_CGROUP_JOB = re.compile(r"(?:^|/)job_(\d+)(?:/|$)")
_XID = re.compile(r"NVRM: Xid \(([^)]*)\): (\d+)")
_PID = re.compile(r"\bpid=(\d+)")
_KILLED = re.compile(r"Killed process (\d+)")
_ANY_JOB = re.compile(r"/job_(\d+)(?:/|,|\s|$)")
_MEMCG_PATH = re.compile(r"\b(?:oom|task)_memcg=([^,\s]+)")
_ENV_JOB_ID = re.compile(rb"(?:^|\0)SLURM_JOB_ID=(\d+)(?:\0|$)")
_ENV_JOBID = re.compile(rb"(?:^|\0)SLURM_JOBID=(\d+)(?:\0|$)")


def usable_sluid(value: str) -> str | None:
    """``value`` stripped when it can be a cgroup path component (the only use made of it), else None.

    Nothing else is assumed about a SLUID's format."""
    text = value.strip()
    if not text or len(text) > MAX_SLUID_CHARS or text in (".", "..") or any(c in text for c in "/\0\n"):
        return None
    return text


def job_id_from_cgroup_path(path: str, sluids: Mapping[str, int] | None = None) -> int | None:
    """Slurm job of one cgroup path: a ``job_<id>`` component, else a component equal to an
    announced SLUID (``sluids``: SLUID -> job id); None when neither is there."""
    match = _CGROUP_JOB.search(path)
    if match:
        return int(match.group(1))
    if sluids:
        for part in path.split("/"):
            if part in sluids:
                return sluids[part]
    return None


def job_id_from_cgroup(text: str, sluids: Mapping[str, int] | None = None) -> int | None:
    """Slurm job id from ``/proc/<pid>/cgroup`` text (v1 or v2), or None. ``sluids`` maps the
    SLUIDs of announced jobs to their ids (cgroup v2 on Slurm 26.05 names job directories by SLUID)."""
    for line in text.splitlines():
        job_id = job_id_from_cgroup_path(line.split(":", 2)[-1], sluids)
        if job_id is not None:
            return job_id
    return None


def job_id_from_memcg(text: str, sluids: Mapping[str, int]) -> int | None:
    """Job of an OOM-killer line by the SLUID in its ``oom_memcg=``/``task_memcg=`` paths, or None.
    (``job_<id>`` paths are read by ``parse_kernel_line``.)"""
    for match in _MEMCG_PATH.finditer(text):
        job_id = job_id_from_cgroup_path(match.group(1), sluids)
        if job_id is not None:
            return job_id
    return None


def job_id_from_environ(data: bytes) -> int | None:
    """``SLURM_JOB_ID`` (or the old ``SLURM_JOBID``) from ``/proc/<pid>/environ`` bytes, or None."""
    for pattern in (_ENV_JOB_ID, _ENV_JOBID):
        match = pattern.search(data)
        if match:
            return int(match.group(1))
    return None


def uid_from_status(text: str) -> int | None:
    """The owner of a process from ``/proc/<pid>/status``: its real uid when the effective uid is
    the same (``Uid:`` real, effective, saved, filesystem), else None (a process running with two
    identities, e.g. a set-uid program, is nobody's for the environment's purposes)."""
    for line in text.splitlines():
        if line.startswith("Uid:"):
            ids = line[4:].split()
            if len(ids) >= 2 and ids[0].isdigit() and ids[0] == ids[1]:
                return int(ids[0])
            return None
    return None


def start_ticks_from_stat(text: str) -> int | None:
    """Process start time (clock ticks since boot, field 22) from ``/proc/<pid>/stat``; tells pids apart."""
    fields = text.rpartition(")")[2].split()
    return int(fields[19]) if len(fields) > 19 and fields[19].isdigit() else None


def parse_kernel_line(line: str) -> KernelEvent | None:
    """An Xid or OOM-killer event from one kernel log line (dmesg or /dev/kmsg form), or None."""
    text = line.split(";", 1)[1] if re.match(r"^\d+,\d+,\d+,[^;]*;", line) else line
    text = text.strip()
    xid = _XID.search(text)
    if xid:
        pid = _PID.search(text)
        return KernelEvent(EvidenceKind.XID, int(pid.group(1)) if pid else None, None, int(xid.group(2)), text)
    if "Killed process" in text or ("oom-kill:" in text and "oom_memcg=" in text):
        pid = _KILLED.search(text) or _PID.search(text)
        job = _ANY_JOB.search(text)
        return KernelEvent(EvidenceKind.HOST_OOM, int(pid.group(1)) if pid else None,
                           int(job.group(1)) if job else None, None, text)
    return None


# =========================================================================== shell


def cgroup_job_id(pid: int, proc_root: Path = PROC_ROOT, sluids: Mapping[str, int] | None = None) -> int | None:
    """The job ``pid``'s cgroup names (``job_<id>`` or an announced SLUID), or None. Never the
    environment: this is the kernel's word alone."""
    try:
        return job_id_from_cgroup((proc_root / str(pid) / "cgroup").read_text(), sluids)
    except OSError:
        return None


def process_uid(pid: int, proc_root: Path = PROC_ROOT) -> int | None:
    """``pid``'s owner: ``uid_from_status`` of ``/proc/<pid>/status``, else the owner of
    ``/proc/<pid>`` (the kernel gives that directory the effective uid); None when gone."""
    try:
        return uid_from_status((proc_root / str(pid) / "status").read_text())
    except OSError:
        pass
    try:
        return (proc_root / str(pid)).stat().st_uid
    except OSError:
        return None


def read_proc_facts(pid: int, proc_root: Path = PROC_ROOT, sluids: Mapping[str, int] | None = None) -> ProcFacts:
    """``ProcFacts`` of ``pid``; a file that cannot be read says nothing (None)."""
    env_job = None
    with contextlib.suppress(OSError):
        env_job = job_id_from_environ((proc_root / str(pid) / "environ").read_bytes())
    return ProcFacts(cgroup_job_id(pid, proc_root, sluids), env_job, process_uid(pid, proc_root))


class ProcFactsCache:
    """pid -> ``ProcFacts``, remembered while the same process (pid + start time) is on a GPU.

    A process's cgroup, environment and owner do not change in ways that matter here, so each GPU
    process costs one ``/proc/<pid>/stat`` read per sample instead of the cgroup, environ and
    status reads. Holds only the pids of the last sample. What a cgroup path means depends on the
    announced SLUIDs: when they change (a job started or stopped) every pid is read again, so a
    process seen before its job was announced is not left unattributed.
    """

    def __init__(self, proc_root: Path = PROC_ROOT) -> None:
        self._proc_root = proc_root
        self._known: dict[int, tuple[int, ProcFacts]] = {}
        self._sluids: dict[str, int] = {}

    def resolve(self, pids: Iterable[int], sluids: Mapping[str, int] | None = None) -> dict[int, ProcFacts]:
        sluids = dict(sluids or {})
        if sluids != self._sluids:
            self._known, self._sluids = {}, sluids
        known: dict[int, tuple[int, ProcFacts]] = {}
        out: dict[int, ProcFacts] = {}
        for pid in pids:
            start = self._start_ticks(pid)
            cached = self._known.get(pid)
            if start is not None and cached is not None and cached[0] == start:
                facts = cached[1]
            else:
                facts = read_proc_facts(pid, self._proc_root, sluids)
            if start is not None:
                known[pid] = (start, facts)
            out[pid] = facts
        self._known = known
        return out

    def _start_ticks(self, pid: int) -> int | None:
        try:
            return start_ticks_from_stat((self._proc_root / str(pid) / "stat").read_text())
        except OSError:
            return None


class KernelLogTail:
    """Non-blocking reader of new kernel log records (``/dev/kmsg``, or a plain file in tests)."""

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        os.lseek(self._fd, 0, os.SEEK_END)
        self._partial = b""

    def read_lines(self, max_lines: int = MAX_KERNEL_LINES_PER_TICK) -> list[str]:
        lines: list[str] = []
        while len(lines) < max_lines:
            try:
                chunk = os.read(self._fd, 8192)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # /dev/kmsg: records overwritten; continue
                    continue
                raise
            if not chunk:
                break
            *done, self._partial = (self._partial + chunk).split(b"\n")
            lines += [d.decode("utf-8", "replace") for d in done]
        return lines

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)
