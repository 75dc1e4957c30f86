"""``swapaware report``: the admins' view of what swapaware did.

Accounting (``SlurmAccess.accounting_jobs``: pyslurm's db API where its version matches the
cluster, else ``sacct --json``) joined with the service's history (read-only SQLite):
per user / account / partition, jobs shared vs whole-GPU, GPU-hours used and saved, queue
wait, predicted vs observed GPU memory, OOMs and decisions that were overridden.

Layout: the join and the aggregation are pure functions over frozen dataclasses
(``join_job``, ``judge``, ``summarize``, ``build_report``); ``read_history`` is the only
reader of the SQLite file; rendering (table / JSON / CSV / PNG) and the click command sit at
the end. Every definition is written down in docs/reporting.md.
"""
from __future__ import annotations

import collections
import csv
import dataclasses
import enum
import io
import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import click

from policy_service.adapters.history import HistoryUnreadable, ReadOnlyHistory
from policy_service.adapters.slurm import AccountingJob, SlurmAccess, SlurmError, cluster_release, open_slurm
from policy_service.config import Config, ConfigError, load_config
from policy_service.core.policy import parse_admin_comment
from policy_service.core.request import RequestError, gpu_request
from policy_service.core.types import Action, GresKind, ReasonCode

GIB = 1024**3
HOUR_S = 3600.0
SHARED_ACTIONS = frozenset({Action.SHARE.value, Action.SHARE_OVERSUBSCRIBED.value})
GROUP_KEYS = ("user", "account", "partition")
# An observation that finished this long before accounting says the job started belongs to an
# earlier job with the same id (ids restart when a cluster's state is reset).
STALE_OBSERVATION_S = 600.0
# Unfinished jobs whose AdminComment is read live from slurmctld (one scontrol call each).
LIVE_LOOKUP_MAX = 200


class ReportError(RuntimeError):
    pass


class HistoryUnavailable(ReportError):
    pass


# ============================================================================ values
@dataclass(frozen=True)
class TresCounts:
    """GPU resources of a TRES string: whole GPUs and shards (totals over all nodes)."""

    gpus: int = 0
    shards: int = 0

    @property
    def any_gpu(self) -> bool:
        return self.gpus > 0 or self.shards > 0


class RecordStatus(enum.Enum):
    AS_DECIDED = "as_decided"  # the allocation matches the swapaware decision
    OVERRIDDEN = "overridden"  # see OverrideReason
    NO_RECORD = "no_record"  # a GPU job with no swapaware decision (failed open, plugin off, bypassed)
    NOT_JUDGED = "not_judged"  # never started (nothing allocated) or nothing to compare with


class OverrideReason(enum.Enum):
    RAN_WHOLE_GPU_NOT_SHARDS = "ran_whole_gpu_not_shards"
    RAN_OTHER_SHARD_COUNT = "ran_other_shard_count"
    RAN_SHARDS_NOT_WHOLE_GPU = "ran_shards_not_whole_gpu"
    RAN_WITHOUT_GPU = "ran_without_gpu"
    COMMENT_EDITED = "comment_edited"  # AdminComment's action/shards differ from the history's decision
    COMMENT_REPLACED = "comment_replaced"  # AdminComment names another decision than the job's recorded run
    COMMENT_REMOVED = "comment_removed"  # the history linked the job to a decision, AdminComment no longer does


@dataclass(frozen=True)
class HistoryDecision:
    """What the report needs of one ``decisions`` row."""

    decision_id: str
    action: str  # Action value: "share", "whole_gpu", ...
    shards: int
    peak_bytes: int  # predicted peak; 0 = no prediction (no history at decision time)
    margin_bytes: int
    asked_kind: GresKind | None  # what the job asked for at submit (from the recorded facts)
    asked_gpus: int  # whole GPUs the request adds up to (per node x nodes, per task x tasks); 0 if none
    whole_because: str = ""  # for a whole-GPU decision: the reason code that kept it whole


@dataclass(frozen=True)
class HistoryObservation:
    job_id: int
    decision_id: str
    finished_at: float
    peak_bytes: int | None
    oom: bool
    telemetry_source: str
    submit_time: int = 0  # of the job instance it belongs to; 0: not known (legacy or unresolved)


@dataclass(frozen=True)
class HistorySnapshot:
    decisions: Mapping[str, HistoryDecision] = dataclasses.field(default_factory=dict)
    observations: Mapping[int, tuple[HistoryObservation, ...]] = dataclasses.field(default_factory=dict)
    run_decisions: Mapping[int, str] = dataclasses.field(default_factory=dict)  # job id -> decision id (runs)
    # job id -> {submit time -> decision id}: the runs whose job instance is known (ids repeat after a
    # Slurm state reset; a requeue gives a new submit time). Where an id has any, they alone count.
    run_instances: Mapping[int, Mapping[int, str]] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class JobReport:
    """One accounting job joined with its decision and observation."""

    job_id: int
    user: str
    account: str
    partition: str
    job_name: str
    state: str
    started: bool
    elapsed_s: float
    wait_s: float | None
    gpus: int
    shards: int
    shared: bool
    whole_gpu: bool
    decision_id: str
    action: str
    decided_shards: int | None
    whole_because: str  # the reason code of a whole-GPU decision ("" otherwise or unknown)
    in_history: bool
    status: RecordStatus
    override_reason: OverrideReason | None
    gpu_hours_used: float
    gpu_hours_saved: float
    predicted_peak_bytes: int | None
    margin_bytes: int | None
    observed_peak_bytes: int | None
    oom: bool | None  # None: no observation
    abs_pct_error: float | None
    under_predicted: bool | None


@dataclass(frozen=True)
class GroupSummary:
    key: str
    jobs: int
    not_started: int
    shared_jobs: int
    whole_gpu_jobs: int
    as_decided: int
    overridden: int
    no_record: int
    not_in_history: int
    gpu_hours_used: float
    gpu_hours_shared: float
    gpu_hours_saved: float
    wait_median_s: float | None
    wait_mean_s: float | None
    wait_max_s: float | None
    observed_jobs: int
    observed_peak_max_bytes: int | None
    predicted_jobs: int
    abs_pct_error_median: float | None
    under_predicted: int
    ooms: int
    # Whole-GPU decisions by the reason that kept them whole, e.g. "no_history=3;queue_short=12"
    whole_because: str = ""


@dataclass(frozen=True)
class Report:
    by: str
    start: str
    end: str
    generated_at: float
    shards_per_gpu: int
    groups: tuple[GroupSummary, ...]
    total: GroupSummary
    jobs: tuple[JobReport, ...]
    non_gpu_jobs: int
    history_path: str = ""
    history_error: str = ""  # non-empty: accounting only, history could not be read
    slurm_backend: str = ""


# ============================================================================ pure parsing
def parse_tres(text: str) -> TresCounts:
    """GPUs and shards in an AllocTRES/ReqTRES string ("cpu=1,gres/gpu=1,mem=1G" or with
    "gres/shard=2"). Typed entries ("gres/gpu:a100=2") are only summed when the untyped total
    is absent (sacct lists both when GRES types are tracked). Non-numeric counts are ignored."""
    plain: dict[str, int] = {}
    typed: dict[str, int] = {}
    for part in (text or "").split(","):
        name, sep, value = part.strip().partition("=")
        if not sep or not name.startswith("gres/"):
            continue
        try:
            count = int(float(value))
        except ValueError:
            continue
        gres, _, gtype = name[len("gres/"):].partition(":")
        bucket = typed if gtype else plain
        bucket[gres] = bucket.get(gres, 0) + count

    def total(name: str) -> int:
        return plain[name] if name in plain else typed.get(name, 0)

    return TresCounts(gpus=max(0, total("gpu")), shards=max(0, total("shard")))


def allocated_anything(text: str) -> bool:
    """True when a TRES string holds any resource (cpu=1, node=1, ...). Slurm gives a job cancelled
    while pending a start time (the cancel time) but no allocation."""
    for part in (text or "").split(","):
        _, sep, value = part.partition("=")
        try:
            if sep and float(value.rstrip("KMGTP")) > 0:
                return True
        except ValueError:
            continue
    return False


def _int(value: Any) -> int:
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0


# Reason codes that keep a single job whole, in the order the policy checks them.
WHOLE_BECAUSE = tuple(c.value for c in (
    ReasonCode.NO_GPU, ReasonCode.UNSUPPORTED_REQUEST, ReasonCode.TYPED_GPU, ReasonCode.HET_JOB, ReasonCode.INTERACTIVE,
    ReasonCode.MULTI_NODE, ReasonCode.MULTI_GPU,
    ReasonCode.SHARING_DISABLED, ReasonCode.PROTECTED_QOS, ReasonCode.OOM_PENALTY, ReasonCode.NO_HISTORY,
    ReasonCode.QUEUE_SHORT, ReasonCode.TOO_LARGE_TO_SHARE, ReasonCode.COMPUTE_BOUND))


def whole_because(action: str, reason_codes: Sequence[str]) -> str:
    """The reason code that kept a whole-GPU decision whole; "" for other actions."""
    if action != "whole_gpu":
        return ""
    return next((c for c in reason_codes if c in WHOLE_BECAUSE), "")


def decision_from_row(decision_id: str, action: str, shards: int, facts_json: str,
                      decision_json: str) -> HistoryDecision:
    """A ``decisions`` row (facts and decision are proto3 JSON: camelCase, uint64 as strings)."""
    try:
        decision = json.loads(decision_json or "{}") or {}
        est = decision.get("estimate") or {}
        codes = [str(r.get("code", "")) for r in decision.get("reasons") or [] if isinstance(r, dict)]
    except (json.JSONDecodeError, AttributeError):
        est, codes = {}, []
    asked_kind: GresKind | None = None
    asked_gpus = 0
    try:
        facts = json.loads(facts_json or "{}") or {}
        fields = {f: facts.get(_camel(f)) or facts.get(f) or "" for f in
                  ("tres_per_node", "tres_per_job", "tres_per_task", "tres_per_socket")}
        req = gpu_request(fields)
        asked_kind = req.kind
        if req.kind is GresKind.GPU:
            times = {"tres_per_task": _int(facts.get("numTasks", facts.get("num_tasks"))) or 1,
                     "tres_per_node": _int(facts.get("minNodes", facts.get("min_nodes"))) or 1}
            asked_gpus = req.per_node * times.get(req.source_field, 1)
    except (json.JSONDecodeError, RequestError, AttributeError):
        pass
    return HistoryDecision(decision_id=decision_id, action=action, shards=int(shards),
                           peak_bytes=_int(est.get("peakBytes", est.get("peak_bytes"))),
                           margin_bytes=_int(est.get("marginBytes", est.get("margin_bytes"))),
                           asked_kind=asked_kind, asked_gpus=asked_gpus, whole_because=whole_because(action, codes))


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p.title() for p in rest)


# ============================================================================ pure join
def judge(*, started: bool, tres: TresCounts, comment: Mapping[str, str] | None, hist: HistoryDecision | None,
          run_decision_id: str) -> tuple[RecordStatus, OverrideReason | None]:
    """Does the job's allocation (and AdminComment) agree with its swapaware decision?

    ``comment`` is the parsed AdminComment, or None when it is not known: slurmdbd only stores a
    job's AdminComment when the job ends (22.05), so a running or pending job's accounting record
    carries none, and it was not looked up live. Then the history's run record stands in."""
    if comment is None:
        if not run_decision_id or hist is None:
            return RecordStatus.NOT_JUDGED, None
        comment = {"id": run_decision_id, "action": hist.action, "shards": str(hist.shards)}
    comment_id = comment.get("id", "")
    if not comment_id:
        if run_decision_id:
            return RecordStatus.OVERRIDDEN, OverrideReason.COMMENT_REMOVED
        return RecordStatus.NO_RECORD, None
    if run_decision_id and run_decision_id != comment_id:
        return RecordStatus.OVERRIDDEN, OverrideReason.COMMENT_REPLACED
    action = comment.get("action", "")
    decided_k = _int(comment.get("shards"))
    if hist is not None and (hist.action != action or hist.shards != decided_k):
        return RecordStatus.OVERRIDDEN, OverrideReason.COMMENT_EDITED
    if not started:
        return RecordStatus.NOT_JUDGED, None
    if action in SHARED_ACTIONS or action == Action.WHOLE_GPU.value:
        # The decision's shard count is what the job was rewritten to: k shards of one GPU (a
        # whole-GPU decision is held as all shards of one GPU when policy.whole_gpu_as_shards
        # is on); 0 for a whole-GPU decision that kept the gpu request.
        if not tres.any_gpu:
            return RecordStatus.OVERRIDDEN, OverrideReason.RAN_WITHOUT_GPU
        if decided_k > 0:
            if tres.gpus > 0:
                return RecordStatus.OVERRIDDEN, OverrideReason.RAN_WHOLE_GPU_NOT_SHARDS
            if tres.shards != decided_k:
                return RecordStatus.OVERRIDDEN, OverrideReason.RAN_OTHER_SHARD_COUNT
        elif tres.shards > 0:
            return RecordStatus.OVERRIDDEN, OverrideReason.RAN_SHARDS_NOT_WHOLE_GPU
        return RecordStatus.AS_DECIDED, None
    if action == Action.PASS_THROUGH.value and hist is not None:
        # The request was left alone: the allocation must be of the kind the job asked for.
        if hist.asked_kind is GresKind.SHARD:
            if tres.gpus > 0:
                return RecordStatus.OVERRIDDEN, OverrideReason.RAN_WHOLE_GPU_NOT_SHARDS
            if tres.shards == 0:
                return RecordStatus.OVERRIDDEN, OverrideReason.RAN_WITHOUT_GPU
            return RecordStatus.AS_DECIDED, None
        if hist.asked_kind is GresKind.GPU:
            if tres.shards > 0:
                return RecordStatus.OVERRIDDEN, OverrideReason.RAN_SHARDS_NOT_WHOLE_GPU
            if tres.gpus == 0:
                return RecordStatus.OVERRIDDEN, OverrideReason.RAN_WITHOUT_GPU
            return RecordStatus.AS_DECIDED, None
    return RecordStatus.NOT_JUDGED, None


def _pick_observation(obs: Sequence[HistoryObservation], decision_id: str,
                      start_time: int, submit_time: int = 0) -> HistoryObservation | None:
    """The newest observation of this job id that belongs to this job (same instance where both
    know it, same decision, not older than the job's start)."""
    best = None
    for o in obs:
        if submit_time > 0 and o.submit_time > 0 and o.submit_time != submit_time:
            continue
        if decision_id and o.decision_id and o.decision_id != decision_id:
            continue
        if start_time > 0 and o.finished_at < start_time - STALE_OBSERVATION_S:
            continue
        if best is None or o.finished_at > best.finished_at:
            best = o
    return best


def join_job(job: AccountingJob, hist: HistorySnapshot, *, shards_per_gpu: int, now: float,
             live_comment: str | None = None) -> JobReport | None:
    """Join one accounting job with the history. None for a job that is not a GPU job (asked for
    and got no gpu/shard and carries no swapaware record).

    ``live_comment``: the AdminComment read from slurmctld for a job that has not ended (its
    accounting record has none yet); None when it was not looked up."""
    alloc = parse_tres(job.tres_alloc)
    req = parse_tres(job.tres_req)
    text = job.admin_comment or live_comment or ""
    # An ended job's accounting record is authoritative; an unfinished one's lacks the comment.
    known = bool(job.admin_comment) or job.end_time > 0 or live_comment is not None
    comment = parse_admin_comment(text) if known else None
    instances = hist.run_instances.get(job.job_id)
    if instances and job.submit_time > 0:  # runs of this id by instance: only this instance's counts
        run_id = instances.get(job.submit_time, "")
    else:
        run_id = hist.run_decisions.get(job.job_id, "")
    if not (alloc.any_gpu or req.any_gpu or comment or run_id):
        return None
    comment_fields = comment or {}
    started = job.start_time > 0 and allocated_anything(job.tres_alloc)
    if not started:
        elapsed = 0.0
    elif job.end_time >= job.start_time:
        elapsed = float(job.end_time - job.start_time)
    else:  # still running: count up to the report time
        elapsed = max(0.0, now - job.start_time)
    wait = float(max(0, job.start_time - job.submit_time)) if started and job.submit_time > 0 else None
    decision_id = comment_fields.get("id", "") or run_id
    d = hist.decisions.get(decision_id) if decision_id else None
    status, why = judge(started=started, tres=alloc, comment=comment, hist=d, run_decision_id=run_id)
    # Resources the job held (alloc TRES; nothing when it never started).
    gpus, shards = (alloc.gpus, alloc.shards) if started else (0, 0)
    spg = max(1, shards_per_gpu)
    # Shared: a part of one GPU. All shards of a GPU (how a whole-GPU decision is held) is whole.
    shared = gpus == 0 and 0 < shards < spg
    whole = started and not shared and (gpus > 0 or shards >= spg)
    used_h = elapsed / HOUR_S * (gpus + shards / spg)
    # Asked for exactly one whole GPU: from the decision's facts, else implied by a share action
    # (the policy only ever shares single-GPU requests).
    if d is not None and d.asked_kind is not None:
        asked_one_gpu = d.asked_kind is GresKind.GPU and d.asked_gpus == 1
    else:
        asked_one_gpu = (d.action if d else comment_fields.get("action", "")) in SHARED_ACTIONS
    saved_h = 0.0
    if asked_one_gpu and shards > 0 and gpus == 0:
        saved_h = elapsed / HOUR_S * max(0.0, 1.0 - shards / spg)
    o = _pick_observation(hist.observations.get(job.job_id, ()), decision_id, job.start_time, job.submit_time)
    observed = o.peak_bytes if o is not None and o.peak_bytes else None
    predicted = d.peak_bytes if d is not None and d.peak_bytes > 0 else None
    margin = d.margin_bytes if d is not None and predicted is not None else None
    err = under = None
    if predicted is not None and observed is not None:
        err = abs(predicted - observed) / observed * 100.0
        under = observed > predicted + (margin or 0)
    action = d.action if d is not None else comment_fields.get("action", "")
    decided_k = d.shards if d is not None else (_int(comment_fields.get("shards")) if comment_fields else None)
    return JobReport(
        job_id=job.job_id, user=job.user, account=job.account, partition=job.partition, job_name=job.job_name,
        state=job.state, started=started, elapsed_s=elapsed, wait_s=wait, gpus=gpus, shards=shards,
        shared=shared, whole_gpu=whole,
        decision_id=decision_id, action=action, decided_shards=decided_k,
        whole_because=d.whole_because if d is not None else "", in_history=d is not None,
        status=status, override_reason=why, gpu_hours_used=used_h, gpu_hours_saved=saved_h,
        predicted_peak_bytes=predicted, margin_bytes=margin, observed_peak_bytes=observed,
        oom=None if o is None else o.oom, abs_pct_error=err, under_predicted=under)


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
            collections.Counter(j.whole_because for j in jobs if j.whole_because).items())))


def build_report(accounting: Iterable[AccountingJob], hist: HistorySnapshot, *, by: str, shards_per_gpu: int,
                 now: float, start: str = "", end: str = "", history_path: str = "", history_error: str = "",
                 slurm_backend: str = "", live_comments: Mapping[int, str] | None = None) -> Report:
    """Join every accounting job with the history and aggregate by ``by`` (user/account/partition)."""
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
                       live_comment=(live_comments or {}).get(acct.job_id))
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
                  history_path=history_path, history_error=history_error, slurm_backend=slurm_backend)


# ============================================================================ history (read-only)
def read_history(path: Path | str, job_ids: Iterable[int], decision_ids: Iterable[str] = ()) -> HistorySnapshot:
    """Read what the report needs from the history file, opened read-only: the runs and
    observations of ``job_ids`` and the decisions they (or ``decision_ids``) name."""
    try:
        with ReadOnlyHistory(path) as h:
            ids = list(job_ids)
            runs = h.run_decisions(ids)
            by_instance: dict[int, dict[int, str]] = {}
            for job_id, submit, d_id in h.run_instances(ids):
                if submit > 0:
                    by_instance.setdefault(job_id, {})[submit] = d_id
            obs: dict[int, list[HistoryObservation]] = {}
            for o in h.observations_of(ids):
                obs.setdefault(o.job_id, []).append(HistoryObservation(
                    job_id=o.job_id, decision_id=o.decision_id or "", finished_at=float(o.finished_at),
                    peak_bytes=o.peak_bytes, oom=o.oom, telemetry_source=o.telemetry_source or "",
                    submit_time=o.submit_time))
            wanted = (set(decision_ids) | set(runs.values()) | {d for v in by_instance.values() for d in v.values()}
                      | {o.decision_id for v in obs.values() for o in v})
            decisions = {d_id: decision_from_row(d_id, r.action, r.shards, r.facts_json, r.decision_json)
                         for d_id, r in h.decisions_by_id(wanted).items()}
    except HistoryUnreadable as exc:
        raise HistoryUnavailable(str(exc)) from None
    return HistorySnapshot(decisions=decisions,
                           observations={k: tuple(sorted(v, key=lambda o: o.finished_at)) for k, v in obs.items()},
                           run_decisions=runs, run_instances=by_instance)


def live_admin_comments(slurm: SlurmAccess, accounting: Sequence[AccountingJob],
                        limit: int = LIVE_LOOKUP_MAX) -> dict[int, str]:
    """AdminComments of unfinished GPU jobs, read from slurmctld (their accounting records carry
    none until they end). At most ``limit`` lookups (one ``scontrol show job`` each); jobs beyond
    it, or whose lookup fails, stay unknown (not judged)."""
    wanted = [j.job_id for j in accounting if j.end_time == 0 and not j.admin_comment
              and (parse_tres(j.tres_alloc).any_gpu or parse_tres(j.tres_req).any_gpu)]
    out: dict[int, str] = {}
    for job_id in wanted[:max(0, limit)]:
        try:
            text = slurm.job_admin_comment(job_id)
        except SlurmError:
            continue
        if text is not None:
            out[job_id] = text
    return out


def load_report(accounting: Sequence[AccountingJob], history_path: Path | str, *, by: str, shards_per_gpu: int,
                now: float, start: str = "", end: str = "", slurm_backend: str = "",
                live_comments: Mapping[int, str] | None = None) -> Report:
    """Read the history for these jobs (accounting only, with the reason, when it cannot be read)."""
    live_comments = live_comments or {}
    ids = [j.job_id for j in accounting]
    comment_ids = [parse_admin_comment(j.admin_comment or live_comments.get(j.job_id, "")).get("id", "")
                   for j in accounting]
    error = ""
    try:
        hist = read_history(history_path, ids, [c for c in comment_ids if c])
    except HistoryUnavailable as exc:
        hist, error = HistorySnapshot(), str(exc)
    return build_report(accounting, hist, by=by, shards_per_gpu=shards_per_gpu, now=now, start=start, end=end,
                        history_path=str(history_path), history_error=error, slurm_backend=slurm_backend,
                        live_comments=live_comments)


# ============================================================================ rendering
def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, float):
        return round(value, 6)
    return value


def _row(obj: Any) -> dict[str, Any]:
    return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}


GROUP_COLUMNS = tuple(f.name for f in dataclasses.fields(GroupSummary))
JOB_COLUMNS = tuple(f.name for f in dataclasses.fields(JobReport))


def report_to_dict(rep: Report, *, with_jobs: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {
        "meta": {
            "by": rep.by, "start": rep.start, "end": rep.end, "generated_at": rep.generated_at,
            "generated_at_iso": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(rep.generated_at)),
            "shards_per_gpu": rep.shards_per_gpu, "slurm_backend": rep.slurm_backend,
            "history": {"path": rep.history_path, "available": not rep.history_error,
                        "error": rep.history_error or None},
            "non_gpu_jobs_skipped": rep.non_gpu_jobs, "definitions": "docs/reporting.md",
        },
        "groups": [_row(g) for g in rep.groups],
        "total": _row(rep.total),
    }
    if with_jobs:
        out["jobs"] = [_row(j) for j in rep.jobs]
    return out


def format_json(rep: Report, *, with_jobs: bool = False) -> str:
    return json.dumps(report_to_dict(rep, with_jobs=with_jobs), indent=2, sort_keys=False)


def format_csv(rep: Report, *, with_jobs: bool = False) -> str:
    """Groups plus a '(total)' row; with ``with_jobs``, one row per job instead."""
    buf = io.StringIO()
    if with_jobs:
        w = csv.DictWriter(buf, fieldnames=("group", *JOB_COLUMNS), lineterminator="\n")
        w.writeheader()
        for j in rep.jobs:
            w.writerow({"group": getattr(j, rep.by) or "(none)", **{k: _csv(v) for k, v in _row(j).items()}})
    else:
        w = csv.DictWriter(buf, fieldnames=("by", *GROUP_COLUMNS), lineterminator="\n")
        w.writeheader()
        for g in (*rep.groups, rep.total):
            w.writerow({"by": rep.by, **{k: _csv(v) for k, v in _row(g).items()}})
    return buf.getvalue()


def _csv(v: Any) -> Any:
    return "" if v is None else v


def fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 2 * HOUR_S:
        return f"{seconds / 60:.1f}m"
    if seconds < 48 * HOUR_S:
        return f"{seconds / HOUR_S:.1f}h"
    return f"{seconds / 86400:.1f}d"


def _gib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / GIB:.1f}G"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}%"


def _hours(x: float) -> str:
    return f"{x:.3f}" if x < 10 else f"{x:.1f}" if x < 1000 else f"{x:.0f}"


_TABLE = (  # header, width, cell
    ("jobs", 5, lambda g: str(g.jobs)),
    ("shared", 6, lambda g: str(g.shared_jobs)),
    ("whole", 5, lambda g: str(g.whole_gpu_jobs)),
    ("pend", 4, lambda g: str(g.not_started)),
    ("norec", 5, lambda g: str(g.no_record)),
    ("overr", 5, lambda g: str(g.overridden)),
    ("gpu_h", 8, lambda g: _hours(g.gpu_hours_used)),
    ("saved_h", 8, lambda g: _hours(g.gpu_hours_saved)),
    ("wait50", 6, lambda g: fmt_duration(g.wait_median_s)),
    ("waitmax", 7, lambda g: fmt_duration(g.wait_max_s)),
    ("obs", 4, lambda g: str(g.observed_jobs)),
    ("peakmax", 7, lambda g: _gib(g.observed_peak_max_bytes)),
    ("err50", 5, lambda g: _pct(g.abs_pct_error_median)),
    ("under", 5, lambda g: f"{g.under_predicted}/{g.predicted_jobs}"),
    ("oom", 3, lambda g: str(g.ooms)),
)


def format_table(rep: Report, *, with_jobs: bool = False) -> str:
    rows = [*rep.groups, rep.total]
    kw = max([len(rep.by), 9, *(len(g.key) for g in rows)])
    head = rep.by.upper().ljust(kw) + "  " + " ".join(h.rjust(w) for h, w, _ in _TABLE)
    lines = [f"swapaware report  {rep.start or '?'} .. {rep.end or 'now'}  by {rep.by}  "
             f"({rep.total.jobs} GPU jobs, {rep.non_gpu_jobs} non-GPU jobs skipped, "
             f"{rep.shards_per_gpu} shards/GPU)", head, "-" * len(head)]
    for g in rows:
        if g is rep.total:
            lines.append("-" * len(head))
        lines.append(g.key.ljust(kw) + "  " + " ".join(cell(g).rjust(w) for _, w, cell in _TABLE))
    lines += ["shared: < 1 GPU of shards; whole: gpu or all shards of one; pend: never started; norec: no decision;",
              "overr: allocation or AdminComment disagrees with the decision; gpu_h/saved_h: GPU-hours used/saved;",
              "wait: submit to start; err50: median |predicted-observed|/observed peak; under: observed > predicted",
              "+ margin / jobs compared; oom: OOMs observed. Definitions: swapaware report --help, docs/reporting.md"]
    if rep.total.whole_because:
        lines.append("whole-GPU decisions by reason: " + ", ".join(
            item.replace("=", " ") for item in rep.total.whole_because.split(";")))
    if rep.history_error:
        lines.append(f"WARNING: history not read ({rep.history_error}): accounting columns only")
    if with_jobs and rep.jobs:
        lines += ["", _format_jobs(rep)]
    return "\n".join(lines)


def _format_jobs(rep: Report) -> str:
    cols = (("job", 8), (rep.by, 10), ("state", 10), ("alloc", 9), ("action", 22), ("status", 35),
            ("gpu_h", 7), ("saved_h", 7), ("wait", 6), ("pred", 6), ("obs", 6), ("oom", 3))
    out = [" ".join(n.ljust(w) if i < 6 else n.rjust(w) for i, (n, w) in enumerate(cols))]
    for j in rep.jobs:
        alloc = f"shard:{j.shards}" if j.shards else (f"gpu:{j.gpus}" if j.gpus else "-")
        action = j.action + (f":{j.decided_shards}" if j.decided_shards else "") if j.action else "-"
        status = j.status.value + (f" {j.override_reason.value}" if j.override_reason else "")
        oom = "-" if j.oom is None else "yes" if j.oom else "no"
        cells = (str(j.job_id), getattr(j, rep.by) or "(none)", j.state[:10], alloc, action, status,
                 f"{j.gpu_hours_used:.3f}", f"{j.gpu_hours_saved:.3f}", fmt_duration(j.wait_s),
                 _gib(j.predicted_peak_bytes), _gib(j.observed_peak_bytes), oom)
        out.append(" ".join(c.ljust(w) if i < 6 else c.rjust(w) for i, (c, (_, w)) in enumerate(zip(cells, cols))))
    return "\n".join(out)


class PlotsUnavailable(ReportError):
    pass


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, or PlotsUnavailable saying how to install it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise PlotsUnavailable(f"--plot needs matplotlib, which is not installed ({exc}); "
                               "install it with: pip install 'swapaware[plots]'") from None
    return plt


def write_plots(out_dir: Path, rep: Report) -> list[Path]:
    """PNG plots: GPU-hours per group, job outcomes per group, predicted vs observed peak per job,
    queue wait per group. Needs matplotlib (``pip install 'swapaware[plots]'``)."""
    plt = pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    keys = [g.key for g in rep.groups]
    note = (f"swapaware report {rep.start or '?'} .. {rep.end or 'now'}, by {rep.by}, "
            f"{rep.total.jobs} GPU jobs, {rep.shards_per_gpu} shards/GPU")
    meta = {"Software": "swapaware report", "Description": note}
    written: list[Path] = []

    def save(fig: Any, name: str) -> None:
        fig.text(0.01, 0.005, note, fontsize=6)
        fig.tight_layout(rect=(0, 0.03, 1, 1))
        p = out_dir / name
        fig.savefig(p, dpi=110, metadata=meta)
        plt.close(fig)
        written.append(p)

    x = range(len(keys))
    width = max(6.0, 0.6 * len(keys) + 2)
    # 1. GPU-hours per group
    fig, ax = plt.subplots(figsize=(width, 4.5))
    shared = [g.gpu_hours_shared for g in rep.groups]
    whole = [g.gpu_hours_used - g.gpu_hours_shared for g in rep.groups]
    saved = [g.gpu_hours_saved for g in rep.groups]
    ax.bar(x, whole, label="used, whole GPUs")
    ax.bar(x, shared, bottom=whole, label="used, shards")
    ax.bar(x, saved, bottom=[a + b for a, b in zip(whole, shared)], label="saved (vs a whole GPU)", hatch="//",
           alpha=0.5)
    ax.set_xticks(list(x), keys, rotation=30, ha="right")
    ax.set_ylabel("GPU-hours")
    ax.set_title(f"GPU-hours by {rep.by}")
    ax.legend(fontsize=8)
    save(fig, "gpu_hours.png")
    # 2. job outcomes per group
    fig, ax = plt.subplots(figsize=(width, 4.5))
    series = (("shared", [g.shared_jobs for g in rep.groups]), ("whole GPU", [g.whole_gpu_jobs for g in rep.groups]),
              ("never started", [g.not_started for g in rep.groups]))
    n = len(series) + 2
    bw = 0.8 / n
    extra = (("no swapaware record", [g.no_record for g in rep.groups]),
             ("overridden", [g.overridden for g in rep.groups]))
    for i, (label, ys) in enumerate((*series, *extra)):
        ax.bar([xi - 0.4 + bw * (i + 0.5) for xi in x], ys, bw, label=label)
    ax.set_xticks(list(x), keys, rotation=30, ha="right")
    ax.set_ylabel("jobs")
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.set_title(f"GPU jobs by {rep.by}")
    ax.legend(fontsize=8)
    save(fig, "jobs.png")
    # 3. predicted vs observed peak per job
    fig, ax = plt.subplots(figsize=(5.5, 5.5))
    pts = [j for j in rep.jobs if j.predicted_peak_bytes is not None and j.observed_peak_bytes is not None]
    if pts:
        for flag, label, marker in ((False, "within margin", "o"), (True, "under-predicted, no OOM", "x")):
            sel = [j for j in pts if bool(j.under_predicted) is flag and not j.oom]
            ax.scatter([j.observed_peak_bytes / GIB for j in sel], [j.predicted_peak_bytes / GIB for j in sel],
                       marker=marker, label=f"{label} ({len(sel)})")
        ooms = [j for j in pts if j.oom]
        if ooms:
            ax.scatter([j.observed_peak_bytes / GIB for j in ooms], [j.predicted_peak_bytes / GIB for j in ooms],
                       marker="s", facecolors="none", edgecolors="red", label=f"OOM ({len(ooms)})")
        hi = max(max(j.observed_peak_bytes, j.predicted_peak_bytes) for j in pts) / GIB * 1.05
        ax.plot([0, hi], [0, hi], color="grey", lw=0.8, label="predicted = observed")
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no job with both a prediction and an observed peak", ha="center", va="center",
                transform=ax.transAxes, fontsize=9)
    ax.set_xlabel("observed peak GPU memory (GiB)")
    ax.set_ylabel("predicted peak GPU memory (GiB)")
    ax.set_title("predicted vs observed peak")
    save(fig, "memory_pred_vs_obs.png")
    # 4. queue wait per group
    fig, ax = plt.subplots(figsize=(width, 4.5))
    waits = [[j.wait_s / 60 for j in rep.jobs if (getattr(j, rep.by) or "(none)") == k and j.wait_s is not None]
             for k in keys]
    if any(waits):
        ax.boxplot([w or [0.0] for w in waits])
        ax.set_xticks([i + 1 for i in x], keys, rotation=30, ha="right")
    else:
        ax.text(0.5, 0.5, "no started job", ha="center", va="center", transform=ax.transAxes)
    ax.set_ylabel("queue wait, submit to start (min)")
    ax.set_title(f"queue wait by {rep.by}")
    save(fig, "queue_wait.png")
    return written


# ============================================================================ command
_HELP = """Accounting joined with swapaware's history, per user, account or partition.

\b
Reads accounting (pyslurm's db API where its version matches the cluster, else
`sacct --json -X --allusers`; run it as root or a Slurm operator to see every user's jobs)
and the service's history database (cfg service.db_path, opened read-only). Only GPU jobs
are counted: jobs whose requested or allocated TRES hold gres/gpu or gres/shard, or that
carry a swapaware decision.

\b
Definitions (docs/reporting.md has the details and the caveats):
  shared        allocated TRES hold k gres/shard, k < shards_per_gpu (part of one GPU)
  whole         allocated TRES hold gres/gpu, or all shards of a GPU (how swapaware holds
                a whole-GPU decision when policy.whole_gpu_as_shards is on)
  pend          the job never started (nothing allocated); not judged
  gpu_h         elapsed x (gpus + shards/shards_per_gpu); running jobs up to now;
                whole jobs that overlap the window, not clipped to it
  saved_h       jobs that asked for one whole GPU (the decision's recorded facts) but
                ran on k shards: elapsed x (1 - k/shards_per_gpu). An upper bound when
                sharing slowed the job down (the whole-GPU run might have been shorter)
  wait          start - submit, started jobs only
  err50         median of |predicted - observed| / observed over jobs that have both the
                decision's predicted peak and an observed peak (NVML)
  under         jobs whose observed peak exceeded predicted peak + margin / jobs compared
  oom           observations that detected an out-of-memory
  overr         swapaware decided, but the allocation disagrees with it (decided k
                shards, ran on a gpu or on another number of shards; decided a whole
                gpu, ran on shards) or the AdminComment was edited, replaced or removed
                after the decision
  norec         GPU job without a swapaware decision (service down: failed open; plugin
                disabled; submitted before swapaware)
  whole_because whole-GPU decisions by the reason code that kept them whole (no_history,
                queue_short, compute_bound, protected_qos, oom_penalty, too_large_to_share,
                ...): the line under the table, and a column in JSON/CSV
  not judged    slurmdbd stores AdminComment only when a job ends: for running and
                pending jobs it is read from slurmctld (--live-lookups); a job that never
                started is not compared with an allocation

\b
Time formats are sacct's: 2026-05-01, 2026-05-01T08:00, now-7days, now-12hours.
GPU-hours use shards_per_gpu = gpu.shards_per_gpu of the config (it must match gres.conf).
"""


@click.command("report", help=_HELP)
@click.option("--start", default="now-7days", show_default=True, help="Window start (sacct -S).")
@click.option("--end", default="now", show_default=True, help="Window end (sacct -E).")
@click.option("--by", type=click.Choice(GROUP_KEYS), default="user", show_default=True, help="Group rows by.")
@click.option("--format", "fmt", type=click.Choice(("table", "json", "csv")), default="table", show_default=True)
@click.option("--jobs", "with_jobs", is_flag=True,
              help="Also list every job (table), add a 'jobs' array (json), or one row per job (csv).")
@click.option("--plot", "plot_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Write PNG plots into this folder (needs matplotlib: pip install 'swapaware[plots]').")
@click.option("--slurm-timeout", type=float, default=120.0, show_default=True,
              help="Seconds allowed for the accounting query.")
@click.option("--live-lookups", type=int, default=LIVE_LOOKUP_MAX, show_default=True,
              help="Unfinished GPU jobs whose AdminComment is read from slurmctld (accounting has it "
                   "only once a job ends); the rest are not judged.")
@click.option("--config", type=click.Path(dir_okay=False), help="TOML config (default: $SWAPAWARE_CONFIG).")
def report_command(start: str, end: str, by: str, fmt: str, with_jobs: bool, plot_dir: Path | None,
                   slurm_timeout: float, live_lookups: int, config: str | None) -> None:
    try:
        cfg: Config = load_config(Path(config) if config else None)
    except ConfigError as exc:
        raise click.ClickException(f"configuration: {exc}") from None
    if plot_dir is not None:  # fail before the (possibly slow) accounting query
        try:
            pyplot()
        except PlotsUnavailable as exc:
            raise click.ClickException(str(exc)) from None
    try:
        slurm = open_slurm(cfg.service.slurm_backend, slurm_timeout,
                           cluster_release(cfg.service.slurm_release, slurm_timeout))
        accounting = slurm.accounting_jobs(start=start, end=end)
    except SlurmError as exc:
        raise click.ClickException(f"accounting: {exc}") from None
    live = live_admin_comments(slurm, accounting, live_lookups)
    rep = load_report(accounting, cfg.service.db_path, by=by, shards_per_gpu=cfg.gpu.shards_per_gpu,
                      now=time.time(), start=start, end=end, slurm_backend=type(slurm).__name__,
                      live_comments=live)
    if rep.history_error:
        click.echo(f"swapaware report: WARNING: {rep.history_error}; showing accounting only", err=True)
    if fmt == "json":
        click.echo(format_json(rep, with_jobs=with_jobs))
    elif fmt == "csv":
        click.echo(format_csv(rep, with_jobs=with_jobs), nl=False)
    else:
        click.echo(format_table(rep, with_jobs=with_jobs))
    if plot_dir is not None:
        try:
            paths = write_plots(plot_dir, rep)
        except PlotsUnavailable as exc:
            raise click.ClickException(str(exc)) from None
        click.echo(f"wrote {', '.join(str(p) for p in paths)}", err=True)


if __name__ == "__main__":  # python -m policy_service.report
    report_command()
