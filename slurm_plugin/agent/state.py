"""The node agent's pure core: per-job bookkeeping of GPU samples and the report a stop returns.

``Series`` keeps a running peak and time-weighted mean; ``apply_tick`` folds one sample of all
devices into a ``JobTrack``, ``apply_kernel_event`` attaches kernel-log evidence and ``summarize``
builds the ``telemetry`` object of a stop reply. No I/O, clocks or locks: ``slurm_plugin.agent.sampler``
adds those. Per job and GPU it keeps the peak and the time-weighted mean of the job's bytes (a step
function: each sample holds until the next, over [first sample, last sample]) and the device
utilisation (device-wide, not per job).

Which job a process's memory belongs to is decided before (``slurm_plugin.agent.attribution``: its
cgroup, or its environment only for the job's own user on the job's own GPUs); ``apply_tick``
takes the result, (GPU, pid) -> job.

``oom_suspected`` is a heuristic, with its evidence listed. Only the job's own memory can set it:
  * ``job_near_capacity``: the processes charged to the job held >= 98 % of one of the job's own
    GPUs (``JobTrack.gpus``) at a sample; memory on a GPU the job was not given never counts;
  * ``xid``: an ``NVRM: Xid`` kernel line naming a pid charged to the job (or, by its cgroup, the
    job); only Xid 31 (GPU MMU fault, which is how a failed page-in under oversubscription shows,
    but also plain bad pointers) sets ``oom_suspected``, other Xids are listed only.
  ``device_full`` (one of the job's GPUs was >= 98 % used by all processes while the job held
  memory there) is listed but does not set it: most of that memory may be a neighbour's, and a
  neighbour must not be able to flag a job (the service's own rule, ``estimator.infer_oom``, still
  flags a shared job that failed at its own charge). ``host_oom`` (the kernel OOM killer hit one
  of the job's pids or its memory cgroup) is listed only: that is host memory. A CUDA
  out-of-memory error itself leaves no trace the driver reports, and an allocation that failed
  between two samples is invisible here, so the epilog combines this with the job's exit code.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from slurm_plugin.gpu.nvml import ProcessUsage
from slurm_plugin.agent.procs import EvidenceKind, KernelEvent

NEAR_CAPACITY_FRAC = 0.98
MAX_EVIDENCE = 16
MAX_PIDS_PER_JOB = 256


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
    """Evidence of one of the job's own GPUs at one sample (``job_bytes``: the job's own there)."""
    limit_bytes = NEAR_CAPACITY_FRAC * obs.total_bytes
    if job_bytes <= 0 or obs.total_bytes <= 0:
        return []
    if job_bytes >= limit_bytes:
        detail = f"job held {job_bytes} of {obs.total_bytes} bytes on GPU {obs.index} at +{rel_s:.1f}s"
        return [Evidence(EvidenceKind.JOB_NEAR_CAPACITY, obs.index, detail, True)]
    if obs.used_bytes >= limit_bytes:
        detail = (f"GPU {obs.index} full: {obs.used_bytes} of {obs.total_bytes} bytes used by all processes, "
                  f"job held {job_bytes}, at +{rel_s:.1f}s")
        return [Evidence(EvidenceKind.DEVICE_FULL, obs.index, detail, False)]  # a neighbour's memory
    return []


def _gpu_track(job: JobTrack, obs: GpuObservation) -> GpuTrack:
    existing = next((g for g in job.gpu_tracks if g.index == obs.index), None)
    return existing or GpuTrack(obs.index, obs.name, obs.uuid, obs.total_bytes)


def apply_tick(job: JobTrack, t_s: float, observations: Sequence[GpuObservation],
               owners: Mapping[tuple[int, int], int]) -> JobTrack:
    """Fold one sample of all devices into ``job``: its GPUs plus any GPU a process charged to it
    appears on (``owners``: (GPU index, pid) -> the job charged, ``attribution.sample_owners``).
    Capacity evidence comes from the job's own GPUs only."""
    tracks = {g.index: g for g in job.gpu_tracks}
    total_bytes, utils, pids, reported = 0, [], set(job.pids), job.per_process_memory_reported
    evidence: list[Evidence] = []
    for obs in observations:
        mine = [p for p in obs.procs if owners.get((obs.index, p.pid)) == job.job_id]
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
        if obs.index in job.gpus:
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
    """Attach ``event`` to ``job`` when its cgroup is the job's (``event.job_id``: the kernel's
    word), or, when no cgroup names a job, when its pid is one charged to the job."""
    by_pid = event.job_id is None and event.pid is not None and event.pid in job.pids
    if not (event.job_id == job.job_id or by_pid):
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
