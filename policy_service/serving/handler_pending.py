"""PolicyHandler's new decisions for jobs already decided: a pending job kept whole that would now
share (serving/redecide.py), and a whole-GPU decision for a job requeued after a shared run ran out
of GPU memory (slurm/requeue.py). Nothing is recorded until the caller adopts it.

``Redeciding`` is mixed into PolicyHandler (handler.py), whose __init__ sets what it reads (mode,
store, learned) and which has ``flush``, ``_decide`` (handler_decide.Deciding) and ``_record``
(handler_admit.Admitting).
"""
from __future__ import annotations

import dataclasses

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.config import PolicyMode
from policy_service.core import policy
from policy_service.core.types import Action, Decision, JobRequest, KeyLevel, Reason
from policy_service.serving.handler_error import HandlerError


@dataclasses.dataclass(frozen=True)
class PendingRedecision:
    decision: Decision
    request: JobRequest
    keys: dict[KeyLevel, str]
    facts: pb.JobFacts
    replaces: str  # the id of the pending job's previous decision


class Redeciding:
    """PolicyHandler's re-decisions of pending and requeued jobs."""

    def whole_decision_keys(self, admin_comment: str) -> tuple[str, dict] | None:
        """(decision id, history keys) when a job's record (its AdminComment) is a whole-GPU
        decision of this service; None otherwise."""
        d_id = policy.parse_admin_comment(admin_comment).get("id", "")
        if not d_id:
            return None
        self.flush()
        row = self.store.decision(d_id)
        if row is None or row.action != Action.WHOLE_GPU.value:
            return None
        return d_id, row.keys

    def knowledge(self, keys: dict) -> int:
        """Observations this process has learned under a job's ``policy.REDECIDE_KEYS``: when it
        changes, a re-decision may differ."""
        return sum(self.learned[keys[level]] for level in policy.REDECIDE_KEYS if level in keys)

    def redecide(self, d_id: str) -> PendingRedecision | None:
        """A new decision for a pending job kept whole by decision ``d_id``, when it would now
        share; None otherwise. Nothing is recorded until ``adopt``."""
        row = self.store.decision(d_id)
        if self.mode is not PolicyMode.ENFORCE or row is None or row.action != Action.WHOLE_GPU.value:
            return None  # shadow: a pending job is never rewritten
        facts = row.facts
        try:
            d, jr, keys = self._decide(facts, replaces=d_id)
        except HandlerError:
            return None
        if not policy.replaces_pending(row.action, d):
            return None
        return PendingRedecision(d, jr, keys, facts, d_id)

    def adopt(self, r: PendingRedecision) -> None:
        """Record a re-decision once Slurm holds it."""
        self._record(r.decision, r.request, r.keys, r.facts)

    def decide_facts(self, facts: pb.JobFacts, replaces: str, whole_because: Reason):
        """A new whole-GPU decision for a job already decided (a requeue after an OOM, slurm/
        requeue.py): (decision, request, history keys); recorded by ``record_decision``."""
        return self._decide(facts, replaces=replaces, whole_because=whole_because)

    def record_decision(self, d: Decision, jr, keys, facts: pb.JobFacts) -> None:
        self._record(d, jr, keys, facts)
