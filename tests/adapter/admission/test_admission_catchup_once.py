"""Catch-up of table-made decisions, recorded once: HistoryStore.record idempotent on decision_id, a
restart between the journal and the history (and the same journal replayed again), and the service
catching up while it runs and not again across a restart.

The stand-in, fixtures and helpers (CommentsCli, job, lua_id...) are test_admission_catchup.py's."""
from __future__ import annotations

import dataclasses
import shutil
import threading
from pathlib import Path

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.admission.archive import TableArchive, archive_path
from policy_service.admission.catchup import AdmissionCatchup
from policy_service.history.decision_log import DecisionLog
from policy_service.history.journal_records import DecisionRecord
from policy_service.history.store import HistoryStore
from policy_service.slurm.slurm_comments import CommentedJob
from policy_service.config import load_config
from policy_service.core.admission import PLACEHOLDER_ID, TableRef
from policy_service.serving.server import start_service

from tests.waiting import wait_for

from tests.adapter.conftest import SlurmJobs
from tests.adapter.serving.test_service import facts
from tests.adapter.admission.test_admission_catchup import (VERSION, CommentsCli, caught, job, lua_id, made_comment,
                                                            rows, template_of)


def test_recording_one_decision_twice_leaves_one_row(tmp_path):
    """HistoryStore.record is idempotent on decision_id: a journal replayed after a crash, or a
    decision recorded by two sources, is one row."""
    store = HistoryStore(tmp_path / "h.sqlite3", accept_empty=True)
    rec = DecisionRecord(decision_id=lua_id(3), decided_at=1.0, job_class="c", user="u", account="a",
                         partition="p", job_name="j", action="share", shards=2, model_version="m", keys={},
                         facts_pb=b"", decision_pb=b"")
    store.record([rec])
    store.record([rec, rec])
    assert rows(store, rec.decision_id) == 1
    store.close()


def _template(archive: TableArchive, ref: TableRef, name: str) -> DecisionRecord:
    """A template sharing one GPU for alice's job ``name``, archived at ``ref``."""
    tpl_facts = pb.JobFacts(user="alice", uid=1000, tres_per_node="gres/gpu:1", job_name=name)
    tpl = DecisionRecord(decision_id=PLACEHOLDER_ID, decided_at=0, job_class="cls", user="alice", account="",
                         partition="", job_name=name, action="share", shards=2, model_version="m",
                         keys={"class": "cls"}, facts_pb=tpl_facts.SerializeToString(), decision_pb=pb.Decision(
                             decision_id=PLACEHOLDER_ID, action=pb.ACTION_SHARE, shards=2, rewrite=pb.JobRewrite(
                                 admin_comment=f"swapaware:v1 id={PLACEHOLDER_ID} {ref.token} action=share shards=2"
                             )).SerializeToString())
    archive.put(ref.version, {(ref.entry, ref.state): tpl})
    return tpl


def test_a_restart_between_journal_and_history_leaves_one_row(tmp_path):
    """The service dies after catch-up journaled a decision and before the writer put it into the
    history (SIGKILL); the next start replays the journal, sweeps Slurm again, and the decision
    is one row. Replaying the same journal once more (a crash after the commit, before the
    journal was emptied) changes nothing."""
    db = tmp_path / "history.sqlite3"
    store = HistoryStore(db, accept_empty=True)
    archive = TableArchive(archive_path(str(db)))
    tpl = _template(archive, TableRef(VERSION, 3, "*"), "x")
    cli = CommentsCli()
    ids = [lua_id(20 + i) for i in range(3)]
    cli.live = [job(70 + i, made_comment(tpl, d)) for i, d in enumerate(ids)]
    journal = Path(f"{db}.journal")
    stuck = threading.Event()

    def never(_records):  # the writer of the process that dies: commits nothing
        stuck.wait()

    dying = DecisionLog(journal, never)
    assert AdmissionCatchup(store, dying, archive, cli).from_live() == 3
    assert store.known_decisions(ids) == set()  # journaled only
    copy = tmp_path / "journal.copy"
    shutil.copy(journal, copy)
    # the next start: the journal first (DecisionLog), then a sweep of Slurm
    log2 = DecisionLog(journal, store.record)
    assert store.known_decisions(ids) == set(ids)
    catchup = AdmissionCatchup(store, log2, archive, cli)
    catchup.sweep()
    log2.flush()
    assert sum(catchup.recorded.values()) == 0
    shutil.copy(copy, journal)
    log3 = DecisionLog(journal, store.record)
    assert [rows(store, d) for d in ids] == [1, 1, 1]
    assert store.decision(ids[0]).decision.decision_id == ids[0]
    log2.close()
    log3.close()
    stuck.set()
    dying.close()
    archive.close()
    store.close()


# ----------------------------------------------------------------------------- the service
@dataclasses.dataclass
class TableSlurm(SlurmJobs):
    """The adapter suite's Slurm stand-in, with every job's AdminComment as squeue and sacct show it."""

    shown: list[CommentedJob] = dataclasses.field(default_factory=list)
    sweeps: int = 0

    def live_commented_jobs(self) -> list[CommentedJob]:
        return [j for j in self.shown if j.state != "COMPLETED"]

    def accounted_commented_jobs(self, since: float) -> list[CommentedJob]:
        self.sweeps += 1
        return [dataclasses.replace(j, source="sacct") for j in self.shown]


def test_the_service_catches_up_while_it_runs_and_once_across_a_restart(service_env, tmp_path):
    env = dict(service_env, SWAPAWARE_ADMISSION__TABLE_PATH=str(tmp_path / "admission.json"),
               SWAPAWARE_POLICY__QUEUE_POLL_S="0.1", SWAPAWARE_SERVICE__RECONCILE_S="0.1")
    slurm = TableSlurm()
    svc = start_service(load_config(env=env), slurm=slurm)
    try:
        ref = TableRef(VERSION, 9, "unknown")
        tpl = template_of(svc.handler, facts(name="svc-job", uid=1000), ref)
        svc.admission_archive.put(VERSION, {(9, "unknown"): tpl})
        ids = [lua_id(40 + i) for i in range(6)]
        slurm.shown = [job(200 + i, made_comment(tpl, d), state="COMPLETED" if i % 2 else "RUNNING")
                       for i, d in enumerate(ids)]
        wait_for(lambda: svc.store.known_decisions(ids) == set(ids), 10, "the jobs' decisions in the history")
        m = svc.handler.metrics
        assert caught(m, "squeue") == 3 and caught(m, "sacct") == 3  # running ones by the poll, ended ones by sacct
    finally:
        svc.stop(0)
    slurm.sweeps = 0
    again = start_service(load_config(env=env), slurm=slurm)
    try:
        wait_for(lambda: slurm.sweeps >= 2, 10, "two sweeps after the restart")
        again.handler.flush()
        assert [rows(again.store, d) for d in ids] == [1] * 6
        assert sum(again.handler.metrics.registry.get_sample_value(
            "swapaware_decisions_caught_up_total", {"source": s, "archived": "true"}) or 0
            for s in ("squeue", "sacct", "event")) == 0
    finally:
        again.stop(0)


def test_a_poll_is_journaled_in_one_write_and_what_the_backlog_refused_comes_next_round(tmp_path, monkeypatch):
    """The decisions one poll found are journaled with one write (DecisionLog.record_many); when the
    history's writer is behind and its backlog takes only some, the rest are neither journaled nor
    remembered, and the next poll records them: each decision once, none lost."""
    from policy_service.history import decision_log

    db = tmp_path / "history.sqlite3"
    store = HistoryStore(db, accept_empty=True)
    archive = TableArchive(archive_path(str(db)))
    tpl = _template(archive, TableRef(VERSION, 4, "*"), "y")
    entered, release = threading.Event(), threading.Event()

    def slow(records):  # the history's writer, behind
        entered.set()
        release.wait()
        store.record(records)

    log = DecisionLog(Path(f"{db}.journal"), slow, backlog=2)
    cli = CommentsCli()
    ids = [lua_id(60 + i) for i in range(5)]
    cli.live = [job(300 + i, made_comment(tpl, d)) for i, d in enumerate(ids)]
    catchup = AdmissionCatchup(store, log, archive, cli)
    writes = []
    write = decision_log.os.write
    monkeypatch.setattr(decision_log.os, "write", lambda fd, data: writes.append(len(data)) or write(fd, data))
    first = catchup.from_live()
    # the backlog holds 2; the writer may take one batch before it blocks: some, never all, were taken
    assert 2 <= first <= 4 and len(writes) == 1  # the poll's 5 journaled with one write
    assert entered.wait(10)
    release.set()
    assert log.flush(10)
    recorded, polls = first, 1
    while recorded < len(ids) and polls < 4:  # the rest, offered again by the next polls
        recorded += catchup.from_live()
        polls += 1
        assert log.flush(10)
    assert recorded == len(ids) and len(writes) == polls  # one write per poll that found some
    assert catchup.from_live() == 0 and [rows(store, d) for d in ids] == [1] * 5
    assert len(writes) == polls  # a poll that found nothing new writes nothing
    log.close()
    archive.close()
    store.close()
