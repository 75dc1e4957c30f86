"""The accounting join: each accounting job with the service's history (its decision, its
observations) and, for unfinished jobs, slurmctld's AdminComment; judged against its allocation.
``read_history`` reads the jobs' records from the history (read-only; the shared runs:
interference.py)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from policy_service.history.store import HistoryUnreadable, ReadOnlyHistory
from policy_service.slurm.slurm import AccountingJob, SlurmAccess, SlurmError
from policy_service.core.policy import parse_admin_comment
from policy_service.core.request import RequestError, gpu_request
from policy_service.core.types import Action, GresKind, ReasonCode
from policy_service.report.model import HOUR_S, HistoryDecision, HistoryObservation, HistorySnapshot, HistoryUnavailable, JobReport, LIVE_LOOKUP_MAX, OverrideReason, RecordStatus, SHARED_ACTIONS, STALE_OBSERVATION_S, TresCounts

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
        mode = str(decision.get("mode") or "")
    except (json.JSONDecodeError, AttributeError):
        est, codes, mode = {}, [], ""
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
                           asked_kind=asked_kind, asked_gpus=asked_gpus, whole_because=whole_because(action, codes),
                           mode=mode)


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
    if comment.get("mode") == "shadow" or (hist is not None and hist.mode == "shadow"):
        action = Action.PASS_THROUGH.value  # shadow mode: the job was left as submitted
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
             live_comment: str | None = None, shard_bytes: int = 0) -> JobReport | None:
    """Join one accounting job with the history. None for a job that is not a GPU job (asked for
    and got no gpu/shard and carries no swapaware record).

    ``live_comment``: the AdminComment read from slurmctld for a job that has not ended (its
    accounting record has none yet); None when it was not looked up. ``shard_bytes``: one shard's
    memory (0: unknown, and a shadow decision's would-be OOM is not judged)."""
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
    shadow = comment_fields.get("mode") == "shadow" or (d is not None and d.mode == "shadow")
    would_share = shadow and started and asked_one_gpu and action in SHARED_ACTIONS and 0 < (decided_k or 0) < spg
    freed_h = elapsed / HOUR_S * (1.0 - (decided_k or 0) / spg) if would_share else 0.0
    would_oom = (observed > (decided_k or 0) * shard_bytes) if would_share and observed and shard_bytes else None
    return JobReport(
        job_id=job.job_id, user=job.user, account=job.account, partition=job.partition, job_name=job.job_name,
        state=job.state, started=started, elapsed_s=elapsed, wait_s=wait, gpus=gpus, shards=shards,
        shared=shared, whole_gpu=whole,
        decision_id=decision_id, action=action, decided_shards=decided_k,
        whole_because=d.whole_because if d is not None else "", in_history=d is not None,
        status=status, override_reason=why, gpu_hours_used=used_h, gpu_hours_saved=saved_h,
        predicted_peak_bytes=predicted, margin_bytes=margin, observed_peak_bytes=observed,
        oom=None if o is None else o.oom, abs_pct_error=err, under_predicted=under,
        shadow=shadow, shadow_would_share=would_share, shadow_gpu_hours_freed=freed_h, shadow_would_oom=would_oom)


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
