"""Events tied to job INSTANCES, not job ids (real SQLite; Slurm is the recording CliSlurm of
tests/slurm_cli_fake.py, answering in each release's output shapes): a reused job id never
inherits an old decision, batches cost one Slurm query, bad events fail alone, replays apply
nothing twice, runs whose finish never came stop counting as co-runners."""
from __future__ import annotations

import json
import os
import sqlite3
import stat
from pathlib import Path

import grpc
import pytest

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.history.store import HistoryStore, ReadOnlyHistory, open_history
from policy_service.slurm.slurm import JobInstance
from policy_service.serving.client import PolicyClient
from policy_service.config import load_config
from policy_service.serving.handler import Method, PolicyHandler
from policy_service.serving.server import start_service
from tests.slurm_cli_fake import RecordingCli

from tests.adapter.conftest import socket_call

GIB = 1024**3
DAY = 86400.0


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def facts(name: str, **kw) -> pb.JobFacts:
    return pb.JobFacts(user="alice", account="proj", partition="gpu", job_name=name, tres_per_node="gres:gpu:1",
                       script_fingerprint="00000001deadbeef", **kw)


@pytest.fixture
def world(tmp_path, history_backend):
    """A handler on a history of each backend (SQLite, MariaDB)."""
    env = {"SWAPAWARE_SERVICE__DB_PATH": str(tmp_path / "history.sqlite3"), **history_backend.env}
    cfg = load_config(env=env)
    store = open_history(cfg)
    cli = RecordingCli("24.11")
    clock = Clock()
    handler = PolicyHandler(cfg, store, cli, clock=clock)
    yield handler, store, cli, clock
    handler.close()
    store.close()


def admit(handler: PolicyHandler, name: str, **kw) -> pb.Decision:
    d = handler.admit(pb.AdmitRequest(job=facts(name, **kw))).decision
    handler.flush()
    return d


def started(job_id, at, event_id, node="n1", gpus=(0,), sluid=""):
    return pb.JobEvent(started=pb.JobStartedRequest(job_id=job_id, node=node, gpu_indices=list(gpus), started_at=at,
                                                    event_id=event_id, sluid=sluid))


def finished(job_id, at, event_id, node="n1", gpus=(0,), peak=None, started_at=0.0, sluid=""):
    req = pb.JobFinishedRequest(job_id=job_id, node=node, gpu_indices=list(gpus), finished_at=at, event_id=event_id,
                                started_at=started_at, telemetry_source="fake-nvml" if peak else "none", sluid=sluid)
    if peak is not None:
        req.peak_gpu_bytes = peak
    return pb.JobEvent(finished=req)


def class_stats(store: HistoryStore, d: pb.Decision) -> dict:
    """The statistics as stored (not brought within bounds), on either backend."""
    rows = store._read("SELECT stats_json FROM class_stats WHERE level='class' AND key=?", (d.job_class,))
    return json.loads(rows[0][0]) if rows else {}


# ----------------------------------------------------------------------------- (a) job id reuse
def test_a_reused_job_id_ties_to_its_own_decision_and_class(world):
    handler, store, cli, clock = world
    a = admit(handler, "old")
    old = JobInstance(1, "c", 1000, 1005, 0, a.rewrite.admin_comment, "RUNNING", source="squeue")
    cli.live = [old]
    clock.t = 1010
    assert handler.job_started(started(1, 1006, "s-old").started).decision_id == a.decision_id
    cli.live = [JobInstance(1, "c", 1000, 1005, 1100, a.rewrite.admin_comment, "COMPLETING", source="squeue")]
    clock.t = 1101
    assert handler.job_finished(finished(1, 1100, "f-old", peak=2 * GIB).finished).decision_id == a.decision_id
    learned_a = class_stats(store, a)
    assert learned_a["runs"] == 1

    # slurmctld loses its state: the next job is job 1 again, its AdminComment names decision B
    clock.t = 2000
    b = admit(handler, "new")
    new = JobInstance(1, "c", 2000, 2002, 0, b.rewrite.admin_comment, "RUNNING", source="squeue")
    cli.live = [new]
    cli.accounting = [JobInstance(1, "c", 1000, 1005, 1100, a.rewrite.admin_comment, "COMPLETED", source="sacct"), new]
    clock.t = 2010
    assert handler.job_started(started(1, 2003, "s-new").started).decision_id == b.decision_id
    clock.t = 2101
    fin = handler.job_finished(finished(1, 2100, "f-new", peak=5 * GIB).finished)
    assert fin.applied and fin.decision_id == b.decision_id
    assert class_stats(store, a) == learned_a  # the old job's class learned nothing more
    assert class_stats(store, b)["runs"] == 1
    obs = store.observations(job_id=1)
    assert sorted((o.decision_id, o.peak_bytes, o.instance) for o in obs) == sorted([
        (a.decision_id, 2 * GIB, "c/1/1000"), (b.decision_id, 5 * GIB, "c/1/2000")])
    assert store.run_of("c/1/1000").decision_id == a.decision_id
    assert store.run_of("c/1/2000").decision_id == b.decision_id
    # a late event of the old job (spooled on its node through the reset) still goes to the old job
    late = handler.report_events(pb.ReportEventsRequest(events=[started(1, 1006.5, "s-old-again")])).results[0]
    assert late.code == 0 and late.decision_id == a.decision_id
    assert store.run_of("c/1/2000").started_at == 2003  # the new job's run untouched
    # `explain 1` means the job 1 Slurm holds now
    assert handler.explain(pb.ExplainRequest(job_id=1)).decision.decision_id == b.decision_id


def test_a_copied_old_admin_comment_is_not_attached(world):
    handler, store, cli, clock = world
    clock.t = 5000
    a = admit(handler, "old")
    # a job submitted an hour before decision A was made cannot carry it
    cli.live = [JobInstance(7, "c", 1400, 5001, 0, a.rewrite.admin_comment, "RUNNING", source="squeue")]
    clock.t = 5010
    assert handler.job_started(started(7, 5002, "s7").started).decision_id == ""
    handler.job_finished(finished(7, 5100, "f7", peak=GIB).finished)
    assert class_stats(store, a) == {}


def test_sluid_names_the_instance_on_25_11_and_later(tmp_path):
    cfg = load_config(env={"SWAPAWARE_SERVICE__DB_PATH": str(tmp_path / "h.sqlite3")})
    store = HistoryStore(cfg.service.db_path)
    cli = RecordingCli("26.05")
    handler = PolicyHandler(cfg, store, cli, clock=Clock(1010))
    try:
        d = admit(handler, "x")
        cli.live = [JobInstance(3, "c", 1000, 1005, 0, d.rewrite.admin_comment, "RUNNING", "sAK5M8XEFWTR00", "squeue"),
                    JobInstance(3, "c", 900, 905, 0, "", "RUNNING", "sOTHER", "squeue")]
        r = handler.job_started(started(3, 1006, "s3", sluid="sAK5M8XEFWTR00").started)
        assert r.decision_id == d.decision_id and store.run_of("sluid/sAK5M8XEFWTR00").submit_time == 1000
        assert "SLUID:|" in cli.calls[0][0][-1]
    finally:
        handler.close()
        store.close()


# ----------------------------------------------------------------------------- (c) ReportEvents
def test_batch_of_200_events_is_resolved_with_one_slurm_query(world):
    handler, store, cli, clock = world
    decisions = {j: admit(handler, f"job{j % 5}") for j in range(1, 101)}
    cli.live = [JobInstance(j, "c", 1000, 1001, 0, d.rewrite.admin_comment, "RUNNING", source="squeue")
                for j, d in decisions.items()]
    clock.t = 1200
    events = [started(j, 1002, f"s{j}", gpus=(j % 4,)) for j in decisions]
    events += [finished(j, 1100 + j, f"f{j}", gpus=(j % 4,), peak=GIB) for j in decisions]
    results = handler.report_events(pb.ReportEventsRequest(events=events)).results
    assert cli.commands == ["squeue"]  # one Slurm query for 100 job ids
    assert [(r.code, r.applied) for r in results] == [(0, True)] * 200
    assert [r.decision_id for r in results] == [decisions[j].decision_id for j in decisions] * 2
    assert [r.event_id for r in results] == [e.started.event_id or e.finished.event_id for e in events]
    assert len(store.observations()) == 100 and sum(class_stats(store, decisions[j])["runs"] for j in range(1, 6)) == 100


def test_a_bad_event_gets_code_3_and_the_others_apply(world):
    handler, store, cli, clock = world
    d = admit(handler, "t")
    cli.live = [JobInstance(5, "c", 1000, 1001, 0, d.rewrite.admin_comment, "RUNNING", source="squeue")]
    clock.t = 1200
    batch = [started(5, 1002, "s5"),
             started(0, 1002, "no-job"),
             pb.JobEvent(finished=pb.JobFinishedRequest(job_id=5, node="n1", finished_at=1100)),
             pb.JobEvent(),
             started(6, 1002, "big", node="n" * 2000),
             finished(5, 1100, "f5", peak=GIB)]
    results = handler.report_events(pb.ReportEventsRequest(events=batch)).results
    assert [r.code for r in results] == [0, 3, 3, 3, 3, 0]
    assert [r.applied for r in results] == [True, False, False, False, False, True]
    assert results[1].message == "job_id is required" and results[1].event_id == "no-job"
    assert "event_id is required" in results[2].message and "neither" in results[3].message
    assert "node is 2000 bytes" in results[4].message
    assert results[5].decision_id == d.decision_id and class_stats(store, d)["runs"] == 1
    # the same over gRPC's single-event RPC is a status code, as before
    assert Method.REPORT_EVENTS.is_event and Method.by_name("ReportEvents") is Method.REPORT_EVENTS


def test_replayed_batch_applies_nothing_twice_and_asks_slurm_nothing(world):
    handler, store, cli, clock = world
    d = admit(handler, "t")
    cli.live = [JobInstance(j, "c", 1000, 1001, 0, d.rewrite.admin_comment, "RUNNING", source="squeue")
                for j in (8, 9)]
    clock.t = 1200
    batch = pb.ReportEventsRequest(events=[started(8, 1002, "s8"), finished(8, 1100, "f8", peak=GIB),
                                           finished(9, 1100, "f9", peak=GIB), finished(9, 1100, "f9", peak=GIB)])
    first = handler.report_events(batch).results
    assert [r.applied for r in first] == [True, True, True, False]  # the same event twice in one batch: once
    stats = class_stats(store, d)
    assert stats["runs"] == 2
    cli.calls.clear()
    again = handler.report_events(batch).results
    assert [(r.code, r.applied) for r in again] == [(0, False)] * 4
    assert class_stats(store, d) == stats and len(store.observations()) == 2 and cli.calls == []


def test_report_events_over_grpc_and_the_local_socket(tmp_path, short_dir):
    env = {"SWAPAWARE_SERVICE__DB_PATH": str(tmp_path / "h.sqlite3"),
           "SWAPAWARE_SERVICE__SOCKET_PATH": str(short_dir / "p.sock"),
           "SWAPAWARE_SERVICE__GRPC_ADDRESS": "127.0.0.1:0", "SWAPAWARE_SERVICE__SLURM_RELEASE": "24.11",
           "SWAPAWARE_POLICY__REDECIDE_PENDING": "false"}
    cli = RecordingCli("24.11")
    svc = start_service(load_config(env=env), slurm=cli)
    try:
        with PolicyClient(f"127.0.0.1:{svc.grpc_port}", 5.0) as client:
            d = client.admit(facts("g")).decision
            svc.handler.flush()
            import time
            now = time.time()
            cli.live = [JobInstance(4, "c", int(now) - 5, int(now) - 4, 0, d.rewrite.admin_comment, "RUNNING",
                                    source="squeue")]
            resp = client.call("ReportEvents", pb.ReportEventsRequest(events=[started(4, now - 3, "s4"),
                                                                              started(0, now, "bad")]))
            assert [(r.code, r.decision_id) for r in resp.results] == [(0, d.decision_id), (3, "")]
            with pytest.raises(grpc.RpcError) as err:  # more than 500 events: the whole call is refused
                client.call("ReportEvents", pb.ReportEventsRequest(events=[started(4, now, f"x{i}") for i in range(501)]))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most 500" in err.value.details()
        reply = socket_call(svc.socket_path, {"method": "ReportEvents", "request": {"events": [
            {"finished": {"jobId": "4", "node": "n1", "finishedAt": now, "eventId": "f4"}}]}})
        assert reply["response"]["results"][0]["applied"] is True
    finally:
        svc.stop(0)


# ----------------------------------------------------------------------------- (d) open runs
def _co_runners(store, event_id) -> int:
    (obs,) = [o for o in store.observations() if o.event_id == event_id]
    return obs.co_runners


@pytest.mark.parametrize("max_s,finish_after_s,co", [
    (None, 1 * DAY, 1),        # the default bound (7 days): a day-old open run still counts
    (None, 8 * DAY, 0),        # ... an 8-day-old one does not
    ("3600", 7200, 0),         # service.open_run_max_s
    ("3600", 1800, 1),
])
def test_a_run_that_never_finished_stops_counting_as_co_runner(tmp_path, max_s, finish_after_s, co):
    env = {"SWAPAWARE_SERVICE__DB_PATH": str(tmp_path / "h.sqlite3")}
    if max_s:
        env["SWAPAWARE_SERVICE__OPEN_RUN_MAX_S"] = max_s
    cfg = load_config(env=env)
    store = HistoryStore(cfg.service.db_path)
    clock = Clock(1000)
    handler = PolicyHandler(cfg, store, None, clock=clock)  # no Slurm: unresolved runs still count
    try:
        handler.report_events(pb.ReportEventsRequest(events=[started(40, 1000, "s40", node="n1", gpus=(0,))]))
        t = 1000 + finish_after_s
        clock.t = t + 1
        handler.report_events(pb.ReportEventsRequest(events=[started(41, t - 60, "s41"), finished(41, t, "f41")]))
        assert _co_runners(store, "f41") == co
    finally:
        handler.close()
        store.close()


def test_an_open_run_with_a_time_limit_counts_until_the_limit_and_a_grace(world):
    handler, store, cli, clock = world
    d = admit(handler, "limited", time_limit_min=30)
    cli.live = [JobInstance(50, "c", 1000, 1001, 0, d.rewrite.admin_comment, "RUNNING", source="squeue")]
    clock.t = 1010
    handler.report_events(pb.ReportEventsRequest(events=[started(50, 1002, "s50")]))
    for job, start in ((51, 1002 + 3600), (52, 1002 + 3 * 3600)):  # within 30 min + 1 h, and after it
        cli.live = [JobInstance(job, "c", start - 1, start, 0, "", "RUNNING", source="squeue")]
        clock.t = start + 101
        handler.report_events(pb.ReportEventsRequest(events=[started(job, start, f"s{job}"),
                                                             finished(job, start + 100, f"f{job}")]))
    assert (_co_runners(store, "f51"), _co_runners(store, "f52")) == (1, 0)


# ----------------------------------------------------------------------------- (e) schema 2 -> 3
SCHEMA_2 = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE decisions (decision_id TEXT PRIMARY KEY, decided_at REAL NOT NULL, job_class TEXT NOT NULL,
    user TEXT NOT NULL, account TEXT NOT NULL, partition TEXT NOT NULL, job_name TEXT NOT NULL, action TEXT NOT NULL,
    shards INTEGER NOT NULL, model_version TEXT NOT NULL, keys_json TEXT NOT NULL, facts_pb BLOB NOT NULL,
    decision_pb BLOB NOT NULL);
CREATE INDEX decisions_user ON decisions(user, decided_at);
CREATE TABLE runs (job_id INTEGER PRIMARY KEY, decision_id TEXT NOT NULL DEFAULT '', node TEXT NOT NULL DEFAULT '',
    gpu_indices TEXT NOT NULL DEFAULT '[]', started_at REAL, finished_at REAL);
CREATE INDEX runs_node ON runs(node, started_at);
CREATE TABLE events (event_id TEXT PRIMARY KEY, kind TEXT NOT NULL, received_at REAL NOT NULL);
CREATE TABLE observations (event_id TEXT PRIMARY KEY, job_id INTEGER NOT NULL, decision_id TEXT NOT NULL,
    node TEXT NOT NULL, gpu_indices TEXT NOT NULL, started_at REAL, finished_at REAL NOT NULL, runtime_s REAL,
    exit_code INTEGER NOT NULL, peak_bytes INTEGER, oom INTEGER NOT NULL, co_runners INTEGER NOT NULL,
    shared INTEGER NOT NULL, telemetry_source TEXT NOT NULL, received_at REAL NOT NULL);
CREATE INDEX observations_job ON observations(job_id);
CREATE INDEX observations_decision ON observations(decision_id);
CREATE TABLE class_stats (level TEXT NOT NULL, key TEXT NOT NULL, stats_json TEXT NOT NULL, updated_at REAL NOT NULL,
    PRIMARY KEY (level, key));
INSERT INTO meta VALUES ('schema_version', '2');
"""


def schema_2_history(path: Path) -> pb.Decision:
    """A history as the previous build left it: decision X for job 5, its start and finish, a run of
    job 6 that never finished, X's class learned once."""
    d = pb.Decision(decision_id="X", action=pb.ACTION_SHARE, shards=1, job_class="class-x")
    with sqlite3.connect(path) as db:
        db.executescript(SCHEMA_2)
        db.execute("INSERT INTO decisions VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                   ("X", 100.0, "class-x", "alice", "proj", "gpu", "old", "share", 1, "m",
                    json.dumps({"class": "class-x"}), facts("old").SerializeToString(), d.SerializeToString()))
        db.execute("INSERT INTO runs VALUES (5, 'X', 'n1', '[0]', 110.0, 200.0)")
        db.execute("INSERT INTO runs VALUES (6, 'X', 'n1', '[1]', 150.0, NULL)")
        db.execute("INSERT INTO events VALUES ('s5', 'start', 110.0), ('f5', 'finish', 200.0)")
        db.execute("INSERT INTO observations VALUES ('f5', 5, 'X', 'n1', '[0]', 110.0, 200.0, 90.0, 0, ?, 0, 0, 1, "
                   "'nvml', 200.0)", (2 * GIB,))
        db.execute("INSERT INTO class_stats VALUES ('class', 'class-x', ?, 200.0)", (json.dumps({"runs": 1}),))
    os.chmod(path, 0o600)
    return d


def test_schema_2_history_is_migrated_in_place_and_keeps_everything(tmp_path):
    path = tmp_path / "history.sqlite3"
    schema_2_history(path)
    with ReadOnlyHistory(path) as h:  # reports read a schema-2 history as it is
        assert h.run_decisions([5, 6]) == {5: "X", 6: "X"}
        (o,) = h.observations_of([5])
        assert (o.instance, o.submit_time, o.peak_bytes) == ("legacy/5", 0, 2 * GIB)
    store = HistoryStore(path)
    try:
        assert store.decision("X").job_class == "class-x" and store.event_seen("f5")
        (o,) = store.observations(job_id=5)
        assert (o.decision_id, o.peak_bytes, o.instance) == ("X", 2 * GIB, "legacy/5")
        assert store.run(5).instance == "legacy/5" and store.run(6).finished_at is None
        with sqlite3.connect(path) as db:
            assert db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone() == ("3",)
            assert json.loads(db.execute("SELECT stats_json FROM class_stats").fetchone()[0]) == {"runs": 1}
        backup = Path(f"{path}.schema2.bak")
        assert stat.S_IMODE(backup.stat().st_mode) == 0o600
        with sqlite3.connect(backup) as db:
            assert db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone() == ("2",)
        # a new job 5 (its AdminComment names no decision) never inherits the legacy run's decision X
        cli = RecordingCli("22.05", live=[JobInstance(5, "c", 900, 901, 0, "", "RUNNING", source="squeue")])
        handler = PolicyHandler(load_config(env={"SWAPAWARE_SERVICE__DB_PATH": str(path)}), store, cli,
                                clock=Clock(1000))
        try:
            assert handler.job_started(started(5, 902, "s5-new").started).decision_id == ""
            fin = handler.job_finished(finished(5, 990, "f5-new", peak=GIB).finished)
            assert fin.applied and fin.decision_id == ""
        finally:
            handler.close()
        assert store.run_of("legacy/5").decision_id == "X" and store.run_of("c/5/900").decision_id == ""
    finally:
        store.close()
    HistoryStore(path).close()  # opening a migrated history again changes nothing
    with ReadOnlyHistory(path) as h:
        assert sorted(h.run_instances([5])) == [(5, 0, "X")]


def test_a_history_of_an_unknown_schema_is_refused(tmp_path):
    path = tmp_path / "h.sqlite3"
    with sqlite3.connect(path) as db:
        db.executescript("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);"
                         "INSERT INTO meta VALUES ('schema_version', '1');")
    os.chmod(path, 0o600)
    with pytest.raises(RuntimeError, match="history schema 1, this build reads 3"):
        HistoryStore(path)


# ----------------------------------------------------------------------------- multi-node jobs
def test_a_multi_node_jobs_per_node_observations_are_kept_and_not_learned(world):
    """Each node of a 3-node job reports its own part (the batch script's node the allocation, the
    others nothing): all three are kept with the job's decision; the class learns none of them, while
    a one-node job of the same class is learned."""
    handler, store, cli, clock = world
    wide = admit(handler, "wide", min_nodes=3)
    assert "multi_node" in [r.code for r in wide.reasons]
    cli.live = [JobInstance(7, "c", 1000, 1002, 0, wide.rewrite.admin_comment, "COMPLETING", source="squeue")]
    clock.t = 1100
    events = [finished(7, 1090, f"f-{n}", node=n, peak=p, started_at=1002)
              for n, p in (("n1", 2 * GIB), ("n2", 1), ("n3", 1))]
    results = handler.report_events(pb.ReportEventsRequest(events=events)).results
    assert [(r.code, r.applied, r.decision_id) for r in results] == [(0, True, wide.decision_id)] * 3
    assert sorted(o.node for o in store.observations(job_id=7)) == ["n1", "n2", "n3"]
    assert class_stats(store, wide) == {}
    one = admit(handler, "wide")  # the same class, on one node
    assert one.job_class == wide.job_class
    cli.live = [JobInstance(8, "c", 1101, 1102, 0, one.rewrite.admin_comment, "COMPLETING", source="squeue")]
    clock.t = 1200
    handler.report_events(pb.ReportEventsRequest(events=[finished(8, 1190, "f-one", peak=2 * GIB, started_at=1102)]))
    assert class_stats(store, one)["runs"] == 1
