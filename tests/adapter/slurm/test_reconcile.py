"""Decisions no job in Slurm ever held (refused after the plugin ran, answered after slurmctld
stopped waiting) are found against Slurm's AdminComments and marked, their records deleted; Explain
says what became of them."""
from __future__ import annotations

import logging
import sqlite3
import threading

import grpc
import pytest

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.serving.handler_error import HandlerError
from policy_service.slurm.reconcile import Reconciler
from policy_service.slurm.slurm_text import decision_ids_in
from tests.waiting import wait_for
from policy_service.config import load_config
from policy_service.core.types import KeyLevel
from policy_service.serving.server import start_service


def test_decision_ids_in_squeue_and_sacct_output():
    squeue = ("swapaware:v1 id=01ac691e3d9a4bec model=swapaware-model/1+586156c0 action=whole_gpu shards=8   \n"
              "(null)\n\nswapaware:v1 id=ffee00112233aabb action=share shards=2\n")
    sacct = "swapaware:v1 id=0123456789abcdef model=m action=share\n\nsite note, not ours: id=deadbeefdeadbeef\n"
    assert decision_ids_in(squeue) == {"01ac691e3d9a4bec", "ffee00112233aabb"}
    assert decision_ids_in(sacct) == {"0123456789abcdef"}


def test_decisions_no_job_holds_are_marked_never_held(service_env, slurm_jobs):
    svc = start_service(load_config(env=service_env), slurm=slurm_jobs)
    try:
        h = svc.handler
        facts = pb.JobFacts(user="alice", uid=1000, tres_per_node="gres:gpu:1", job_name="j")
        kept = [h.admit(pb.AdmitRequest(job=facts)).decision for _ in range(3)]
        orphan = h.admit(pb.AdmitRequest(job=facts)).decision  # slurmctld refused this job after the plugin
        for job_id, d in enumerate(kept, start=1):
            slurm_jobs.comments[job_id] = d.rewrite.admin_comment
        h.flush()
        now = kept[0].decided_at
        rec = Reconciler(svc.store, slurm_jobs, window_s=3600, settle_s=60, clock=lambda: now + 30)
        assert rec.run_once().checked == 0  # too recent: slurmctld may still be deciding
        rec.clock = lambda: now + 120
        slurm_jobs.held_failure = "squeue: error: Unable to contact slurm controller"
        failed = rec.run_once()
        assert failed.error and svc.store.decision_status(orphan.decision_id) == ""  # nothing marked blind
        slurm_jobs.held_failure = None
        # marking and deleting are one transaction: a round whose delete fails marks nothing, so
        # that no never-held status is ever seen beside its record and the next round checks again
        with sqlite3.connect(service_env["SWAPAWARE_SERVICE__DB_PATH"]) as db:
            db.execute("CREATE TRIGGER no_delete BEFORE DELETE ON decisions BEGIN SELECT RAISE(ABORT, 'full'); END")
        with pytest.raises(sqlite3.IntegrityError):
            rec.run_once()
        assert [svc.store.decision_status(d.decision_id) for d in [*kept, orphan]] == [""] * 4
        with sqlite3.connect(service_env["SWAPAWARE_SERVICE__DB_PATH"]) as db:
            db.execute("DROP TRIGGER no_delete")
        done = rec.run_once()
        assert (done.checked, done.held, done.never_held) == (4, 3, (orphan.decision_id,))
        assert [svc.store.decision_status(d.decision_id) for d in kept] == ["held"] * 3
        assert rec.run_once().checked == 0  # each decision is checked once
        # the record of a decision no job followed is deleted; its id is still known as never held
        assert svc.store.decision(orphan.decision_id) is None
        assert all(svc.store.decision(d.decision_id) is not None for d in kept)
        with pytest.raises(HandlerError) as err:
            h.explain(pb.ExplainRequest(decision_id=orphan.decision_id))
        assert err.value.code is grpc.StatusCode.NOT_FOUND and "never held" in err.value.message
        assert "never_held" not in [r.code for r in h.explain(pb.ExplainRequest(
            decision_id=kept[0].decision_id)).decision.reasons]
    finally:
        svc.stop(0)


def test_a_round_the_history_refuses_is_a_warning_and_the_next_round_checks_again(history_backend, slurm_jobs,
                                                                                   tmp_path, caplog):
    """A service that lost the writer lease (or its database) in a round marks nothing and says so in
    one warning, no traceback; once it writes again the round marks them."""
    db = tmp_path / "history.sqlite3"
    a, b = history_backend.open(db, fence="a"), history_backend.open(db, fence="b")
    try:
        a.claim_writer("a", 30.0)
        a.record_decision(decision_id="00000000000000aa", decided_at=100.0, job_class="c", user="alice", account="a",
                          partition="p", job_name="j", action="share", shards=1, model_version="m",
                          keys={KeyLevel.CLASS: "c"}, facts_pb=b"", decision_pb=b"")
        a.release_writer("a")
        b.claim_writer("b", 30.0)  # the lease moved on: a's writes are refused
        rec = Reconciler(a, slurm_jobs, window_s=3600, settle_s=60, clock=lambda: 200.0)
        stop = threading.Event()
        with caplog.at_level(logging.WARNING, logger="swapaware.decisions"):
            rec.start(0.05, stop)
            wait_for(lambda: any("next round checks again" in r.getMessage() for r in caplog.records), 10,
                     lambda: f"a warning; the last records: {[r.getMessage() for r in caplog.records][-3:]}")
            stop.set()
        assert not any(r.exc_info for r in caplog.records) and a.decision_status("00000000000000aa") == ""
        b.release_writer("b")
        a.claim_writer("a", 30.0)
        assert rec.run_once().never_held == ("00000000000000aa",)
        assert a.decision_status("00000000000000aa") == "never_held" and a.decision("00000000000000aa") is None
    finally:
        a.close()
        b.close()
