"""The node agent's ``Agent``: the tracked jobs behind a lock, the requests that start and stop
them, and the sampling loop that reads the devices, /proc and the kernel log on a clock.

Every ``sample_period_s`` the sampler thread reads each device's processes and charges a
process's memory to a job only where the kernel ties it to that job (``slurm_plugin.agent.attribution``):
by its ``/proc/<pid>/cgroup`` path (Slurm's cgroup plugins), a ``job_<id>`` component, or a
component equal to the SLUID an announced job came with (Slurm 26.05 with cgroup v2 names job
directories ``.../slurmstepd.scope/<SLUID>/`` unless ``CgroupJobIdPaths=yes``; the prolog sees
``SLURM_JOB_SLUID`` from 25.11 on). SLUIDs are opaque: only a whole path component equal to an
announced one counts. A process whose cgroup names no job is charged by ``SLURM_JOB_ID`` in
``/proc/<pid>/environ`` (readable as root) only when its owner (``/proc/<pid>/status``) is the
job's announced uid and only on the job's own GPUs: anyone can set that variable, nobody can
change their uid. The parsers are in ``slurm_plugin.agent.procs``, the bookkeeping of each sample in
``slurm_plugin.agent.state``. Kernel lines are attributed by cgroup (the line's memcg path, or the
named pid's cgroup), else by a pid already charged to the job.
Xid lines are read from ``/dev/kmsg`` when it is readable; Xids without a pid (old drivers) are
not attributed. Jobs never stopped are forgotten after ``MAX_JOB_AGE_S``; at most ``MAX_JOBS``
are tracked.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from policy_service.config import AgentConfig
from slurm_plugin.agent.protocol import RequestError, gpus_field, int_field, optional_int_field, sluid_field
from slurm_plugin.agent.state import (
    GpuObservation,
    JobTrack,
    apply_kernel_event,
    apply_tick,
    expired_jobs,
    new_job,
    sluid_map,
    summarize,
    unknown_job_telemetry,
)
from slurm_plugin.agent.attribution import sample_owners
from slurm_plugin.gpu.nvml import PROC_ROOT, GpuTelemetry, TelemetryError
from slurm_plugin.agent.procs import (
    KernelEvent,
    KernelLogTail,
    ProcFacts,
    ProcFactsCache,
    cgroup_job_id,
    job_id_from_memcg,
    parse_kernel_line,
    usable_sluid,
)

log = logging.getLogger("swapaware.agent")

MAX_JOB_AGE_S = 7 * 24 * 3600.0
MAX_JOBS = 4096
DEFAULT_KERNEL_LOG = Path("/dev/kmsg")


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
        self._pid_cache = ProcFactsCache(proc_root)
        self._logged: set[str] = set()
        self._kernel = self._open_kernel_log(kernel_log)
        self.replayer = None  # slurm_plugin.hooks.replayer.SpoolReplayer, set by main()

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
            return self.start(int_field(request, "job_id"), gpus_field(request), optional_int_field(request, "uid"),
                              sluid_field(request))
        if op == "stop":
            return {"ok": True, "telemetry": self.stop(int_field(request, "job_id"))}
        if op == "status":
            return self.status()
        raise RequestError(f"unknown op {op!r}; expected start, stop or status")

    def start(self, job_id: int, gpus: Sequence[int], uid: int | None, sluid: str | None = None) -> dict[str, Any]:
        usable = usable_sluid(sluid) if sluid is not None else None
        if sluid is not None and usable is None:
            # Still track the job: its processes are found by job_<id> or their environ.
            log.warning("job %d: SLUID %r cannot be a cgroup path component: ignored, its processes are "
                        "attributed by job_<id> or (its own user's, on its GPUs) SLURM_JOB_ID only", job_id,
                        sluid[:80])
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
        if self.replayer is not None:  # the hooks' spool, delivered by this agent (slurm_plugin/hooks/replayer.py)
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
            jobs = dict(self._jobs)
            sluids = sluid_map(jobs.values())
        events = self._kernel_events()
        if self.telemetry is None or not (jobs or events):
            return
        observations = self._observe() if jobs else []
        facts = self._pid_cache.resolve({p.pid for o in observations for p in o.procs}, sluids)
        owners = sample_owners(observations, facts, jobs)
        events = [self._with_live_job(e, facts, sluids) for e in events]
        t_s = self._mono()
        with self._lock:
            for job_id, job in list(self._jobs.items()):
                if observations:
                    job = apply_tick(job, t_s, observations, owners)
                for event in events:
                    job = apply_kernel_event(job, event)
                self._jobs[job_id] = job

    def _with_live_job(self, event: KernelEvent, facts: Mapping[int, ProcFacts],
                       sluids: Mapping[str, int]) -> KernelEvent:
        """``event`` with the job its cgroup names (never its environment's: a pid charged to a
        job by that is matched by ``apply_kernel_event``)."""
        if event.job_id is not None:
            return event
        job_id = job_id_from_memcg(event.text, sluids)  # 26.05: memcg paths name the SLUID
        if job_id is None and event.pid is not None:
            known = facts.get(event.pid)
            job_id = known.cgroup_job if known is not None else cgroup_job_id(event.pid, self._proc_root, sluids)
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
