"""A site's own jobs as a simulator workload: a ``sacct --json`` export (any release of the version
matrix), joined with the policy service's history where it observed a job's GPU memory.

    sacct --json -X --allusers -S 2026-11-01 -E 2026-12-01 > november.json
    swapaware simulate --workload sacct --sacct-json november.json --history /var/lib/swapaware/history.sqlite3

Every job that ran with GPUs (gres/gpu or gres/shard in its allocated, else requested, TRES) and
ended becomes one trace job: submit time, run time, GPUs (k shards count as k / shards_per_gpu
of one GPU), its class (user and job name, like the service's user+name key). Its memory truth is the peak the node agent observed where the history holds one
(``measured_peak_bytes``); for the others the simulator's documented memory model draws it. The
loaded trace's ``source`` says how many of each, so a result says which figures rest on what.
"""
from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path

from policy_service.slurm.slurm_text import AccountingJob, parse_sacct_json
from policy_service.report.join import _pick_observation, parse_tres, read_history
from policy_service.report.model import HistorySnapshot, HistoryUnavailable
from policy_service.sim.loaders import DataNotFound, LoadedTrace, SchemaError, TraceJob, sha256_file


def read_export(path: Path) -> list[AccountingJob]:
    """The jobs of a ``sacct --json`` file (plain or .gz)."""
    if not path.is_file():
        raise DataNotFound(f"sacct export {path} is not there (make one with: sacct --json -X --allusers "
                           "-S <start> -E <end> > FILE)")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as fh:
        text = fh.read()
    try:
        if not isinstance(json.loads(text).get("jobs"), list):
            raise SchemaError(f"{path}: no 'jobs' list: not the output of sacct --json")
        return parse_sacct_json(text)
    except (json.JSONDecodeError, AttributeError) as exc:
        raise SchemaError(f"{path}: not the output of sacct --json ({exc})") from None


def trace_job(job: AccountingJob, hist: HistorySnapshot, shards_per_gpu: int, t0: int) -> tuple[TraceJob | None, str]:
    """One accounting job as a trace job, or (None, why it is left out)."""
    tres = parse_tres(job.tres_alloc) if job.tres_alloc else parse_tres(job.tres_req)
    if not tres.any_gpu:
        return None, "no GPU"
    if job.start_time <= 0 or job.end_time < job.start_time:
        return None, "never ran, or still running"
    if tres.gpus > 0:
        num_gpu, milli = tres.gpus, 1000
    else:
        num_gpu, milli = 1, max(1, min(1000, round(1000 * tres.shards / max(1, shards_per_gpu))))
    o = _pick_observation(hist.observations.get(job.job_id, ()), "", job.start_time, job.submit_time)
    # The observation is the job's own peak on its GPU: per GPU only for single-GPU jobs.
    peak = o.peak_bytes if o is not None and o.peak_bytes and num_gpu == 1 else None
    return TraceJob(job_id=str(job.job_id), submit_s=float(job.submit_time - t0),
                    duration_s=float(job.end_time - job.start_time), num_gpu=num_gpu, gpu_milli=milli,
                    user=job.user, class_key=f"{job.user}/{job.job_name}", measured_peak_bytes=peak), ""


def load_sacct_export(path: Path, history: Path | None, *, shards_per_gpu: int,
                      limit: int | None = None) -> LoadedTrace:
    jobs = sorted(read_export(Path(path)), key=lambda j: (j.submit_time, j.job_id))
    hist, history_note = HistorySnapshot(), "none given: every job's memory from the model"
    if history is not None:
        try:
            hist = read_history(history, [j.job_id for j in jobs])
            history_note = str(history)
        except HistoryUnavailable as exc:
            raise DataNotFound(f"history {history}: {exc}") from None
    t0 = min((j.submit_time for j in jobs if j.submit_time > 0), default=0)
    out: list[TraceJob] = []
    skipped: Counter = Counter()
    seen: set[int] = set()
    for j in jobs:
        if j.job_id in seen:  # a requeued job is listed once per run: the first counts
            skipped["listed again (requeued)"] += 1
            continue
        seen.add(j.job_id)
        tj, why = trace_job(j, hist, shards_per_gpu, t0)
        if tj is None:
            skipped[why] += 1
            continue
        out.append(tj)
        if limit is not None and len(out) >= limit:
            break
    observed = sum(1 for t in out if t.measured_peak_bytes)
    source = {
        "name": "sacct", "files": [{"path": str(path), "sha256": sha256_file(Path(path)), "rows": len(jobs)}],
        "history": history_note,
        "memory": {"observed_jobs": observed, "model_jobs": len(out) - observed,
                   "note": "observed: the peak the node agent measured (history); model: drawn by the "
                           "simulator's memory model (sim_config.memory), see docs/simulation.md"},
        "times": "submit, start and end from accounting; run time = end - start",
    }
    return LoadedTrace(jobs=out, source=source, skipped=skipped)
