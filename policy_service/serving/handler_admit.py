"""The Admit path of PolicyHandler: the reply (enforce, shadow, off; a dry run for a caller that is
not slurmctld, shown in full only to the job's user and admins), and the decision journaled before
Admit answers (``_record``, also used by re-decisions and requeues).

``Admitting`` is mixed into PolicyHandler (handler.py), whose __init__ sets what it reads (mode,
metrics, queue, authorizer, decisions, _decision_counters) and which has ``_decide_made``
(handler_decide.Deciding).
"""
from __future__ import annotations

import logging
from typing import Callable

import grpc

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.history.decision_log import JournalError
from policy_service.history.journal_records import NoteText, RecordText
from policy_service.trust.authz import Owner
from policy_service.config import PolicyMode
from policy_service.core.mode import apply_mode
from policy_service.core.types import Decision, JobRequest, ReasonCode, copied
from policy_service.serving.decision_proto import (brief_decision_to_proto, brief_line, brief_reply_dict,
                                                   decision_record, decision_to_proto, with_id_bytes)
from policy_service.serving.handler_error import HandlerError

log = logging.getLogger("swapaware.decisions")


def _note(d: Decision, jr: JobRequest) -> dict:
    """What the writer logs of a decision once it is in the history (``decision {json}``)."""
    return {"decision_id": d.decision_id, "model_version": d.model_version, "user": jr.user, "job_name": jr.job_name,
            "request": jr.gpu.raw, "action": d.action.value, "shards": d.shards, "mode": d.mode.value,
            "site_factor": d.site_factor, "peak_bytes": d.estimate.peak_bytes,
            "reasons": [r.code.value for r in d.reasons]}


class Admitting:
    """PolicyHandler's Admit and the recording of its decisions."""

    def _record(self, d: Decision, jr, keys, job: pb.JobFacts, made: tuple | None = None) -> None:
        """Durable before it returns (HandlerError UNAVAILABLE when it cannot be). ``made``: the memo
        entry ``d`` was made from as it is (_decide_made), whose template's message it records with
        the id, the time and the AdminComment put in."""
        try:
            if made is not None:
                # the template's record, message, journal text and log note, made once: each Admit
                # puts its id and time in (the same record, bytes and note as made afresh)
                slot = made[3]
                if slot[0] is None:
                    template = made[2]
                    rec = decision_record(template, jr, keys, job)
                    slot[:] = [rec, RecordText(rec), _note(template, jr)]
                    slot.append(NoteText(slot[2]))
                rec, text, note, note_text = slot
                decision_pb = with_id_bytes(rec.decision_pb, d)
                rec = copied(rec, decision_id=d.decision_id, decided_at=d.decided_at, decision_pb=decision_pb)
                self.decisions.record(rec, note=note_text.text(d.decision_id) if note_text.usable else
                                      {**note, "decision_id": d.decision_id},
                                      data=text.encode(d.decision_id, d.decided_at, decision_pb) if text.usable else None)
            else:
                self.decisions.record(decision_record(d, jr, keys, job), note=_note(d, jr))
        except JournalError as exc:
            log.error("decision %s not made: %s", d.decision_id, exc)
            raise HandlerError(grpc.StatusCode.UNAVAILABLE, f"the decision cannot be recorded: {exc}") from None

    # ------------------------------------------------------------------ Admit
    def admit(self, req: pb.AdmitRequest, caller=None, encode: Callable[[pb.AdmitResponse | dict], bytes] | None = None):
        """``caller`` (policy_service.trust.authz.Caller, from a transport): an Admit that is not
        slurmctld's is answered as a dry run, recorded nowhere, with a reason saying so. ``encode``
        (the local socket's reply line): ``encode(reply)`` is returned instead of the reply; a
        remembered decision's brief reply is then its template's line with the id put in, and a
        recorded brief reply is given to it as its proto3 JSON dict (brief_reply_dict) where that
        makes it."""
        job = req.job
        mode = self.mode
        if req.HasField("plugin"):
            for why in ("breaker_open", "service_error"):
                self.metrics.plugin_report(req.plugin.instance, why, getattr(req.plugin, why))
        if mode is PolicyMode.OFF and not req.dry_run:
            reply = pb.AdmitResponse(decision=pb.Decision(
                action=pb.ACTION_PASS_THROUGH, mode=mode.value,
                reasons=[pb.Reason(code=ReasonCode.MODE_OFF.value, message="policy.mode = off: the job passes "
                                                                           "unchanged, nothing is decided")]))
            return reply if encode is None else encode(reply)
        dry_run_why = self._not_slurmctld(caller) if not req.dry_run else None
        if req.plugin.started_at and dry_run_why is None and not req.dry_run and self.queue is not None:
            self.queue.slurmctld_started(req.plugin.instance, req.plugin.started_at)  # slurmctld's alone
        made_d, jr, keys, made = self._decide_made(job)
        d = apply_mode(made_d, mode, self.cfg.policy.admin_comment_max_chars)
        recorded = not req.dry_run and dry_run_why is None
        if recorded:
            # enforce (the decision as made): its record's message is the template's with the id, the
            # time and the AdminComment put in (decision_proto.with_id_bytes)
            self._record(d, jr, keys, job, made if d is made_d else None)
            counted = (d.action.value, d.reasons[0].code.value if d.reasons else "", d.mode.value)
            counter = self._decision_counters.get(counted)
            if counter is None:
                counter = self._decision_counters[counted] = self.metrics.decisions.labels(
                    action=counted[0], reason=counted[1], mode=counted[2])
            counter.inc()
        if encode is not None and req.brief and recorded:
            if made is not None and d is made_d:
                return brief_line(made[4], d, encode)
            reply = brief_reply_dict(d)  # (decided afresh: its JSON made without the messages)
            if reply is not None:
                return encode(reply)
        if req.brief:  # the full message is built by the writer, off this path
            reply = pb.AdmitResponse(decision=brief_decision_to_proto(d))
        else:
            reply = pb.AdmitResponse(decision=decision_to_proto(d))
        if req.dry_run or dry_run_why is not None:
            reply.decision.CopyFrom(self._shown(reply.decision, job, caller))
        if dry_run_why is not None:
            reply.decision.reasons.add(code=ReasonCode.DRY_RUN_NOT_SLURMCTLD.value, message=dry_run_why)
        return reply if encode is None else encode(reply)

    def _shown(self, decision: pb.Decision, job: pb.JobFacts, caller) -> pb.Decision:
        """A decision that is nobody's record (a dry run, a what-if) in full to the job's user and
        admins; to anyone else only its action and shard count (and its id, never recorded): its
        estimate, reasons and rewrite tell what the model learned from other users' jobs."""
        if caller is None or self.authorizer is None:
            return decision
        if self.authorizer.explain(caller, Owner(job.uid, job.user)).allowed:
            return decision
        return pb.Decision(decision_id=decision.decision_id, action=decision.action, shards=decision.shards,
                           mode=decision.mode)

    def _not_slurmctld(self, caller) -> str | None:
        """Why an Admit from ``caller`` is answered as a dry run (None: it is recorded)."""
        if caller is None or self.authorizer is None:
            return None
        v = self.authorizer.admit(caller)
        if v.code is not None:
            raise HandlerError(v.code, f"Admit refused: {v.reason}")
        if v.allowed:
            return None
        return f"dry run, nothing recorded: only slurmctld's Admit is recorded, and {v.reason}"
