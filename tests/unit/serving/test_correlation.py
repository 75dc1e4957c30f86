"""Correlation: which job instance an event belongs to (pure matching, the instance cache) and how
many Slurm queries a batch costs (a recording CliSlurm fed with each release's output shapes)."""
import math

import pytest

from policy_service.history.store import HistoryStore
from policy_service.slurm.slurm import JobInstance
from policy_service.core.types import KeyLevel
from policy_service.serving.correlation import (MATCH_GRACE_S, Correlator, EventRef, InstanceCache, distance,
                                                match_instance)
from tests.slurm_cli_fake import RELEASES, RecordingCli

OLD = JobInstance(1, "c", 1000, 1010, 1100, "swapaware:v1 id=A", "COMPLETED", "", "sacct")
NEW = JobInstance(1, "c", 1200, 1205, 0, "swapaware:v1 id=B", "RUNNING", "", "squeue")


@pytest.mark.parametrize("ref,expected", [
    (EventRef(1, "n", started_at=1010.5), OLD),                      # the old job's start, replayed late
    (EventRef(1, "n", started_at=1020, finished_at=1102), OLD),      # its finish (epilog 2 s after the end)
    (EventRef(1, "n", finished_at=1103), OLD),                       # a finish without start: nearest run
    (EventRef(1, "n", started_at=1206), NEW),                        # the new job of the same id
    (EventRef(1, "n", started_at=1206, finished_at=9000), NEW),      # running on: open end
    (EventRef(1, "n", started_at=1150), OLD),                        # between: nearer the old end (50 s) than 55 s
    (EventRef(2, "n", started_at=1010), None),                       # another id
    (EventRef(1, "n", started_at=300), None),                        # before any run, beyond the grace
])
def test_match_instance_by_times(ref, expected):
    assert match_instance(ref, [OLD, NEW])[0] == expected


def test_match_instance_by_sluid_first_and_never_another_sluid():
    a = JobInstance(1, "c", 1000, 1010, 0, "x", "RUNNING", "sA", "squeue")
    b = JobInstance(1, "c", 1200, 1205, 0, "y", "RUNNING", "sB", "squeue")
    assert match_instance(EventRef(1, "n", "sA", started_at=1300), [a, b])[0] == a  # times say b; SLUID says a
    assert distance(EventRef(1, "n", "sC", started_at=1300), b) == math.inf
    # accounting has no SLUID: times decide
    assert match_instance(EventRef(1, "n", "sA", started_at=1011), [OLD])[0] == OLD


def test_completing_live_job_runs_on_until_its_epilog_reports():
    completing = JobInstance(3, "c", 100, 110, 200, "", "COMPLETING", "", "squeue")
    done = JobInstance(3, "c", 100, 110, 200, "", "COMPLETED", "", "squeue")
    fin = EventRef(3, "n", finished_at=230)
    assert distance(fin, completing) == 0 and distance(fin, done) == 30


def test_a_job_that_never_started_gets_no_event():
    pending = JobInstance(4, "c", 100, 0, 0, "", "PENDING", "", "squeue")
    assert match_instance(EventRef(4, "n", started_at=150), [pending]) == (None, math.inf)


def test_grace_bounds_the_match():
    assert match_instance(EventRef(1, "n", started_at=1100 + MATCH_GRACE_S + 1), [OLD])[0] is None


def test_cache_keeps_only_what_cannot_change_and_is_bounded():
    cache = InstanceCache(max_jobs=2)
    cache.add([NEW, OLD])  # running (no SLUID): not kept
    assert cache.find(EventRef(1, "n", started_at=1206)) is None
    assert cache.find(EventRef(1, "n", started_at=1050)) == OLD
    assert cache.find(EventRef(1, "n", started_at=1050, finished_at=1300)) is None  # not settled: ask Slurm
    cache.add([JobInstance(j, "c", 1, 2, 3, "", "COMPLETED", "", "sacct") for j in (7, 8)])
    assert len(cache) == 2 and cache.find(EventRef(1, "n", started_at=1050)) is None  # job 1 evicted (LRU)
    cache.add([JobInstance(9, "c", 1, 2, 0, "", "RUNNING", "s9", "squeue")])  # SLUID: kept while it runs
    assert cache.find(EventRef(9, "n", "s9", started_at=99999)) is not None


def _store_with_decisions(ids, decided_at=0.0) -> HistoryStore:
    store = HistoryStore(":memory:")
    for d in ids:
        store.record_decision(decision_id=d, decided_at=decided_at, job_class=f"class-{d}", user="u", account="a",
                              partition="p", job_name=d, action="share", shards=1, model_version="m",
                              keys={KeyLevel.CLASS: f"class-{d}"}, facts_pb=b"", decision_pb=b"")
    return store


@pytest.mark.parametrize("release", RELEASES)
def test_a_batch_of_200_events_costs_one_slurm_query(release):
    now = 10_000.0
    jobs = range(1, 101)
    live = [JobInstance(j, "c", 9000 + j, 9500, 0, f"swapaware:v1 id=d{j}", "RUNNING",
                        f"s{j:012d}" if release == "26.05" else "", "squeue") for j in jobs]
    cli = RecordingCli(release, live=live)
    corr = Correlator(cli, _store_with_decisions([f"d{j}" for j in jobs]), clock=lambda: now)
    refs = [EventRef(j, "n1", live[j - 1].sluid, started_at=9501) for j in jobs]
    refs += [EventRef(j, "n1", live[j - 1].sluid, started_at=9501, finished_at=now) for j in jobs]
    out = corr.resolve(refs)
    assert cli.commands == ["squeue"] and corr.queries == 1
    assert [r.decision_id for r in out] == [f"d{j}" for j in jobs] * 2
    key = (lambda j: f"sluid/s{j:012d}") if release == "26.05" else (lambda j: f"c/{j}/{9000 + j}")
    assert [r.instance for r in out] == [key(j) for j in jobs] * 2
    assert {r.how for r in out} == {"slurm"}


@pytest.mark.parametrize("release", RELEASES)
def test_old_events_go_to_accounting_in_one_query_and_are_cached(release):
    now = 100_000.0
    ended = [JobInstance(j, "c", 1000 + j, 2000, 3000, f"swapaware:v1 id=d{j}", "COMPLETED", "", "sacct")
             for j in range(1, 201)]
    cli = RecordingCli(release, accounting=ended)
    corr = Correlator(cli, _store_with_decisions([f"d{j}" for j in range(1, 201)]), clock=lambda: now)
    refs = [EventRef(j, "n1", started_at=2001, finished_at=3001) for j in range(1, 201)]
    assert [r.decision_id for r in corr.resolve(refs)] == [f"d{j}" for j in range(1, 201)]
    assert cli.commands == ["sacct"]
    corr.resolve(refs)  # ended instances never change: the second batch asks nothing
    assert cli.commands == ["sacct"]


def test_reused_id_asks_accounting_for_what_the_live_job_does_not_hold():
    now = 1300.0
    cli = RecordingCli("24.11", live=[NEW], accounting=[OLD, NEW])
    corr = Correlator(cli, _store_with_decisions(["A", "B"]), clock=lambda: now)
    old_start, new_start = corr.resolve([EventRef(1, "n", started_at=1011), EventRef(1, "n", started_at=1206)])
    assert cli.commands == ["squeue", "sacct"]
    assert (old_start.instance, old_start.decision_id) == ("c/1/1000", "A")
    assert (new_start.instance, new_start.decision_id) == ("c/1/1200", "B")


def test_decision_made_after_the_instance_was_submitted_is_not_attached():
    cli = RecordingCli("22.05", live=[JobInstance(5, "c", 1000, 1001, 0, "swapaware:v1 id=late", "RUNNING")])
    corr = Correlator(cli, _store_with_decisions(["late"], decided_at=1000 + 3600), clock=lambda: 1010.0)
    (res,) = corr.resolve([EventRef(5, "n", started_at=1002)])
    assert res.instance == "c/5/1000" and res.decision_id == "" and "after the job was submitted" in res.note
    # within the slack (the plugin decides just before slurmctld stamps the submit time): attached
    store = _store_with_decisions(["ok"], decided_at=1000.9)
    cli.live = [JobInstance(6, "c", 1000, 1001, 0, "swapaware:v1 id=ok", "RUNNING")]
    assert Correlator(cli, store, clock=lambda: 1010.0).resolve([EventRef(6, "n", started_at=1002)])[0].decision_id == "ok"


def test_without_slurm_an_event_is_unresolved_and_carries_no_decision():
    cli = RecordingCli("24.11")
    cli.fail = "slurm_load_jobs error: Unable to contact slurm controller"
    store = _store_with_decisions(["A"])
    corr = Correlator(cli, store, clock=lambda: 1300.0)
    (start,) = corr.resolve([EventRef(1, "n1", started_at=1206.7)])
    assert (start.instance, start.decision_id, start.how) == ("unresolved/1/n1/1206", "", "unresolved")
    assert cli.commands == ["squeue", "sacct"]
    # a finish joins the open run of its id on its node when the agent's start time matches it
    store.record_start(event_id="s", job_id=1, decision_id="A", node="n1", gpus=[0], started_at=1206.0,
                       received_at=1206.0, instance="c/1/1200", submit_time=1200)
    (fin,) = corr.resolve([EventRef(1, "n1", started_at=1206.5, finished_at=1290)])
    assert (fin.instance, fin.decision_id, fin.how) == ("c/1/1200", "A", "run")
    (far,) = corr.resolve([EventRef(1, "n1", started_at=5000, finished_at=5100)])
    assert far.how == "unresolved" and far.decision_id == ""
    # the event's SLUID names its instance; the run recorded under it gives the decision
    store.record_start(event_id="s2", job_id=2, decision_id="A", node="n1", gpus=[0], started_at=1206.0,
                       received_at=1206.0, instance="sluid/sX", submit_time=1200)
    (by_sluid,) = corr.resolve([EventRef(2, "n1", "sX", finished_at=1290)])
    assert (by_sluid.instance, by_sluid.decision_id, by_sluid.how) == ("sluid/sX", "A", "sluid")


def test_a_new_job_started_seconds_after_the_old_one_ended_is_never_taken_for_it():
    """Ids restart right after a reset: job 1 ended at 1100, the new job 1 started at 1103."""
    old = JobInstance(1, "c", 1000, 1010, 1100, "swapaware:v1 id=A", "COMPLETED", "", "sacct")
    new = JobInstance(1, "c", 1101, 1103, 0, "swapaware:v1 id=B", "RUNNING", "", "squeue")
    cli = RecordingCli("24.11", live=[new], accounting=[old, new])
    corr = Correlator(cli, _store_with_decisions(["A", "B"]), clock=lambda: 1110.0)
    # the old job's finish (its agent saw it start at 1020): squeue shows only the new job, so sacct is asked
    (fin,) = corr.resolve([EventRef(1, "n", started_at=1020, finished_at=1101)])
    assert fin.decision_id == "A" and cli.commands == ["squeue", "sacct"]
    # the old job is cached now (it ended); the new job's start is not inside it: Slurm is asked again
    (start,) = corr.resolve([EventRef(1, "n", started_at=1103.5)])
    assert start.decision_id == "B" and cli.commands == ["squeue", "sacct", "squeue"]
