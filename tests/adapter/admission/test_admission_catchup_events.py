"""Catch-up of table-made decisions, hook events: JobStarted and JobFinished for a job the plugin
decided from the table, before any poll saw it, tie to its caught-up decision; an event waits for the
decision a queue poll recorded a moment before (recorded once, tied to it).

The stand-in, fixtures and helpers (CommentsCli, svc, table...) are test_admission_catchup.py's."""
from __future__ import annotations

import threading

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.admission.catchup import AdmissionCatchup
from policy_service.history.decision_log import DecisionLog
from policy_service.slurm.slurm_text import JobInstance

from tests.adapter.admission.test_admission_catchup import (SUBMIT, CommentsCli, catchup_of, caught,  # noqa: F401
                                                            job, lua_id, made_comment, rows, svc, table)  # (fixtures)


# ----------------------------------------------------------------------------- events
def test_an_observation_of_a_table_made_job_ties_to_the_caught_up_decision(svc, table, slurm_jobs):
    """JobStarted and JobFinished for a job the plugin decided from the table, before any poll saw
    it: the event's job is caught up first, and the run and the observation name its decision."""
    archive, ref, tpl = table
    h = svc.handler
    h.correlation.catch_up = catchup_of(svc, archive, CommentsCli()).of_instances
    d_id = lua_id(6)
    slurm_jobs.comments[101] = made_comment(tpl, d_id)  # what slurmctld holds: the plugin's AdminComment
    started = h.job_started(pb.JobStartedRequest(job_id=101, node="n1", gpu_indices=[0], started_at=1000.0,
                                                 event_id="s101"))
    assert started.decision_id == d_id
    fin = h.job_finished(pb.JobFinishedRequest(job_id=101, node="n1", gpu_indices=[0], finished_at=1100.0,
                                               event_id="f101", peak_gpu_bytes=3 << 30, telemetry_source="fake-nvml"))
    assert fin.applied and fin.decision_id == d_id
    (obs,) = svc.store.observations(decision_id=d_id)
    assert obs.job_id == 101
    row = svc.store.decision(d_id)
    assert row.decided_at == slurm_jobs.submits[101][1] and row.facts.uid == 1000  # the template's (no uid here)
    assert caught(h.metrics, "event") == 1
    assert rows(svc.store, d_id) == 1
    # the class learned from the run, as from any decision's
    assert svc.store.stats({k: v for k, v in row.keys.items()})


def test_an_event_waits_for_the_decision_a_queue_poll_recorded_a_moment_before(svc, table):
    """The queue poll records a table-made decision and the writer has not committed it yet when a
    hook event names the job: the event's catch-up knows the id (it is not recorded twice) and
    still waits until the history holds it, so that the observation ties to it (a fresh-clone run
    on 22.05 tied a table-made job's observation to no decision)."""
    archive, ref, tpl = table
    committed = threading.Event()

    def held_write(records):  # the writer thread waits here until the event's flush
        assert committed.wait(30), "nothing flushed the decision the queue poll recorded"
        svc.store.record(records)

    decisions = DecisionLog(None, held_write)
    flush = decisions.flush

    def flush_opens(timeout_s=None):
        committed.set()
        return flush(timeout_s)

    decisions.flush = flush_opens
    try:
        catchup = AdmissionCatchup(svc.store, decisions, archive, CommentsCli())
        d_id = lua_id(7)
        comment = made_comment(tpl, d_id)
        assert catchup.learn([job(120, comment)]) == 1  # the poll's: journaled, not yet in the history
        assert svc.store.decision(d_id) is None
        inst = JobInstance(120, "c", SUBMIT + 120, SUBMIT + 130, 0, comment, "RUNNING", source="squeue")
        assert catchup.of_instances([inst, None]) == 0  # recorded once, by the poll ...
        assert svc.store.decision(d_id) is not None  # ... and in the history once the event's catch-up returns
        assert rows(svc.store, d_id) == 1
    finally:
        committed.set()
        decisions.close()
