"""The admission-table catch-up archive (admission/archive.py) on both of its homes: the
SQLite file beside a SQLite history, and the tables in a MariaDB history's database (a real
private mariadbd, tests/mariadb_server.py), where every service sharing the database reads every
writer's versions. Row counts are read on a connection of the test's own."""
from __future__ import annotations

import sqlite3
import threading

import pytest

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.admission.archive import CHUNK, TableArchive, archive_path, open_archive
from policy_service.history.journal_records import DecisionRecord
from policy_service.history.db import MyConn
from policy_service.config import load_config
from policy_service.core import admission
from policy_service.core.policy import parse_admin_comment

from tests.waiting import wait_for

from tests.adapter.serving.test_service import facts


def _template(version, entry, state, action="share"):
    ref = admission.TableRef(version, entry, state)
    d = pb.Decision(decision_id=admission.PLACEHOLDER_ID, action=pb.ACTION_SHARE)
    d.rewrite.admin_comment = admission.with_table_ref(
        f"swapaware:v1 id={admission.PLACEHOLDER_ID} model=m action={action} shards=2", ref, 400)
    return DecisionRecord(admission.PLACEHOLDER_ID, 0.0, "k", "u", "a", "p", f"job{entry}", action, 2, "m",
                          {"class": "k"}, facts(name=f"job{entry}").SerializeToString(), d.SerializeToString())


class Home:
    """Where a history's archive lives: ``open(clock)`` an archive as a service opens it (the
    history opened first), ``count(table)`` its rows on another connection."""

    def __init__(self, backend, tmp_path):
        self.backend, self.db = backend, tmp_path / "history.sqlite3"
        self.store = backend.open(self.db, accept_empty=True)  # creates the MariaDB tables
        self.archives: list[TableArchive] = []
        if backend.name == "sqlite":
            self._conn = sqlite3.connect(str(archive_path(str(self.db))))
            self._prefix = ""
        else:
            self._conn = MyConn(backend.history, read_only=True)
            self._prefix = "admission_"

    def open(self, clock) -> TableArchive:
        cfg = load_config(env={"SWAPAWARE_SERVICE__DB_PATH": str(self.db), **self.backend.env})
        arc = open_archive(cfg)
        arc.clock = clock
        self.archives.append(arc)
        return arc

    def count(self, table: str) -> int:
        return self._conn.execute(f"SELECT COUNT(*) FROM {self._prefix}{table}").fetchone()[0]

    def close(self) -> None:
        for arc in self.archives:
            arc.close()
        self._conn.close()
        self.store.close()


@pytest.fixture
def home(history_backend, tmp_path):
    h = Home(history_backend, tmp_path)
    yield h
    h.close()


def comment_of(rec: DecisionRecord) -> str:
    return pb.Decision.FromString(rec.decision_pb).rewrite.admin_comment


def test_archive_keeps_one_copy_across_versions_and_prunes_what_no_version_names(home):
    now = [1000.0]
    arc = home.open(lambda: now[0])
    v1, v2, v3 = "1" * 16, "2" * 16, "3" * 16
    n = 3 * CHUNK  # three chunks
    arc.put(v1, {(i, s): _template(v1, i, s) for i in range(n) for s in ("short", "normal")})
    count = home.count
    assert (count("blobs"), count("chunks")) == (n, 3)  # an entry's states are stored together
    now[0] = 2000.0
    # the next version: one entry changed, in the last chunk
    arc.put(v2, {(i, s): _template(v2, i, s, "whole_gpu" if i == n - 1 else "share")
                 for i in range(n) for s in ("short", "normal")})
    assert (count("blobs"), count("chunks")) == (n + 1, 4)
    for v, i, action in ((v1, n - 1, "share"), (v2, n - 1, "whole_gpu"), (v2, 5, "share")):
        rec = arc.lookup(v, i, "normal")
        assert admission.parse_table_ref(comment_of(rec)) == admission.TableRef(v, i, "normal")
        assert parse_admin_comment(comment_of(rec))["action"] == action and rec.job_name == f"job{i}"
    assert arc.lookup(v2, 5, "long") is None and arc.lookup(v3, 5, "normal") is None
    # its own file: a template made once per slot (the catch-up looks one up per job); on a shared
    # database each lookup reads the row again (another service may have pruned it)
    same = arc.lookup(v1, 5, "normal") is arc.lookup(v1, 5, "normal")
    assert same == (home.backend.name == "sqlite")
    now[0] = 3000.0
    arc.put(v3, {(0, "*"): _template(v3, 0, "*")})
    assert arc.touch(v2, 2500.0) and arc.touch(v2, 2500.0) and not arc.touch("4" * 16)
    assert [v for v, _ in arc.versions()] == [v3, v2, v1]
    assert arc.prune(2000.0) == 1  # v1 only
    assert arc.lookup(v1, 5, "normal") is None and arc.lookup(v2, 5, "normal") is not None
    assert (count("blobs"), count("chunks")) == (n + 1, 4)  # v1's last entry and chunk went, v3's came
    assert arc.prune(3500.0) == 2 and (count("blobs"), count("chunks"), count("versions")) == (0, 0, 0)


def test_on_mariadb_every_service_reads_every_writers_versions(mariadb_backend, tmp_path):
    """Two services on one MariaDB history, as after scontrol takeover: b looks up what a put,
    a what b put; b's prune drops what a remembered, and a's next put stores it again (a trusts
    no memory of row ids on a shared database). No file beside the history."""
    home = Home(mariadb_backend, tmp_path)
    try:
        now = [1000.0]
        a, b = home.open(lambda: now[0]), home.open(lambda: now[0])
        va, vb, vc = "a" * 16, "b" * 16, "c" * 16
        a.put(va, {(1, "normal"): _template(va, 1, "normal"), (2, "*"): _template(va, 2, "*", "whole_gpu")})
        assert a.lookup(va, 2, "*") is not None  # a remembers the chunk of va
        got = b.lookup(va, 1, "normal")
        assert admission.parse_table_ref(comment_of(got)) == admission.TableRef(va, 1, "normal")
        now[0] = 2000.0
        b.put(vb, {(1, "normal"): _template(vb, 1, "normal")})  # the same template: stored once
        assert (home.count("blobs"), home.count("versions")) == (2, 2)
        assert parse_admin_comment(comment_of(a.lookup(vb, 1, "normal")))["action"] == "share"
        assert b.prune(1500.0) == 1  # va, and entry 2's template only va named
        assert home.count("blobs") == 1 and a.lookup(va, 2, "*") is None
        now[0] = 3000.0
        a.put(vc, {(2, "*"): _template(vc, 2, "*", "whole_gpu"), (1, "normal"): _template(vc, 1, "normal")})
        assert parse_admin_comment(comment_of(b.lookup(vc, 2, "*")))["action"] == "whole_gpu"
        assert [v for v, _ in b.versions()] == [vc, vb]
        assert not archive_path(str(home.db)).exists()
    finally:
        home.close()


def test_on_mariadb_a_put_waits_for_another_services_prune(mariadb_backend, mariadb_server, tmp_path):
    """b's prune has deleted an old version and the templates only it named, not yet committed;
    a puts a version naming those templates again. a waits for b's commit (its locking read seen
    waiting) and then stores them anew: its version reads back whole. (Were a to read the blobs
    before b committed, its version would name rows b's commit deletes.)"""
    home = Home(mariadb_backend, tmp_path)
    try:
        now = [1000.0]
        a, b = home.open(lambda: now[0]), home.open(lambda: now[0])
        old, new = "0" * 16, "1" * 16
        n = 2 * CHUNK
        a.put(old, {(i, "*"): _template(old, i, "*") for i in range(n)})
        now[0] = 2000.0
        collected, go, errors = threading.Event(), threading.Event(), []
        collect = b._collect

        def held_collect(c):  # b's prune, paused before its commit
            collect(c)
            collected.set()
            go.wait(60)
        b._collect = held_collect

        def run(what):
            try:
                what()
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
        pruning = threading.Thread(target=run, args=(lambda: b.prune(1500.0),))
        pruning.start()
        wait_for(collected.is_set, 30, "b's prune to delete, uncommitted")
        putting = threading.Thread(target=run, args=(lambda: a.put(new, {(i, "*"): _template(new, i, "*")
                                                                         for i in range(n)}),))
        putting.start()
        waiting = ("SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID != CONNECTION_ID() "
                   "AND INFO LIKE 'SELECT version FROM admission_versions FOR UPDATE'")  # (not b's: it paused)
        wait_for(lambda: not putting.is_alive() or mariadb_server.sql(waiting).stdout.strip() != "0", 30,
                 "a's put to finish or wait for b's locks")
        go.set()
        pruning.join(60)
        putting.join(60)
        assert not errors and not pruning.is_alive() and not putting.is_alive(), errors
        assert [v for v, _ in a.versions()] == [new]
        assert all(b.lookup(new, i, "*") is not None for i in range(n))
        assert home.count("blobs") == n
    finally:
        home.close()


def test_the_new_writer_records_the_old_writers_table_made_decisions_from_their_template(history_backend, tmp_path):
    """After scontrol takeover: jobs the plugin decided from a's table are caught up by b. With
    the history on MariaDB b finds a's version in the shared archive and records each job from
    its template (class keys, job name); with SQLite histories each archive is its service's
    own and b records them from the AdminComment alone (no keys)."""
    from policy_service.admission.catchup import AdmissionCatchup
    from policy_service.history.decision_log import DecisionLog
    from policy_service.core.types import KeyLevel

    from tests.adapter.admission.test_admission_catchup import CommentsCli, job, lua_id, made_comment

    homes = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        homes.append(Home(history_backend, tmp_path / name))
    a, b = homes
    try:
        version = "5" * 16
        tpl = _template(version, 3, "normal")
        a.open(lambda: 1000.0).put(version, {(3, "normal"): tpl})
        cli = CommentsCli()
        ids = [lua_id(60 + i) for i in range(3)]
        cli.live = [job(90 + i, made_comment(tpl, d)) for i, d in enumerate(ids)]
        log = DecisionLog(tmp_path / "b" / "journal", b.store.record)
        assert AdmissionCatchup(b.store, log, b.open(lambda: 1000.0), cli).from_live() == 3
        log.flush()
        log.close()
        rows = [b.store.decision(d) for d in ids]
        assert [r.decision.decision_id for r in rows] == ids
        if history_backend.name == "mariadb":
            assert all(r.keys == {KeyLevel.CLASS: "k"} and r.job_class == "k" for r in rows), rows
        else:
            assert all(r.keys == {} for r in rows), rows
    finally:
        for h in homes:
            h.close()
