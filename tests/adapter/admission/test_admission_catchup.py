"""Catch-up of the decisions the job_submit plugin made from the published table (issue 21):
learned from what Slurm shows (squeue after the queue poll, sacct over the reconcile window, the
job of a hook event) and recorded in the history once, through the real DecisionLog (journal),
the real history (SQLite) and the real archive (SQLite). Slurm is the one stand-in: ``CommentsCli``
is the real ``CliSlurm`` (argv and parsers) with its subprocess answering as squeue and sacct print
(shapes measured on 24.11: ``squeue -O ...UserId:|...`` prints the uid, ``sacct -P``).

This module holds the stand-in, fixtures and helpers the other catch-up tests import (CommentsCli,
svc, table, job, lua_id, made_comment, template_of, rows, caught...), the parsing of squeue's and
sacct's rows, and the sources: the queue poll, sacct, both, a version no longer archived, Slurm
unreadable, one reconcile round's sweep. Split by subject: test_admission_catchup_once.py (recorded
once across replays and restarts), test_admission_catchup_events.py (hook events of table-made jobs)."""
from __future__ import annotations

import dataclasses

import pytest

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.admission.archive import TableArchive, archive_path
from policy_service.admission.catchup import AdmissionCatchup, chain, table_made
from policy_service.history.journal_records import DecisionRecord
from policy_service.history.store import HistoryStore
from policy_service.slurm.reconcile import Reconciler
from policy_service.slurm.slurm import CliSlurm
from policy_service.slurm.slurm_comments import CommentedJob, limit_minutes, parse_commented, sacct_argv, squeue_argv
from policy_service.slurm.slurm_text import SlurmError
from policy_service.config import load_config
from policy_service.core.admission import PLACEHOLDER_ID, TableRef, with_table_ref
from policy_service.core.dialect import dialect_for
from policy_service.core.types import KeyLevel
from policy_service.serving.decision_proto import decision_to_proto
from policy_service.serving.metrics import ServiceMetrics
from policy_service.serving.server import start_service

from tests.commented_rows import commented_row

from tests.adapter.serving.test_service import facts

VERSION, OTHER = "0123456789abcdef", "fedcba9876543210"
SUBMIT = 1_796_418_925


class CommentsCli(CliSlurm):
    """``CliSlurm`` whose squeue shows ``live`` and whose sacct shows ``accounted``."""

    def __init__(self):
        super().__init__(dialect=dialect_for((24, 11)))
        self.live: list[CommentedJob] = []
        self.accounted: list[CommentedJob] = []
        self.calls: list[list[str]] = []
        self.fail = ""

    def _run(self, argv, env_extra=None):
        self.calls.append(list(argv))
        assert env_extra == {"SLURM_TIME_FORMAT": "%s"}
        if self.fail:
            raise SlurmError(f"{argv[0]} exited 1: {self.fail}")
        if argv == squeue_argv():
            return "".join(commented_row(j, "(null)") + "\n" for j in self.live)
        assert argv[:-10] == sacct_argv(0)[:-10] and argv[-1] == sacct_argv(0)[-1], argv
        return "".join(commented_row(j, "") + "\n" for j in self.accounted)


def lua_id(n: int) -> str:
    return f"a1b2c3d4{n:08x}"  # as the plugin draws them: 8 random hex + an 8 hex counter


def job(job_id: int, comment: str, *, uid=1001, state="RUNNING", source="squeue", limit=None) -> CommentedJob:
    return CommentedJob(job_id, SUBMIT + job_id, uid, "alice", "proj", "gpu", state, comment, source, limit)


def template_of(handler, job_facts: pb.JobFacts, ref: TableRef) -> DecisionRecord:
    """The template the service publishes for a job: its decision with the placeholder id and the
    table token in its AdminComment, decided_at 0 (docs: issue 21 spec, section 4)."""
    new_id, handler.new_id = handler.new_id, lambda: PLACEHOLDER_ID
    try:
        d, jr, keys = handler._decide(job_facts)
    finally:
        handler.new_id = new_id
    msg = decision_to_proto(d)
    msg.rewrite.admin_comment = with_table_ref(msg.rewrite.admin_comment, ref,
                                               handler.cfg.policy.admin_comment_max_chars)
    msg.decided_at = 0
    return DecisionRecord(decision_id=PLACEHOLDER_ID, decided_at=0, job_class=d.job_class, user=jr.user,
                          account=jr.account, partition=jr.partition, job_name=jr.job_name, action=d.action.value,
                          shards=d.shards, model_version=d.model_version,
                          keys={k.value: v for k, v in keys.items()},
                          facts_pb=job_facts.SerializeToString(), decision_pb=msg.SerializeToString())


def made_comment(template: DecisionRecord, d_id: str) -> str:
    """The AdminComment the plugin gives a job from this template."""
    return pb.Decision.FromString(template.decision_pb).rewrite.admin_comment.replace(f"id={PLACEHOLDER_ID}",
                                                                                      f"id={d_id}")


@pytest.fixture
def svc(service_env, slurm_jobs):
    s = start_service(load_config(env=service_env), slurm=slurm_jobs)
    yield s
    s.stop(0)


@pytest.fixture
def table(svc):
    """An archive beside the history holding version VERSION: entry 7 in state normal."""
    archive = TableArchive(archive_path(svc.store.path))
    ref = TableRef(VERSION, 7, "normal")
    job_facts = facts(name="table-job", uid=1000)
    job_facts.time_limit_min = 60  # the job the entry was decided for asked for an hour
    tpl = template_of(svc.handler, job_facts, ref)
    archive.put(VERSION, {(7, "normal"): tpl})
    yield archive, ref, tpl
    archive.close()


def catchup_of(svc, archive, cli, **kw) -> AdmissionCatchup:
    return AdmissionCatchup(svc.store, svc.handler.decisions, archive, cli, metrics=svc.handler.metrics, **kw)


def rows(store: HistoryStore, d_id: str) -> int:
    return store._read("SELECT count(*) FROM decisions WHERE decision_id=?", (d_id,))[0][0]


def caught(metrics: ServiceMetrics, source: str, archived: str = "true") -> float:
    return metrics.registry.get_sample_value("swapaware_decisions_caught_up_total",
                                             {"source": source, "archived": archived}) or 0.0


# ----------------------------------------------------------------------------- parsing
def test_squeue_and_sacct_rows_as_the_releases_print_them():
    squeue = ("41|1796418925|1001|alice|proj|gpu|RUNNING|1:00:00|swapaware:v1 id=0123456789abcdef why=a|b\n"
              "42|1796418926|bob(1002)|bob|proj|gpu|PENDING|2-00:00:30|(null)\n"
              "43_2|N/A|N/A|carol|(null)|gpu|COMPLETING|UNLIMITED|x\n")
    got = parse_commented(squeue, "squeue")
    assert [(j.job_id, j.submit_time, j.uid, j.state, j.account, j.time_limit_min) for j in got] == [
        (41, 1796418925, 1001, "RUNNING", "proj", 60), (42, 1796418926, 1002, "PENDING", "proj", 2 * 1440 + 1),
        (43, 0, None, "COMPLETING", "", None)]
    assert got[0].admin_comment == "swapaware:v1 id=0123456789abcdef why=a|b"  # "|" inside the comment kept
    assert got[1].admin_comment == ""
    sacct = "7|1796418925|0|root|root|debug|CANCELLED by 0|30:00|\n"
    (acct,) = parse_commented(sacct, "sacct")
    assert (acct.job_id, acct.uid, acct.state, acct.admin_comment, acct.source, acct.time_limit_min) == (
        7, 0, "CANCELLED", "", "sacct", 30)
    with pytest.raises(SlurmError):
        parse_commented("garbage\n", "squeue")
    assert [limit_minutes(s) for s in ("45", "2-12", "2-12:30", "0:01", "1:00:01", "Partition_Limit", "INVALID",
                                       "N/A", "")] == [45, 3600, 3630, 1, 61, None, None, None, None]


def test_only_table_made_comments_are_caught_up():
    ref = TableRef(VERSION, 12, "*")
    made = f"swapaware:v1 id={lua_id(1)} {ref.token} model=m action=share shards=2"
    assert table_made(made) == (lua_id(1), ref)
    assert table_made(f"swapaware:v1 id={lua_id(1)} model=m action=share") is None  # the RPC path's
    assert table_made(f"swapaware:v1 id=IDIDIDIDIDIDIDID {ref.token}") is None  # a template, not a job's
    assert table_made("") is None


# ----------------------------------------------------------------------------- sources
def test_the_queue_poll_catches_up_a_table_made_decision(svc, table):
    archive, ref, tpl = table
    cli = CommentsCli()
    d_id = lua_id(1)
    cli.live = [job(41, made_comment(tpl, d_id), uid=1234, limit=240),
                job(42, "swapaware:v1 id=00000000000000aa model=m action=share"),  # made over the socket
                job(43, "")]
    catchup = catchup_of(svc, archive, cli)
    on_poll = chain(None, catchup.on_queue_poll)
    on_poll([], None)  # what QueueMonitor calls after each poll
    svc.handler.flush()
    row = svc.store.decision(d_id)
    assert row is not None and svc.store.decision("00000000000000aa") is None
    assert row.decided_at == SUBMIT + 41  # the job's submit time
    assert row.facts.uid == 1234  # from Slurm, not the template's 1000
    # the job's own time limit (the class key leaves it out: the template's is another job's)
    assert row.facts.time_limit_min == 240 != pb.JobFacts.FromString(tpl.facts_pb).time_limit_min
    assert row.keys == {KeyLevel(k): v for k, v in tpl.keys.items()} and row.keys  # the class learns from its run
    d = row.decision
    assert d.decision_id == d_id and d.decided_at == SUBMIT + 41
    assert d.rewrite.admin_comment == made_comment(tpl, d_id) and PLACEHOLDER_ID not in d.rewrite.admin_comment
    assert (row.action, row.shards) == (tpl.action, tpl.shards)
    assert d.reasons[-1].code == "table_decided" and VERSION in d.reasons[-1].message
    assert caught(svc.handler.metrics, "squeue") == 1
    assert svc.handler.metrics.registry.get_sample_value("swapaware_catchup_lag_seconds_count",
                                                         {"source": "squeue"}) == 1
    on_poll([], None)  # polled again: nothing new
    svc.handler.flush()
    assert rows(svc.store, d_id) == 1 and caught(svc.handler.metrics, "squeue") == 1


def test_sacct_catches_up_a_job_that_ended_between_polls(svc, table):
    archive, ref, tpl = table
    cli = CommentsCli()
    d_id = lua_id(2)
    cli.accounted = [job(51, made_comment(tpl, d_id), state="COMPLETED", source="sacct")]
    catchup = catchup_of(svc, archive, cli, window_s=3600)
    assert catchup.from_live() == 0  # squeue no longer shows it
    rec = Reconciler(svc.store, cli, window_s=3600, settle_s=60, clock=lambda: SUBMIT + 100, catchup=catchup)
    rec.run_once()
    svc.handler.flush()
    assert svc.store.decision(d_id).decided_at == SUBMIT + 51
    assert svc.store.decision(d_id).facts.time_limit_min == 0  # UNLIMITED: no limit recorded, never the template's
    assert caught(svc.handler.metrics, "sacct") == 1
    assert [c[0] for c in cli.calls] == ["squeue", "squeue", "sacct"]  # the poll, then the round's sweep


def test_a_job_both_sources_show_is_recorded_once(svc, table):
    archive, ref, tpl = table
    cli = CommentsCli()
    ids = [lua_id(10 + i) for i in range(5)]
    both = [job(60 + i, made_comment(tpl, d)) for i, d in enumerate(ids)]
    cli.live, cli.accounted = both, [dataclasses.replace(j, source="sacct") for j in both]
    catchup = catchup_of(svc, archive, cli)
    assert catchup.sweep() >= set(ids)  # squeue and sacct in one sweep, each job in both
    assert catchup.from_live() == 0
    svc.handler.flush()
    assert [rows(svc.store, d) for d in ids] == [1] * 5
    # a second catch-up (another thread, or the next process) records none of them again
    other = catchup_of(svc, archive, cli)
    assert other.sweep() and other.from_live() == 0
    svc.handler.flush()
    assert [rows(svc.store, d) for d in ids] == [1] * 5
    assert caught(svc.handler.metrics, "squeue") == 5


def test_a_version_no_longer_archived_is_recorded_from_its_admin_comment(svc, table):
    archive, _, _ = table
    cli = CommentsCli()
    d_id = lua_id(4)
    ref = TableRef(OTHER, 5, "long")
    comment = (f"swapaware:v1 id={d_id} {ref.token} model=swapaware-model/1+abc action=share shards=3 "
               "pred=9.0G+1.0G src=history n=4 sf=-2 why=estimate_from_history,fits_in_shards")
    cli.live = [job(80, comment, uid=1001)]
    catchup_of(svc, archive, cli).from_live()
    svc.handler.flush()
    row = svc.store.decision(d_id)
    d = row.decision
    assert (row.action, row.shards, d.site_factor, d.model_version) == ("share", 3, -2, "swapaware-model/1+abc")
    assert d.action == pb.ACTION_SHARE and d.decided_at == SUBMIT + 80 and row.keys == {}
    assert [r.code for r in d.reasons] == ["estimate_from_history", "fits_in_shards", "table_gone"]
    assert OTHER in d.reasons[-1].message and "no longer archived" in d.reasons[-1].message
    assert d.rewrite.admin_comment == comment
    assert (row.user, row.facts.uid, row.facts.account) == ("alice", 1001, "proj")
    assert caught(svc.handler.metrics, "squeue", "false") == 1


def test_slurm_unreadable_records_nothing_and_the_next_round_does(svc, table):
    archive, ref, tpl = table
    cli = CommentsCli()
    cli.live = [job(90, made_comment(tpl, lua_id(5)))]
    cli.fail = "slurm_load_jobs error: Unable to contact slurm controller"
    catchup = catchup_of(svc, archive, cli)
    assert catchup.from_live() == 0
    with pytest.raises(SlurmError):
        catchup.sweep()
    cli.fail = ""
    assert catchup.from_live() == 1


def test_a_reconcile_round_sweeps_once_for_both_catch_up_and_the_held_check(svc, table):
    """With catch-up the round's one squeue and one sacct (over the whole window) serve both: the
    table-made decision is recorded, the Admit-made one Slurm holds is marked held, and one no job
    names never held."""
    archive, ref, tpl = table
    h = svc.handler
    kept = h.admit(pb.AdmitRequest(job=facts(name="rpc", uid=1000))).decision
    orphan = h.admit(pb.AdmitRequest(job=facts(name="rpc", uid=1000))).decision
    h.flush()
    cli = CommentsCli()
    d_id = lua_id(7)
    cli.live = [job(300, kept.rewrite.admin_comment)]
    cli.accounted = [job(301, made_comment(tpl, d_id), state="COMPLETED", source="sacct")]
    catchup = catchup_of(svc, archive, cli, window_s=3600)
    rec = Reconciler(svc.store, cli, window_s=3600, settle_s=60, clock=lambda: kept.decided_at + 120,
                     catchup=catchup)
    done = rec.run_once()
    assert (done.checked, done.held, done.never_held) == (2, 1, (orphan.decision_id,))
    assert [c[0] for c in cli.calls] == ["squeue", "sacct"]
    assert cli.calls[1][cli.calls[1].index("-S") + 1] == sacct_argv(kept.decided_at + 120 - 3600)[7]
    h.flush()
    assert svc.store.decision(d_id) is not None and caught(h.metrics, "sacct") == 1
    assert svc.store.decision_status(kept.decision_id) == "held"
