"""PolicyHandler's event path: JobStarted, JobFinished and ReportEvents applied to the history
(events.EventApplier), after the decisions handed out so far are in it; the nodes' reported GPU
memory enforcement noted first.

``EventPath`` is mixed into PolicyHandler (handler.py), whose __init__ sets what it reads (events,
node_enforcement, clock) and which has ``flush``.
"""
from __future__ import annotations

import grpc

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.core.enforcement import NodeReport
from policy_service.serving.handler_error import HandlerError

# google.rpc code number -> status (an EventResult's code back into a status for the single-event RPCs)
_STATUS = {c.value[0]: c for c in grpc.StatusCode}


class EventPath:
    """PolicyHandler's JobStarted / JobFinished / ReportEvents."""

    def _note_enforcement(self, events) -> None:
        for e in events:
            if e.WhichOneof("event") == "started" and e.started.HasField("enforcement"):
                n = e.started.enforcement
                self.node_enforcement.record(NodeReport(e.started.node, n.backend, n.hard_cap, n.victim,
                                                        e.started.started_at or self.clock()))

    def _one_event(self, event: pb.JobEvent) -> pb.EventResult:
        self._note_enforcement([event])
        self.flush()  # decisions handed out so far are in the history before events name them
        (result,) = self.events.apply([event])
        if result.code:
            raise HandlerError(_STATUS.get(result.code, grpc.StatusCode.INTERNAL), result.message)
        return result

    def job_started(self, req: pb.JobStartedRequest) -> pb.JobStartedResponse:
        return pb.JobStartedResponse(decision_id=self._one_event(pb.JobEvent(started=req)).decision_id)

    def job_finished(self, req: pb.JobFinishedRequest) -> pb.JobFinishedResponse:
        result = self._one_event(pb.JobEvent(finished=req))
        return pb.JobFinishedResponse(applied=result.applied, decision_id=result.decision_id)

    def report_events(self, req: pb.ReportEventsRequest) -> pb.ReportEventsResponse:
        """A batch of events (a node agent's spool): applied in order, each once, all job ids
        resolved with one Slurm query; one result per event, a bad one never failing the rest."""
        self._note_enforcement(req.events)
        self.flush()
        return pb.ReportEventsResponse(results=self.events.apply(req.events))
