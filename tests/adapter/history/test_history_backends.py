"""The history on both backends (real SQLite, a real private MariaDB started by the session
fixture): the writer lease and its fence, the decision journal waiting for the lease, keys
compared byte for byte, and (MariaDB) a connection killed under the store."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from policy_service.history.decision_log import DecisionLog
from policy_service.history.journal_records import DecisionRecord
from policy_service.history.store import HistoryStore, HistoryUnavailable, NotWriter
from policy_service.core.types import ClassStats, KeyLevel
from tests.waiting import wait_for


def record(i: int, prefix: str = "d") -> DecisionRecord:
    return DecisionRecord(decision_id=f"{prefix}{i}", decided_at=1000.0 + i, job_class="c", user="alice",
                          account="proj", partition="gpu", job_name="train", action="share", shards=2,
                          model_version="m", keys={"class": "c"}, facts_pb=b"\x00facts", decision_pb=b"\x01")


@pytest.fixture
def two(history_backend, tmp_path):
    """Two services' stores on one history, fenced as holders "a" and "b"."""
    db = tmp_path / "history.sqlite3"
    a = history_backend.open(db, fence="a")
    b = history_backend.open(db, fence="b")
    yield a, b
    a.close()
    b.close()


def test_two_holders_on_one_history_only_the_lease_holder_writes(two):
    a, b = two
    assert a.claim_writer("a", 30.0).epoch == 1
    assert b.claim_writer("b", 30.0) is None  # never takes an unexpired lease of another
    a.settle_decisions(["x"], [], 1.0)
    with pytest.raises(NotWriter, match="the writer is a"):
        b.settle_decisions(["y"], [], 1.0)
    with pytest.raises(NotWriter):
        b.record([record(1)])
    assert a.decision_status("x") == "held" and b.decision_status("y") == "" and b.decision("d1") is None
    lease = b.writer()
    assert (lease.holder, lease.epoch) == ("a", 1) and lease.expires_at - lease.now == pytest.approx(30.0, abs=2.0)
    renewed = a.claim_writer("a", 30.0)  # renewing keeps the epoch
    assert (renewed.holder, renewed.epoch) == ("a", 1)


def test_an_expired_lease_is_taken_over_with_the_next_epoch_and_the_old_holder_writes_nothing(two):
    a, b = two
    first = a.claim_writer("a", 0.3)
    a.record([record(1)])
    wait_for(lambda: not b.writer().valid, 10, "a's lease to expire on the database's clock")
    with pytest.raises(NotWriter, match="expired"):  # expired: a writes nothing, even before b claims
        a.record([record(2)])
    taken = b.claim_writer("b", 30.0)
    assert (taken.holder, taken.epoch) == ("b", first.epoch + 1)
    with pytest.raises(NotWriter, match="the writer is b"):
        a.record_decision(decision_id="d3", decided_at=1.0, job_class="c", user="u", account="a", partition="p",
                          job_name="n", action="share", shards=1, model_version="m", keys={KeyLevel.CLASS: "c"},
                          facts_pb=b"", decision_pb=b"")
    assert a.claim_writer("a", 30.0) is None
    b.record([record(4)])
    assert [d.decision_id for d in b.decisions()] == ["d1", "d4"]


def test_a_holder_whose_lease_went_round_keeps_out_until_it_claims_again(two):
    """a released, b took and released, the lease is free: a's fence still refuses a write with
    the epoch it last had; its next claim (a new epoch) lets it write."""
    a, b = two
    a.claim_writer("a", 30.0)
    a.release_writer("a")
    assert not a.writer().valid
    b.claim_writer("b", 30.0)
    b.release_writer("b")
    with pytest.raises(NotWriter):
        a.settle_decisions(["x"], [], 1.0)
    again = a.claim_writer("a", 30.0)
    assert again.epoch == 3
    a.settle_decisions(["x"], [], 1.0)
    assert b.decision_status("x") == "held"


def test_an_unfenced_store_never_looks_at_the_lease(history_backend, tmp_path):
    db = tmp_path / "history.sqlite3"
    fenced = history_backend.open(db, fence="b")
    free = history_backend.open(db)
    try:
        fenced.claim_writer("b", 30.0)
        free.settle_decisions(["x"], [], 1.0)  # the single-host default: no lease, no check
        with pytest.raises(NotWriter, match="the writer is b"):
            history_backend.open(db, fence="c").settle_decisions(["y"], [], 1.0)
        assert fenced.decision_status("x") == "held" and fenced.decision_status("y") == ""
    finally:
        fenced.close()
        free.close()


def test_the_journal_keeps_a_standbys_decisions_until_it_is_the_writer(two, tmp_path):
    a, b = two
    a.claim_writer("a", 30.0)
    journal = tmp_path / "b.journal"
    log = DecisionLog(journal, b.record)
    for i in range(5):
        log.record(record(i, "s"))
    wait_for(lambda: "NotWriter" in log.failing, 10, "the standby's writer to be refused")
    assert b.known_decisions([f"s{i}" for i in range(5)]) == set()
    assert len(list(log.records())) == 5
    log.close()  # stopped while standby: at once, the decisions stay journaled
    assert len(list(log.records())) == 5
    # next start, still standby: it starts (nothing lost), then writes once it holds the lease
    log = DecisionLog(journal, b.record)
    a.release_writer("a")
    assert b.claim_writer("b", 30.0).epoch == 2
    log.flush()
    assert b.known_decisions([f"s{i}" for i in range(5)]) == {f"s{i}" for i in range(5)}
    log.close()
    assert journal.stat().st_size == 0


def test_a_new_writer_commits_its_journal_at_once_not_after_the_back_off(two, tmp_path, monkeypatch):
    import policy_service.history.decision_log as decision_log
    monkeypatch.setattr(decision_log, "RETRY_MIN_S", 60.0)  # a refused write would wait a minute
    monkeypatch.setattr(decision_log, "RETRY_MAX_S", 60.0)
    a, b = two
    a.claim_writer("a", 30.0)
    log = DecisionLog(tmp_path / "b.journal", b.record)
    try:
        log.record(record(0, "n"))
        wait_for(lambda: "NotWriter" in log.failing, 10, "the standby's writer to be refused")
        a.release_writer("a")
        b.claim_writer("b", 30.0)
        log.retry_now()  # what the service does when its role keeper makes it the writer
        wait_for(lambda: b.known_decisions(["n0"]) == {"n0"}, 20, "the journaled decision in the history")
        assert log.failing == ""
    finally:
        log.close()


def test_keys_are_compared_byte_for_byte(history_backend, tmp_path):
    store = history_backend.open(tmp_path / "history.sqlite3")
    try:
        for name, samples in (("Alice/train", 1), ("alice/train", 2), ("alice/train ", 3)):
            store.record_finish(_obs(name), {KeyLevel.USER_NAME: name},
                                lambda level, s, n=samples: ClassStats(samples=s.samples + n))
        got = {k: store.stats({KeyLevel.USER_NAME: k})[KeyLevel.USER_NAME].samples
               for k in ("Alice/train", "alice/train", "alice/train ")}
        assert got == {"Alice/train": 1, "alice/train": 2, "alice/train ": 3}
    finally:
        store.close()


def _obs(name: str):
    from policy_service.history.store import ObservationRow
    return ObservationRow(f"e-{name}", 1, "", "n1", (0,), 1.0, 2.0, 1.0, 0, 1, False, 0, False, "none", 2.0,
                          f"i/{name}", 0)


def test_a_killed_mariadb_connection_is_reopened(mariadb_backend, mariadb_server, tmp_path):
    history_backend = mariadb_backend
    store = history_backend.open(tmp_path / "history.sqlite3")
    try:
        store.settle_decisions(["x"], [], 1.0)
        assert store.decision_status("x") == "held"
        for conn in (store._rconn, store._conn):
            mariadb_server.sql(f"KILL {conn._raw.thread_id()}")
        assert store.decision_status("x") == "held"  # a read: retried once on a new connection
        with pytest.raises(HistoryUnavailable, match="lost"):
            store.settle_decisions(["y"], [], 1.0)  # a write: refused (retryable), never half done
        store.settle_decisions(["y"], [], 1.0)  # ... and the next one works
        assert store.decision_status("y") == "held"
    finally:
        store.close()


def test_a_write_blocked_by_another_sessions_lock_is_retryable(mariadb_backend, tmp_path):
    """innodb_lock_wait_timeout (5 s in the test server) runs out: HistoryUnavailable, nothing
    written; the DecisionLog writer retries such errors."""
    history_backend = mariadb_backend
    import pymysql
    store = history_backend.open(tmp_path / "history.sqlite3")
    h = history_backend.history
    other = pymysql.connect(unix_socket=h.unix_socket, user=h.user, password=Path(h.password_file).read_text().strip(),
                            database=h.database, autocommit=False)
    try:
        store.settle_decisions(["x"], [], 1.0)
        with other.cursor() as cur:
            cur.execute("SELECT * FROM decision_status WHERE decision_id='x' FOR UPDATE")
        t0 = time.monotonic()
        with pytest.raises(HistoryUnavailable, match="lock conflict"):
            store.settle_decisions([], ["x"], 2.0)
        assert time.monotonic() - t0 >= 4.0
        other.rollback()
        assert store.decision_status("x") == "held"
    finally:
        other.close()
        store.close()


def test_decisions_wait_in_the_journal_while_the_database_is_down(tmp_path):
    """A MariaDB server of its own, stopped under the store: the writer gets HistoryUnavailable
    (cannot connect) and retries; the decisions are in the history once the server is back."""
    from tests.mariadb_server import MariaDbServer, missing
    if missing():
        pytest.skip(missing())
    server = MariaDbServer.start()
    try:
        store = HistoryStore(tmp_path / "history.sqlite3", mariadb=server.database("down"))
        log = DecisionLog(tmp_path / "journal", store.record)
        log.record(record(0))
        log.flush()
        server.shutdown()
        for i in range(1, 6):
            log.record(record(i))
        wait_for(lambda: "HistoryUnavailable" in log.failing, 30, lambda: f"the writer to fail ({log.failing!r})")
        assert len(list(log.records())) == 5
        server.launch()
        log.flush()
        assert store.known_decisions([f"d{i}" for i in range(6)]) == {f"d{i}" for i in range(6)}
        log.close()
        store.close()
    finally:
        server.stop()


def test_the_lease_is_renewed_while_a_data_write_is_cut_off(mariadb_backend, short_dir, tmp_path):
    """A host cut off the network in the middle of a fenced write: the server ends the session idle
    in its transaction (history.idle_transaction_timeout_s), but the service's thread waits for an
    answer up to the write's 120 s timeout, holding the store's write lock, and a link that comes
    back delivers that answer only at TCP's next back-off. The lease has a session of its own:
    the claim of a service back in control, or a renewal, goes on meanwhile (the HA suite's
    cut-off primary found its lease held up 30 s and more behind such a write)."""
    import dataclasses
    import threading
    from policy_service.history.db import LEASE_LOCK_WAIT_S
    from tests.adapter.history.held_write import held_write
    from tests.socket_relay import Relay
    relay = Relay(short_dir / "my.sock", mariadb_backend.history.unix_socket)
    cfg = dataclasses.replace(mariadb_backend.history, unix_socket=relay.path, idle_transaction_timeout_s=2)
    store = HistoryStore(tmp_path / "history.sqlite3", fence="a", mariadb=cfg)
    writer = None
    try:
        assert store.claim_writer("a", 30.0).epoch == 1
        assert store._lconn.execute("SELECT @@SESSION.innodb_lock_wait_timeout").fetchone()[0] == LEASE_LOCK_WAIT_S
        store.settle_decisions(["x"], [], 1.0)
        writer, ended = held_write(store, relay)

        def renew():
            try:
                return store.claim_writer("a", 30.0)
            except HistoryUnavailable:  # the lease row still locked: the server has not yet ended that session
                return None

        got: list = []
        claimer = threading.Thread(target=lambda: got.append(wait_for(renew, 20, "the renewal", 0.2)), daemon=True)
        claimer.start()
        claimer.join(30)
        assert not claimer.is_alive(), "the lease's renewal waited behind the cut-off write"
        assert writer.is_alive() and store._lock.locked()  # the write was still cut off meanwhile
        assert (got[0].holder, got[0].epoch) == ("a", 1)
        assert store.writer().valid
    finally:
        relay.release()
        if writer is not None:
            writer.join(30)
        relay.close()
    try:
        assert isinstance(ended.get("outcome"), HistoryUnavailable), ended  # its session had ended
        assert store.decision_status("x") == "held"  # nothing of it written
    finally:
        store.close()


def test_a_write_whose_link_went_down_ends_within_dead_link_s(mariadb_backend, tmp_path):
    """A controller's link goes down while its write waits for the answer (over TCP, in a network
    namespace of the test's own: dead_link_driver.py). The write ends with HistoryUnavailable
    within DEAD_LINK_S and the keepalive's probes, not at its 120 s read timeout: the journal's
    writer tries again on a new session as soon as the link is back."""
    import json
    import subprocess
    import sys
    from policy_service.history.db import DEAD_LINK_S, KEEPALIVE_S
    h = mariadb_backend.history
    args = {"socket": h.unix_socket, "database": h.database, "user": h.user, "password_file": h.password_file,
            "db_path": str(tmp_path / "history.sqlite3")}
    run = subprocess.run(["unshare", "-n", sys.executable, "-m", "tests.adapter.history.dead_link_driver",
                          json.dumps(args)], cwd=Path(__file__).resolve().parents[3], capture_output=True,
                         text=True, timeout=200)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.splitlines()[-1])
    print(f"\n[dead link] the write ended {got['after_cut_s']} s after its link went down: {got['outcome']} "
          f"({got['message']})")
    assert got["outcome"] == "HistoryUnavailable", got
    assert got["after_cut_s"] <= DEAD_LINK_S + 2 * KEEPALIVE_S + 5, got  # (without: 120 s, the read timeout)


def test_an_empty_mariadb_where_this_host_had_a_history_is_refused(mariadb_backend, tmp_path):
    """Switching [history] to an empty MariaDB without migrating: refused (HistoryMissing names
    the migrate command); accepted for one start with accept_empty."""
    from policy_service.history.store import HistoryMissing
    db = tmp_path / "history.sqlite3"
    HistoryStore(db).close()  # this host's SQLite history (and its marker)
    with pytest.raises(HistoryMissing, match="history migrate --from"):
        mariadb_backend.open(db)
    store = mariadb_backend.open(db, accept_empty=True)
    store.close()
    mariadb_backend.open(db).close()  # holds the tables now: opened without a word


def test_a_writer_cut_off_inside_a_transaction_keeps_no_lease_from_the_other(mariadb_backend, tmp_path):
    """A writer whose host drops off the network after a fenced write locked the lease row, before
    its commit, leaves its session idle inside the transaction, and the server does not notice the
    dead peer for hours: every claim of the other service waited on that lock, however long the
    lease had expired. history.idle_transaction_timeout_s ends such a session (its transaction
    rolled back) and the other service takes the lease."""
    import dataclasses
    short = dataclasses.replace(mariadb_backend, history=dataclasses.replace(mariadb_backend.history,
                                                                              idle_transaction_timeout_s=2))
    db = tmp_path / "history.sqlite3"
    a, b = short.open(db, fence="a"), mariadb_backend.open(db, fence="b")
    try:
        first = a.claim_writer("a", 0.5)
        assert a._conn.execute("SELECT @@SESSION.idle_transaction_timeout").fetchone()[0] == 2
        a._conn.begin()  # what a fenced write does first, and then its host is cut off: nothing more
        a._conn.execute("SELECT holder FROM writer_lease WHERE name=? FOR UPDATE", ("history",))
        wait_for(lambda: not b.writer().valid, 10, "a's lease to expire on the database's clock")
        t0 = time.monotonic()

        def claim():
            try:
                return b.claim_writer("b", 30.0)
            except HistoryUnavailable:  # the test server's lock wait (5 s) ran out: a's lock still held
                return None

        taken = wait_for(claim, 20, "b's claim of the expired lease", 0.2)
        assert (taken.holder, taken.epoch) == ("b", first.epoch + 1)
        assert time.monotonic() - t0 < 5.0  # a's session ended after 2 s idle, within b's first lock wait
    finally:
        a.close()
        b.close()
