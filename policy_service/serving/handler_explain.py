"""PolicyHandler's Explain: a what-if (job facts, answered as a dry-run Admit) or a recorded decision
(by job id, through its newest instance in Slurm, or by decision id) with its facts and
observations, each shown only to whom the authorizer lets see it.

``Explaining`` is mixed into PolicyHandler (handler.py), whose __init__ sets what it reads (store,
correlation, authorizer) and which has ``flush`` and ``admit`` (handler_admit.Admitting).
"""
from __future__ import annotations

import grpc

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.core.interference_learn import Source
from policy_service.core.interference_rule import model_line
from policy_service.trust.authz import Owner
from policy_service.serving.events import MAX_JOB_ID
from policy_service.serving.handler_error import HandlerError
from policy_service.trust.proto_bounds import observation_to_proto


INTERFERENCE_MODEL = "interference_model"  # Explain's line on the models (not a decision's reason)


class Explaining:
    """PolicyHandler's Explain."""

    def _decision_id_for_job(self, job_id: int) -> str:
        """The decision of the job that has this id now (its newest instance in Slurm)."""
        self.flush()
        return self.correlation.current_decision(job_id)

    def explain(self, req: pb.ExplainRequest, caller=None) -> pb.ExplainResponse:
        """Job facts (a what-if) are explained to anyone (in full to the job's user and admins, else
        only the action and shard count); a recorded decision only to whom ``self.authorizer`` lets
        see it (``caller``: None, from inside the service: all)."""
        which = req.WhichOneof("target")
        if which == "job":
            out = pb.ExplainResponse(decision=self.admit(pb.AdmitRequest(job=req.job, dry_run=True), caller).decision,
                                     job=req.job)
            if out.decision.reasons:  # the full answer (a stranger's is the action and shards alone)
                out.decision.reasons.append(self._interference_reason())
            return out
        self._may_explain(caller, None)
        job_id = 0
        if which == "job_id":
            job_id = req.job_id
            if job_id > MAX_JOB_ID:
                raise HandlerError(grpc.StatusCode.INVALID_ARGUMENT, f"{job_id} is not a Slurm job id")
            d_id = self._decision_id_for_job(job_id)
            if not d_id:
                raise HandlerError(grpc.StatusCode.NOT_FOUND, f"no swapaware decision is known for job {job_id}")
        elif which == "decision_id":
            d_id = req.decision_id
        else:
            raise HandlerError(grpc.StatusCode.INVALID_ARGUMENT, "give a job_id, a decision_id or job facts")
        self.flush()
        row = self.store.decision(d_id)
        if row is None:
            if self.store.decision_status(d_id) == "never_held":
                raise HandlerError(grpc.StatusCode.NOT_FOUND, f"decision {d_id!r} was never held by a job in Slurm "
                                   "(a --test-only submission, a job refused after the plugin ran, or an answer "
                                   "slurmctld stopped waiting for): its record was deleted")
            raise HandlerError(grpc.StatusCode.NOT_FOUND, f"decision {d_id!r} is not in the history")
        self._may_explain(caller, row.facts)
        out = pb.ExplainResponse(job_id=job_id)
        out.decision.CopyFrom(row.decision)
        if self.store.decision_status(d_id) == "never_held":
            out.decision.reasons.add(code="never_held", message="no job in Slurm ever held this decision (the job "
                                     "was refused after the plugin ran, or slurmctld stopped waiting for the answer)")
        out.decision.reasons.append(self._interference_reason())
        out.job.CopyFrom(row.facts)
        out.observations.extend(observation_to_proto(o) for o in self.store.observations(decision_id=d_id))
        return out

    def _interference_reason(self) -> pb.Reason:
        """The site's interference models now (the one a decision used, where it bound, is in its
        own reasons): which, and from how many shared runs."""
        view = self.interference.view
        learned = [f"{t}: {m.reason}" for t, m in view.by_type if m.source is Source.LEARNED]
        return pb.Reason(code=INTERFERENCE_MODEL, message=f"now: {model_line(view.pooled)}" +
                         "".join(f"; {line}" for line in learned))

    def _may_explain(self, caller, facts: pb.JobFacts | None) -> None:
        if caller is None or self.authorizer is None:
            return
        v = self.authorizer.explain(caller, None if facts is None else Owner(facts.uid, facts.user))
        if not v.allowed:
            raise HandlerError(v.code or grpc.StatusCode.PERMISSION_DENIED, f"Explain refused: {v.reason}")
