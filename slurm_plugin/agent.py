"""Per-node agent: samples GPU memory for the jobs the prolog and epilog announce.

Slurm kills whatever a prolog leaves running, so sampling lives in this daemon. Protocol:
JSON lines over the Unix socket ``agent.socket_path`` (mode 0600, so only root, i.e. the
prolog/epilog, can talk to it); one request line, one response line, then close::

    {"op":"start","job_id":N,"gpus":[0,2],"uid":U,"sluid":S}  -> {"ok":true}   ("sluid" optional)
    {"op":"stop","job_id":N}                       -> {"ok":true,"telemetry":{...}}
    {"op":"status"}                                -> {"ok":true,"source":...,"jobs":[...]}
    anything malformed                             -> {"ok":false,"error":"..."}

``gpus`` are NVML indices; the prolog passes the numbers in ``SLURM_JOB_GPUS`` (the N of the
gres.conf ``File=/dev/nvidiaN``), which is the same assumption ``swapaware gres-conf`` makes
(NVML index == device minor number; true unless the driver enumerates otherwise).

Every ``sample_period_s`` a thread reads each device's processes and attributes a process to a
job by its ``/proc/<pid>/cgroup`` path (Slurm's cgroup plugins): a ``job_<id>`` component, or a
component equal to the SLUID an announced job came with (Slurm 26.05 with cgroup v2 names job
directories ``.../slurmstepd.scope/<SLUID>/`` unless ``CgroupJobIdPaths=yes``; the prolog sees
``SLURM_JOB_SLUID`` from 25.11 on). SLUIDs are opaque: only a whole path component equal to an
announced one counts. Failing both, by ``SLURM_JOB_ID`` in ``/proc/<pid>/environ`` (readable as
root; can be forged by a user who sets it by hand, the cgroup cannot). Per job and GPU it keeps
the peak and the time-weighted mean of the job's bytes (a step function: each sample holds until
the next, over [first sample, last sample]) and the device utilisation (device-wide, not per job).

``oom_suspected`` is a heuristic, with its evidence listed:
  * ``job_near_capacity``: the job's processes held >= 98 % of a device's memory at a sample;
  * ``device_full``: the device was >= 98 % used (all processes) while the job held memory there;
  * ``xid``: an ``NVRM: Xid`` kernel line naming one of the job's pids; only Xid 31 (GPU MMU
    fault, which is how a failed page-in under oversubscription shows, but also plain bad
    pointers) sets ``oom_suspected``, other Xids are listed only.
  ``host_oom`` (the kernel OOM killer hit one of the job's pids or its memory cgroup) is listed
  but does not set it: that is host memory. A CUDA out-of-memory error itself leaves no trace
  the driver reports, and an allocation that failed between two samples is invisible here, so
  the epilog should combine this with the job's exit code. Xid lines are read from
  ``/dev/kmsg`` when it is readable; Xids without a pid (old drivers) are not attributed.

The pure core (``Series``, ``JobTrack``, ``apply_tick``, ``summarize``; the /proc and kernel-log
parsers live in ``slurm_plugin.procs``) has no I/O;
``Agent`` adds the locks, clocks and /proc reads; ``AgentServer`` the socket and the thread.
Jobs never stopped are forgotten after ``MAX_JOB_AGE_S``; at most ``MAX_JOBS`` are tracked.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import logging.handlers
import os
import signal
import socket
import socketserver
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from policy_service.config import AgentConfig, ConfigError, load_config
from slurm_plugin.nvml import PROC_ROOT, GpuTelemetry, ProcessUsage, TelemetryError, open_telemetry
from slurm_plugin.procs import (  # noqa: F401  (part of this module's API)
    EvidenceKind,
    KernelEvent,
    KernelLogTail,
    MAX_KERNEL_LINES_PER_TICK,
    MAX_SLUID_CHARS,
    PidJobCache,
    job_id_from_cgroup,
    job_id_from_cgroup_path,
    job_id_from_environ,
    job_id_from_memcg,
    parse_kernel_line,
    resolve_job_id,
    start_ticks_from_stat,
    usable_sluid,
)

log = logging.getLogger("swapaware.agent")

MAX_JOB_AGE_S = 7 * 24 * 3600.0
MAX_JOBS = 4096
MAX_REQUEST_BYTES = 64 * 1024
CONNECTION_TIMEOUT_S = 5.0
NEAR_CAPACITY_FRAC = 0.98
MAX_EVIDENCE = 16
MAX_PIDS_PER_JOB = 256
DEFAULT_KERNEL_LOG = Path("/dev/kmsg")


# =========================================================================== pure core


@dataclass(frozen=True)
class Series:
    """Running peak and time-weighted mean of a step function sampled at increasing times."""

    samples: int = 0
    first_t_s: float = 0.0
    last_t_s: float = 0.0
    last_value: float = 0.0
    area: float = 0.0  # integral over [first_t_s, last_t_s], each value held until the next
    peak: float = 0.0

    def add(self, t_s: float, value: float) -> "Series":
        if self.samples == 0:
            return Series(1, t_s, t_s, value, 0.0, value)
        dt_s = max(0.0, t_s - self.last_t_s)
        return Series(
            self.samples + 1, self.first_t_s, max(t_s, self.last_t_s), value,
            self.area + self.last_value * dt_s, max(self.peak, value),
        )

    def mean(self) -> float | None:
        if self.samples == 0:
            return None
        span_s = self.last_t_s - self.first_t_s
        return self.area / span_s if span_s > 0 else self.last_value



@dataclass(frozen=True)
class Evidence:
    kind: EvidenceKind
    gpu: int | None
    detail: str
    suggests_oom: bool


@dataclass(frozen=True)
class GpuObservation:
    """One device at one sample."""

    index: int
    total_bytes: int
    used_bytes: int
    util_pct: float | None
    procs: tuple[ProcessUsage, ...]
    name: str = ""
    uuid: str = ""


@dataclass(frozen=True)
class GpuTrack:
    index: int
    name: str
    uuid: str
    total_bytes: int
    used: Series = Series()
    util: Series = Series()


@dataclass(frozen=True)
class JobTrack:
    job_id: int
    uid: int | None
    gpus: tuple[int, ...]
    started_at_s: float  # wall clock, for the report
    started_mono_s: float  # monotonic, for expiry and relative times
    gpu_tracks: tuple[GpuTrack, ...] = ()
    total: Series = Series()
    util: Series = Series()
    pids: frozenset[int] = frozenset()
    evidence: tuple[Evidence, ...] = ()
    per_process_memory_reported: bool = True
    sluid: str | None = None  # Slurm's unique job id (25.11+), the cgroup v2 directory name on 26.05



def new_job(job_id: int, gpus: Sequence[int], uid: int | None, wall_s: float, mono_s: float,
            sluid: str | None = None) -> JobTrack:
    return JobTrack(job_id, uid, tuple(sorted(set(gpus))), wall_s, mono_s, sluid=sluid)


def sluid_map(jobs: Iterable[JobTrack]) -> dict[str, int]:
    """SLUID -> job id of the tracked jobs that were announced with one."""
    return {j.sluid: j.job_id for j in jobs if j.sluid}


def add_evidence(job: JobTrack, item: Evidence) -> JobTrack:
    """Append ``item`` unless one of the same kind and GPU is there or the list is full."""
    seen = any(e.kind is item.kind and e.gpu == item.gpu and e.kind is not EvidenceKind.XID for e in job.evidence)
    if seen or len(job.evidence) >= MAX_EVIDENCE or item in job.evidence:
        return job
    return dataclasses.replace(job, evidence=job.evidence + (item,))


def _capacity_evidence(obs: GpuObservation, job_bytes: int, rel_s: float) -> list[Evidence]:
    limit_bytes = NEAR_CAPACITY_FRAC * obs.total_bytes
    if job_bytes <= 0 or obs.total_bytes <= 0:
        return []
    if job_bytes >= limit_bytes:
        detail = f"job held {job_bytes} of {obs.total_bytes} bytes on GPU {obs.index} at +{rel_s:.1f}s"
        return [Evidence(EvidenceKind.JOB_NEAR_CAPACITY, obs.index, detail, True)]
    if obs.used_bytes >= limit_bytes:
        detail = (f"GPU {obs.index} full: {obs.used_bytes} of {obs.total_bytes} bytes used by all processes, "
                  f"job held {job_bytes}, at +{rel_s:.1f}s")
        return [Evidence(EvidenceKind.DEVICE_FULL, obs.index, detail, True)]
    return []


def _gpu_track(job: JobTrack, obs: GpuObservation) -> GpuTrack:
    existing = next((g for g in job.gpu_tracks if g.index == obs.index), None)
    return existing or GpuTrack(obs.index, obs.name, obs.uuid, obs.total_bytes)


def apply_tick(job: JobTrack, t_s: float, observations: Sequence[GpuObservation],
               pid_jobs: Mapping[int, int | None]) -> JobTrack:
    """Fold one sample of all devices into ``job``: its GPUs plus any GPU its pids appear on."""
    tracks = {g.index: g for g in job.gpu_tracks}
    total_bytes, utils, pids, reported = 0, [], set(job.pids), job.per_process_memory_reported
    evidence: list[Evidence] = []
    for obs in observations:
        mine = [p for p in obs.procs if pid_jobs.get(p.pid) == job.job_id]
        if obs.index not in job.gpus and not mine:
            continue
        job_bytes = sum(p.used_bytes or 0 for p in mine)
        reported = reported and all(p.used_bytes is not None for p in mine)
        pids.update(p.pid for p in mine)
        track = _gpu_track(job, obs)
        util = track.util.add(t_s, obs.util_pct) if obs.util_pct is not None else track.util
        tracks[obs.index] = dataclasses.replace(track, used=track.used.add(t_s, job_bytes), util=util)
        total_bytes += job_bytes
        if obs.util_pct is not None and obs.index in job.gpus:
            utils.append(obs.util_pct)
        evidence += _capacity_evidence(obs, job_bytes, t_s - job.started_mono_s)
    if len(pids) > MAX_PIDS_PER_JOB:
        pids = set(sorted(pids)[-MAX_PIDS_PER_JOB:])
    job = dataclasses.replace(
        job, gpu_tracks=tuple(tracks[i] for i in sorted(tracks)), total=job.total.add(t_s, total_bytes),
        util=job.util.add(t_s, sum(utils) / len(utils)) if utils else job.util,
        pids=frozenset(pids), per_process_memory_reported=reported,
    )
    for item in evidence:
        job = add_evidence(job, item)
    return job


def apply_kernel_event(job: JobTrack, event: KernelEvent) -> JobTrack:
    """Attach ``event`` to ``job`` when it names one of the job's pids or its cgroup."""
    if not (event.job_id == job.job_id or (event.pid is not None and event.pid in job.pids)):
        return job
    suggests_oom = event.kind is EvidenceKind.XID and event.code == 31
    return add_evidence(job, Evidence(event.kind, None, event.text[:300], suggests_oom))


def _round(value: float | None, ndigits: int | None = None) -> float | int | None:
    if value is None:
        return None
    return round(value, ndigits) if ndigits is not None else int(round(value))


def summarize(job: JobTrack, source: str, sample_period_s: float, stopped_at_s: float,
              reason: str | None = None) -> dict[str, Any]:
    """The ``telemetry`` object of a stop reply (JSON-ready)."""
    out: dict[str, Any] = {
        "job_id": job.job_id, "source": source, "started_at": job.started_at_s, "stopped_at": stopped_at_s,
        "sample_period_s": sample_period_s, "samples": job.total.samples,
        "peak_bytes": int(job.total.peak), "mean_bytes": _round(job.total.mean()),
        "util_mean_pct": _round(job.util.mean(), 1),
        "gpus": [_gpu_summary(g) for g in job.gpu_tracks],
        "oom_suspected": any(e.suggests_oom for e in job.evidence),
        "evidence": [{"kind": e.kind.value, "gpu": e.gpu, "detail": e.detail} for e in job.evidence],
        "oom_evidence": "; ".join(f"{e.kind.value}: {e.detail}" for e in job.evidence if e.suggests_oom),
        "pids_seen": len(job.pids), "per_process_memory_reported": job.per_process_memory_reported,
    }
    if reason:
        out["reason"] = reason
    return out


def _gpu_summary(track: GpuTrack) -> dict[str, Any]:
    return {
        "index": track.index, "name": track.name, "uuid": track.uuid, "total_bytes": track.total_bytes,
        "peak_bytes": int(track.used.peak), "mean_bytes": _round(track.used.mean()),
        "util_mean_pct": _round(track.util.mean(), 1), "samples": track.used.samples,
    }


def unknown_job_telemetry(job_id: int, reason: str) -> dict[str, Any]:
    return {"job_id": job_id, "source": "none", "samples": 0, "oom_suspected": False, "evidence": [],
            "oom_evidence": "", "reason": reason}


def expired_jobs(jobs: Mapping[int, JobTrack], now_mono_s: float, max_age_s: float) -> list[int]:
    return [j for j, t in jobs.items() if now_mono_s - t.started_mono_s > max_age_s]


class RequestError(ValueError):
    """A request the agent cannot act on; becomes ``{"ok": false, "error": ...}``."""


def _int_field(request: Mapping[str, Any], key: str) -> int:
    value = request.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise RequestError(f"{key!r} must be a non-negative integer")
    return value


def _optional_int_field(request: Mapping[str, Any], key: str) -> int | None:
    return None if request.get(key) is None else _int_field(request, key)


def _sluid_field(request: Mapping[str, Any]) -> str | None:
    """The optional ``sluid`` as given (absent or null: None); only its type is checked here."""
    value = request.get("sluid")
    if value is not None and not isinstance(value, str):
        raise RequestError("'sluid' must be a string")
    return value


def _gpus_field(request: Mapping[str, Any]) -> list[int]:
    gpus = request.get("gpus", [])
    if not isinstance(gpus, list) or any(not isinstance(g, int) or isinstance(g, bool) or g < 0 for g in gpus):
        raise RequestError("'gpus' must be a list of non-negative integers")
    return gpus


class Agent:
    """The agent's state and behaviour, independent of the socket."""

    def __init__(self, cfg: AgentConfig, telemetry: GpuTelemetry | None, *, proc_root: Path = PROC_ROOT,
                 kernel_log: Path | None = DEFAULT_KERNEL_LOG, max_job_age_s: float = MAX_JOB_AGE_S,
                 wall_clock: Callable[[], float] = time.time,
                 mono_clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.telemetry = telemetry
        self.source = telemetry.source if telemetry is not None else "none"
        self._proc_root = proc_root
        self._max_job_age_s = max_job_age_s
        self._wall, self._mono = wall_clock, mono_clock
        self._jobs: dict[int, JobTrack] = {}
        self._lock = threading.Lock()
        self._identity: dict[int, tuple[str, str]] = {}
        self._pid_cache = PidJobCache(proc_root)
        self._logged: set[str] = set()
        self._kernel = self._open_kernel_log(kernel_log)
        self.replayer = None  # slurm_plugin.replayer.SpoolReplayer, set by main()

    def _open_kernel_log(self, path: Path | None) -> KernelLogTail | None:
        if path is None or self.telemetry is None:
            return None
        try:
            return KernelLogTail(path)
        except OSError as exc:
            log.info("kernel log %s not readable (%s): Xid/OOM-killer evidence disabled", path, exc.strerror)
            return None

    def _log_once(self, message: str) -> None:
        if message not in self._logged and len(self._logged) < 256:
            self._logged.add(message)
            log.warning("%s", message)

    # ---------------------------------------------------------------- requests

    def handle_line(self, line: bytes) -> bytes:
        """One request line -> one response line. Never raises."""
        try:
            request = json.loads(line.decode("utf-8"))
            if not isinstance(request, dict):
                raise RequestError("request must be a JSON object")
            reply = self.handle(request)
        except (RequestError, ValueError, UnicodeDecodeError) as exc:
            reply = {"ok": False, "error": str(exc)[:500]}
        except Exception as exc:  # noqa: BLE001 - the daemon must answer, not die
            log.exception("request failed")
            reply = {"ok": False, "error": f"internal error: {type(exc).__name__}: {exc}"[:500]}
        return (json.dumps(reply, separators=(",", ":")) + "\n").encode()

    def handle(self, request: Mapping[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        if op == "start":
            return self.start(_int_field(request, "job_id"), _gpus_field(request), _optional_int_field(request, "uid"),
                              _sluid_field(request))
        if op == "stop":
            return {"ok": True, "telemetry": self.stop(_int_field(request, "job_id"))}
        if op == "status":
            return self.status()
        raise RequestError(f"unknown op {op!r}; expected start, stop or status")

    def start(self, job_id: int, gpus: Sequence[int], uid: int | None, sluid: str | None = None) -> dict[str, Any]:
        usable = usable_sluid(sluid) if sluid is not None else None
        if sluid is not None and usable is None:
            # Still track the job: its processes are found by job_<id> or their environ.
            log.warning("job %d: SLUID %r cannot be a cgroup path component: ignored, its processes are "
                        "attributed by job_<id> or SLURM_JOB_ID only", job_id, sluid[:80])
        with self._lock:
            self._forget_expired()
            if job_id not in self._jobs and len(self._jobs) >= MAX_JOBS:
                oldest = min(self._jobs.values(), key=lambda j: j.started_mono_s)
                log.warning("tracking %d jobs: forgetting the oldest, job %d", MAX_JOBS, oldest.job_id)
                del self._jobs[oldest.job_id]
            restarted = job_id in self._jobs
            self._jobs[job_id] = new_job(job_id, gpus, uid, self._wall(), self._mono(), usable)
        log.info("job %d%s started on GPUs %s%s", job_id, f" (SLUID {usable})" if usable else "", list(gpus),
                 " (restarted)" if restarted else "")
        return {"ok": True}

    def stop(self, job_id: int) -> dict[str, Any]:
        with self._lock:
            job = self._jobs.pop(job_id, None)
        if job is None:
            return unknown_job_telemetry(job_id, "job was not started on this agent (prolog notify failed, "
                                                 "agent restarted, or already stopped)")
        reason = None if self.telemetry is not None else "no GPU telemetry on this node: memory not sampled"
        summary = summarize(job, self.source, self.cfg.sample_period_s, self._wall(), reason)
        log.info("job %d stopped: %d samples, peak %d bytes", job_id, summary["samples"], summary["peak_bytes"])
        return summary

    def status(self) -> dict[str, Any]:
        with self._lock:
            jobs = [{"job_id": j.job_id, "gpus": list(j.gpus), "uid": j.uid, "samples": j.total.samples,
                     "started_at": j.started_at_s, "sluid": j.sluid} for j in self._jobs.values()]
        out = {"ok": True, "source": self.source, "sample_period_s": self.cfg.sample_period_s, "jobs": jobs}
        if self.replayer is not None:  # the hooks' spool, delivered by this agent (slurm_plugin/replayer.py)
            out.update(self.replayer.status())
        return out

    def _forget_expired(self) -> None:
        for job_id in expired_jobs(self._jobs, self._mono(), self._max_job_age_s):
            log.warning("job %d never stopped after %.0f s: forgotten", job_id, self._max_job_age_s)
            del self._jobs[job_id]

    # ---------------------------------------------------------------- sampling

    def sample_once(self) -> None:
        """Take one sample of every device and fold it into each tracked job."""
        with self._lock:
            self._forget_expired()
            tracking = bool(self._jobs)
            sluids = sluid_map(self._jobs.values())
        events = self._kernel_events()
        if self.telemetry is None or not (tracking or events):
            return
        observations = self._observe() if tracking else []
        pid_jobs = self._pid_cache.resolve({p.pid for o in observations for p in o.procs}, sluids)
        events = [self._with_live_job(e, pid_jobs, sluids) for e in events]
        t_s = self._mono()
        with self._lock:
            for job_id, job in list(self._jobs.items()):
                if observations:
                    job = apply_tick(job, t_s, observations, pid_jobs)
                for event in events:
                    job = apply_kernel_event(job, event)
                self._jobs[job_id] = job

    def _with_live_job(self, event: KernelEvent, pid_jobs: Mapping[int, int | None],
                       sluids: Mapping[str, int]) -> KernelEvent:
        if event.job_id is not None:
            return event
        job_id = job_id_from_memcg(event.text, sluids)  # 26.05: memcg paths name the SLUID
        if job_id is None and event.pid is not None:
            job_id = pid_jobs.get(event.pid) or resolve_job_id(event.pid, self._proc_root, sluids)
        return event if job_id is None else dataclasses.replace(event, job_id=job_id)

    def _kernel_events(self) -> list[KernelEvent]:
        if self._kernel is None:
            return []
        try:
            lines = self._kernel.read_lines()
        except OSError as exc:
            self._log_once(f"kernel log read failed ({exc}): Xid evidence disabled")
            self._kernel.close()
            self._kernel = None
            return []
        return [e for e in map(parse_kernel_line, lines) if e is not None]

    def _observe(self) -> list[GpuObservation]:
        assert self.telemetry is not None
        try:
            count = self.telemetry.device_count()
        except TelemetryError as exc:
            self._log_once(f"cannot count GPUs: {exc}")
            return []
        out = []
        for index in range(count):
            try:
                out.append(self._observe_gpu(index))
            except TelemetryError as exc:
                self._log_once(f"GPU {index} not sampled: {exc}")
        return out

    def _observe_gpu(self, index: int) -> GpuObservation:
        assert self.telemetry is not None
        if index not in self._identity:
            self._identity[index] = (self.telemetry.name(index), self.telemetry.uuid(index))
        mem = self.telemetry.memory(index)
        procs = tuple(self.telemetry.processes(index))
        name, uuid = self._identity[index]
        return GpuObservation(index, mem.total_bytes, mem.used_bytes, self.telemetry.utilization_pct(index),
                              procs, name, uuid)

    def run_sampler(self, stop: threading.Event) -> None:
        """Sample every ``sample_period_s`` (no drift) until ``stop`` is set."""
        period_s = self.cfg.sample_period_s
        next_s = self._mono()
        while not stop.is_set():
            try:
                self.sample_once()
            except Exception:  # noqa: BLE001 - one bad sample must not end sampling
                log.exception("sample failed")
            next_s += period_s
            now_s = self._mono()
            if next_s < now_s:  # fell behind: skip missed ticks rather than burst
                next_s = now_s
            stop.wait(next_s - now_s)

    def close(self) -> None:
        if self._kernel is not None:
            self._kernel.close()


# --------------------------------------------------------------------------- socket server


class _Handler(socketserver.StreamRequestHandler):
    server: "_UnixServer"

    def handle(self) -> None:
        self.connection.settimeout(CONNECTION_TIMEOUT_S)
        try:
            line = self.rfile.readline(MAX_REQUEST_BYTES + 1)
        except OSError:
            return
        if len(line) > MAX_REQUEST_BYTES:
            reply = b'{"ok":false,"error":"request too long"}\n'
        else:
            reply = self.server.agent.handle_line(line)
        with contextlib.suppress(OSError):
            self.wfile.write(reply)
            self.wfile.flush()


class _UnixServer(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True
    block_on_close = False
    agent: Agent


def _prepare_socket_path(path: Path) -> None:
    """Create the parent directory; remove a stale socket, refuse if another agent listens."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() and not path.is_symlink():
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(0.5)
    try:
        probe.connect(str(path))
    except OSError:
        path.unlink()
        return
    finally:
        probe.close()
    raise RuntimeError(f"another agent is listening on {path}")


class AgentServer:
    """The socket and the sampling thread around an ``Agent``."""

    def __init__(self, agent: Agent, socket_path: Path) -> None:
        self.agent = agent
        self.socket_path = Path(socket_path)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._server: _UnixServer | None = None

    def start(self) -> None:
        _prepare_socket_path(self.socket_path)
        old_umask = os.umask(0o177)
        try:
            self._server = _UnixServer(str(self.socket_path), _Handler)
        finally:
            os.umask(old_umask)
        os.chmod(self.socket_path, 0o600)
        self._server.agent = self.agent
        self._threads = [
            threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2}, name="agent-socket",
                             daemon=True),
            threading.Thread(target=self.agent.run_sampler, args=(self._stop,), name="agent-sampler", daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        log.info("listening on %s, sampling every %.3f s from %s", self.socket_path,
                 self.agent.cfg.sample_period_s, self.agent.source)

    def stop(self) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        for thread in self._threads:
            thread.join(timeout=5)
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        self.agent.close()

    def __enter__(self) -> "AgentServer":
        self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()


# --------------------------------------------------------------------------- main


def _daemonize() -> None:
    """Classic double fork; stdio to /dev/null."""
    if os.fork() > 0:
        os._exit(0)
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)


def _setup_logging(level: str, foreground: bool) -> None:
    if foreground or not Path("/dev/log").exists():
        handler: logging.Handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    else:
        handler = logging.handlers.SysLogHandler(address="/dev/log")
        handler.setFormatter(logging.Formatter("swapaware-agent[%(process)d]: %(levelname)s %(message)s"))
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), handlers=[handler], force=True)


# A batch of 500 events may take the service seconds (each is its own transaction); the agent is
# not in a job's way, unlike the hooks, so it waits longer than hooks.deadline_s.
REPLAY_DEADLINE_S = 60.0


def main(argv: Sequence[str] | None = None) -> int:
    """Console script ``swapaware-agent``."""
    parser = argparse.ArgumentParser(prog="swapaware-agent", description="swapaware per-node GPU telemetry agent")
    parser.add_argument("--config", type=Path, default=None, help="TOML config (default: SWAPAWARE_CONFIG or "
                                                                    "/etc/swapaware/swapaware.toml)")
    parser.add_argument("--socket", type=Path, default=None, help="override agent.socket_path")
    parser.add_argument("--foreground", action="store_true", help="do not daemonize; log to stderr")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        sys.stderr.write(f"swapaware-agent: {exc}\n")
        return 2
    agent_cfg = cfg.agent if args.socket is None else dataclasses.replace(cfg.agent, socket_path=args.socket)
    if not args.foreground:
        _daemonize()
    _setup_logging(cfg.service.log_level, args.foreground)
    log.info("%s", cfg.summary())
    try:
        telemetry = open_telemetry(agent_cfg, log)
    except TelemetryError as exc:
        log.error("%s", exc)
        return 1
    agent = Agent(agent_cfg, telemetry)
    done = threading.Event()
    if agent_cfg.replay:
        from slurm_plugin.hooks import hook_client
        from slurm_plugin.replayer import SpoolReplayer

        replay_hooks = dataclasses.replace(cfg.hooks, deadline_s=max(cfg.hooks.deadline_s, REPLAY_DEADLINE_S))
        agent.replayer = SpoolReplayer(cfg.hooks.spool_dir, lambda: hook_client(replay_hooks, cfg.auth, cfg.tls, cfg.ha),
                                       agent_cfg.replay_interval_s, agent_cfg.replay_max_backoff_s)
        agent.replayer.start(done)
        log.info("delivering the hooks' spool %s every %.0f s (backoff up to %.0f s)", cfg.hooks.spool_dir,
                 agent_cfg.replay_interval_s, agent_cfg.replay_max_backoff_s)
    if agent_cfg.metrics_address:
        from slurm_plugin.agent_metrics import serve as serve_metrics

        serve_metrics(agent_cfg.metrics_address, agent.status)
    return _serve(agent, agent_cfg.socket_path, done)


def _serve(agent: Agent, socket_path: Path, done: threading.Event | None = None) -> int:
    done = done or threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: done.set())
    server = AgentServer(agent, socket_path)
    try:
        server.start()
    except (OSError, RuntimeError) as exc:
        log.error("cannot listen on %s: %s", socket_path, exc)
        done.set()  # the spool replayer stops too
        return 1
    while not done.wait(1.0):
        pass
    log.info("stopping (signal)")
    server.stop()
    if agent.replayer is not None and not agent.replayer.join(10.0):
        log.warning("the spool replayer is still in a replay; leaving it (the spool keeps what it did not send)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
