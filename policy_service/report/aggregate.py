"""Aggregation: the joined jobs summed per user, account or partition into a ``Report``."""
from __future__ import annotations

import collections
import math
import statistics
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

from policy_service.slurm.slurm import AccountingJob
from policy_service.core.policy import parse_admin_comment
from policy_service.config import Config
from policy_service.report.interference import load_interference
from policy_service.report.join import join_job, read_history
from policy_service.report.model import (GROUP_KEYS, GroupSummary, HistorySnapshot, HistoryUnavailable,
                                         InterferenceSection, JobReport, RecordStatus, Report)

def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summarize(key: str, jobs: Sequence[JobReport]) -> GroupSummary:
    waits = [j.wait_s for j in jobs if j.wait_s is not None]
    observed = [j.observed_peak_bytes for j in jobs if j.observed_peak_bytes is not None]
    errors = [j.abs_pct_error for j in jobs if j.abs_pct_error is not None]
    return GroupSummary(
        key=key, jobs=len(jobs), not_started=sum(not j.started for j in jobs),
        shared_jobs=sum(j.shared for j in jobs), whole_gpu_jobs=sum(j.whole_gpu for j in jobs),
        as_decided=sum(j.status is RecordStatus.AS_DECIDED for j in jobs),
        overridden=sum(j.status is RecordStatus.OVERRIDDEN for j in jobs),
        no_record=sum(j.status is RecordStatus.NO_RECORD for j in jobs),
        not_in_history=sum(bool(j.decision_id) and not j.in_history for j in jobs),
        gpu_hours_used=math.fsum(j.gpu_hours_used for j in jobs),
        gpu_hours_shared=math.fsum(j.gpu_hours_used for j in jobs if j.shared),
        gpu_hours_saved=math.fsum(j.gpu_hours_saved for j in jobs),
        wait_median_s=_median(waits), wait_mean_s=statistics.fmean(waits) if waits else None,
        wait_max_s=max(waits) if waits else None,
        observed_jobs=len(observed), observed_peak_max_bytes=max(observed) if observed else None,
        predicted_jobs=len(errors), abs_pct_error_median=_median(errors),
        under_predicted=sum(bool(j.under_predicted) for j in jobs), ooms=sum(bool(j.oom) for j in jobs),
        whole_because=";".join(f"{code}={n}" for code, n in sorted(
            collections.Counter(j.whole_because for j in jobs if j.whole_because).items())),
        shadow_jobs=sum(j.shadow for j in jobs), shadow_would_share=sum(j.shadow_would_share for j in jobs),
        shadow_gpu_hours_freed=math.fsum(j.shadow_gpu_hours_freed for j in jobs),
        shadow_would_oom=sum(bool(j.shadow_would_oom) for j in jobs))


def build_report(accounting: Iterable[AccountingJob], hist: HistorySnapshot, *, by: str, shards_per_gpu: int,
                 now: float, start: str = "", end: str = "", history_path: str = "", history_error: str = "",
                 slurm_backend: str = "", live_comments: Mapping[int, str] | None = None,
                 shard_bytes: int = 0, interference: InterferenceSection | None = None) -> Report:
    """Join every accounting job with the history and aggregate by ``by`` (user/account/partition);
    ``interference``: the shared runs' predicted vs observed slowdowns (report/interference.py)."""
    if by not in GROUP_KEYS:
        raise ValueError(f"by must be one of {', '.join(GROUP_KEYS)}, not {by!r}")
    jobs: list[JobReport] = []
    skipped = 0
    seen: set[int] = set()
    for acct in accounting:
        if acct.job_id in seen:  # requeued jobs may be listed more than once: keep the first
            continue
        seen.add(acct.job_id)
        row = join_job(acct, hist, shards_per_gpu=shards_per_gpu, now=now,
                       live_comment=(live_comments or {}).get(acct.job_id), shard_bytes=shard_bytes)
        if row is None:
            skipped += 1
        else:
            jobs.append(row)
    jobs.sort(key=lambda j: j.job_id)
    groups: dict[str, list[JobReport]] = {}
    for j in jobs:
        groups.setdefault(getattr(j, by) or "(none)", []).append(j)
    return Report(by=by, start=start, end=end, generated_at=now, shards_per_gpu=shards_per_gpu,
                  groups=tuple(summarize(k, v) for k, v in sorted(groups.items())),
                  total=summarize("(total)", jobs), jobs=tuple(jobs), non_gpu_jobs=skipped,
                  history_path=history_path, history_error=history_error, slurm_backend=slurm_backend,
                  interference=interference)


def load_report(accounting: Sequence[AccountingJob], history_path: Path | str, *, by: str, shards_per_gpu: int,
                now: float, start: str = "", end: str = "", slurm_backend: str = "",
                live_comments: Mapping[int, str] | None = None, shard_bytes: int = 0,
                interference_cfg: Config | None = None,
                gpu_type_of: Callable[[str, int], str] | None = None) -> Report:
    """Read the history for these jobs (accounting only, with the reason, when it cannot be read).
    ``interference_cfg``: also compare the history's shared runs' slowdowns with the model this
    config fits to them (``gpu_type_of``: a GPU's type, from gres.conf; None: pooled only)."""
    live_comments = live_comments or {}
    ids = [j.job_id for j in accounting]
    comment_ids = [parse_admin_comment(j.admin_comment or live_comments.get(j.job_id, "")).get("id", "")
                   for j in accounting]
    error = ""
    try:
        hist = read_history(history_path, ids, [c for c in comment_ids if c])
    except HistoryUnavailable as exc:
        hist, error = HistorySnapshot(), str(exc)
    interference = None
    if interference_cfg is not None:
        interference = (InterferenceSection(error=error) if error else
                        load_interference(history_path, interference_cfg, gpu_type_of))
    return build_report(accounting, hist, by=by, shards_per_gpu=shards_per_gpu, now=now, start=start, end=end,
                        history_path=str(history_path), history_error=error, slurm_backend=slurm_backend,
                        live_comments=live_comments, shard_bytes=shard_bytes, interference=interference)


# ============================================================================ rendering
