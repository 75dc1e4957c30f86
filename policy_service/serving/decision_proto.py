"""Decisions and job facts between the core's values and the wire's messages: the reply's
``pb.Decision``, the rewrite's present fields, and the record the history keeps."""
from __future__ import annotations

import dataclasses
from typing import Callable

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.history.journal_records import DecisionRecord
from policy_service.core.types import Action, Decision, EstimateSource, JobRequest, Rewrite
from policy_service.trust.proto_bounds import i32, u32, u64

_SOURCE = {src: pb.EstimateSource.Value(f"ESTIMATE_SOURCE_{src.name}") for src in EstimateSource}
_ACTION = {
    Action.PASS_THROUGH: pb.ACTION_PASS_THROUGH,
    Action.WHOLE_GPU: pb.ACTION_WHOLE_GPU,
    Action.SHARE: pb.ACTION_SHARE,
    Action.SHARE_OVERSUBSCRIBED: pb.ACTION_SHARE_OVERSUBSCRIBED,
}


def gres_fields(job: pb.JobFacts) -> dict[str, str]:
    return {"tres_per_node": job.tres_per_node, "tres_per_job": job.tres_per_job,
            "tres_per_task": job.tres_per_task, "tres_per_socket": job.tres_per_socket}


def is_batch(job: pb.JobFacts) -> bool:
    """Whether the job has a batch script; facts from a client that does not say count as batch."""
    return job.is_batch if job.HasField("is_batch") else True


def decision_to_proto(d: Decision) -> pb.Decision:
    est = d.estimate
    msg = pb.Decision(  # figures saturated: whatever the history held, the reply can be built
        decision_id=d.decision_id, model_version=d.model_version, action=_ACTION[d.action], shards=u32(d.shards),
        site_factor=i32(d.site_factor), job_class=d.job_class, decided_at=d.decided_at, mode=d.mode.value,
        estimate=pb.DemandEstimate(peak_bytes=u64(est.peak_bytes), margin_bytes=u64(est.margin_bytes),
                                   source=_SOURCE[est.source],
                                   samples=u32(est.samples), observed_max_bytes=u64(est.observed_max_bytes)),
        swap_cost=pb.SwapCostEstimate(slowdown=d.swap_slowdown, offloaded_bytes=u64(d.offloaded_bytes), risk=d.risk),
        reasons=[pb.Reason(code=r.code.value, message=r.message) for r in d.reasons],
    )
    msg.rewrite.CopyFrom(rewrite_to_proto(d.rewrite))
    return msg


def brief_decision_to_proto(d: Decision) -> pb.Decision:
    """What a brief Admit answers (the plugin's fast path): id, action, shards, rewrite."""
    return pb.Decision(decision_id=d.decision_id, action=_ACTION[d.action], shards=d.shards,
                       rewrite=rewrite_to_proto(d.rewrite))


# the rewrite's fields as its message lists them (by number) with their proto3 JSON names
_REWRITE_JSON = tuple((f.name, f.json_name) for f in sorted(pb.JobRewrite.DESCRIPTOR.fields, key=lambda f: f.number))
_ACTION_NAME = {number: pb.Action.Name(number) for number in _ACTION.values()}
_UINT32, _INT32 = range(2**32), range(-2**31, 2**31)


def brief_reply_dict(d: Decision) -> dict | None:
    """``json_codec.to_dict(pb.AdmitResponse(decision=brief_decision_to_proto(d)))``, made from the
    decision without the messages (a decision decided afresh: a new class's brief reply); None
    where a message would not take a value as it is (out of range, not UTF-8): made through it."""
    out: dict = {}
    if d.decision_id:
        if not _text(d.decision_id):
            return None
        out["decisionId"] = d.decision_id
    action = _ACTION[d.action]
    if action:
        out["action"] = _ACTION_NAME[action]
    if d.shards:
        if type(d.shards) is not int or d.shards not in _UINT32:
            return None
        out["shards"] = d.shards
    rewrite = out["rewrite"] = {}
    for name, json_name in _REWRITE_JSON:
        v = getattr(d.rewrite, name)
        if v is None:
            continue
        if not (_text(v) if name != "site_factor" else type(v) is int and v in _INT32):
            return None
        rewrite[json_name] = v
    return {"decision": out}


def _text(v) -> bool:
    """Whether a string field takes ``v`` as it is (a str of UTF-8 characters: no lone surrogate)."""
    if type(v) is not str:
        return False
    if v.isascii():
        return True
    try:
        v.encode()
    except UnicodeEncodeError:
        return False
    return True


def brief_line(slot: list, d: Decision, encode: Callable[[pb.AdmitResponse | dict], bytes]) -> bytes:
    """``encode`` of the brief reply of ``d`` (given its proto3 JSON dict, brief_reply_dict, where
    that makes it), a decision of the memo entry (PolicyHandler._decide_made:
    one template, each decision its own id) whose ``slot`` this is: the line made for its first
    decision is cut at that decision's id (in decisionId and in the AdminComment's id=), and later
    ones are the pieces joined with their own id. ``slot[0]``: None until then; () where that id
    showed elsewhere too, or an id needs escaping (made afresh)."""
    d_id, pieces = d.decision_id, slot[0]
    plain = d_id.isascii() and d_id.isalnum()  # written as it is in JSON, next to no other letter or digit
    if pieces and plain:
        return d_id.encode().join(pieces)
    reply = brief_reply_dict(d)
    line = encode(reply if reply is not None else pb.AdmitResponse(decision=brief_decision_to_proto(d)))
    if pieces is None:
        parts = tuple(line.split(d_id.encode())) if plain else ()
        slot[0] = parts if len(parts) == 2 + (d.rewrite.admin_comment is not None) else ()
    return line


_REWRITE_FIELDS = tuple(f.name for f in dataclasses.fields(Rewrite))


def rewrite_to_proto(rewrite: Rewrite) -> pb.JobRewrite:
    """Only the fields the decision sets are present (None = leave the job's field alone)."""
    return pb.JobRewrite(**{name: v for name in _REWRITE_FIELDS if (v := getattr(rewrite, name)) is not None})


def decision_record(d: Decision, jr: JobRequest, keys, job: pb.JobFacts,
                    decision_pb: bytes | None = None) -> DecisionRecord:
    """A decision as the history records it. ``decision_pb``: its message's bytes, already made
    (``with_id_bytes``)."""
    return DecisionRecord(
        decision_id=d.decision_id, decided_at=d.decided_at, job_class=d.job_class, user=jr.user,
        account=jr.account, partition=jr.partition, job_name=jr.job_name, action=d.action.value,
        shards=d.shards, model_version=d.model_version, keys={k.value: v for k, v in keys.items()},
        facts_pb=job.SerializeToString(),
        decision_pb=decision_to_proto(d).SerializeToString() if decision_pb is None else decision_pb)


def with_id_bytes(template_pb: bytes, d: Decision) -> bytes:
    """``decision_to_proto(d).SerializeToString()`` for a decision that differs from the one
    ``template_pb`` holds only in its id, time and AdminComment (PolicyHandler._decide's template
    with the id put in): the message is read back and those three set, not built field by field."""
    msg = pb.Decision.FromString(template_pb)
    msg.decision_id = d.decision_id
    msg.decided_at = d.decided_at
    if d.rewrite.admin_comment is not None:
        msg.rewrite.admin_comment = d.rewrite.admin_comment
    return msg.SerializeToString()
