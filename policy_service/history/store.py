"""History store: decisions, job runs, observations and per-key statistics in SQLite (WAL).

Two connections, each behind its own lock: writes are short transactions on one; reads go
through the other, so a write that waits for SQLite's file lock (another process holding it, a
slow disk) never holds up a read (WAL: readers run beside a writer). Admit only reads. Replayed
events (same event id) are applied once.
"""
from __future__ import annotations

import collections
import json
import logging
import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping

from policy_service.history.db import (SQLITE, MARIADB_SCHEMA, HistoryUnavailable, MyConn,  # noqa: F401
                                       mariadb_engine, retryable)
from policy_service.history.file import SqliteFile, _identity
from policy_service.history.guard import (HistoryMissing, HistoryOwnerError, before_new_history,  # noqa: F401
                                          note_history, private_history_file)
from policy_service.history.read import HistoryUnreadable, ReadOnlyHistory  # noqa: F401  (API)
from policy_service.history.schema import (  # noqa: F401  (the rows are part of this module's API)
    DECISION_COLS,
    LEGACY_PREFIX,
    OBSERVATION_COLS,
    RUN_COLS,
    SCHEMA,
    SCHEMA_VERSION,
    UNRESOLVED_PREFIX,
    DecisionRow,
    ObservationRow,
    RunRow,
    checked_stats,
    decision_row,
    migrate,
    observation_row,
    run_row,
    stats_from_json,
    stats_to_json,
    stored_version,
    unresolved_key,
)
from policy_service.history.lease import FencedWrites, NotWriter, WriterLease  # noqa: F401  (API)
from policy_service.core.types import ClassStats, KeyLevel
from policy_service.history.config import HistoryBackend, HistoryConfig

log = logging.getLogger(__name__)
# What HistoryStore remembers of the statistics it read (their stored text, checked): a few MB
# (a class key's text is ~0.5 KB, a wide key's up to ~10 KB with 64 users' figures).
STATS_MEMO_CHARS = 8 << 20


class HistoryStore(SqliteFile, FencedWrites):
    """The history: SQLite at ``path`` (':memory:' for tests of callers), or a MariaDB database
    (``mariadb``: its [history] config; ``open_history`` picks from the Config).

    ``fence``: this service's holder name in the writer lease (history/lease.py): every write
    transaction then checks, inside itself, that this holder holds the lease it last claimed, and
    raises ``NotWriter`` (nothing written) otherwise. None (one host): no check at all."""

    def __init__(self, path: Path | str, accept_empty: bool = False, *, fence: str | None = None,
                 mariadb: HistoryConfig | None = None):
        """``accept_empty``: start a new history even where files show one existed
        (``history_guard``; otherwise ``HistoryMissing``)."""
        self.fence = fence or None
        # stored statistics text -> checked_stats of it (``_checked``), least recently used first
        self._stats_memo: collections.OrderedDict[str, tuple[ClassStats, tuple[str, ...]]] = collections.OrderedDict()
        self._stats_memo_chars = 0
        self._stats_memo_lock = threading.Lock()
        self._fence_epoch: int | None = None
        self._ident: tuple[int, int] | None = None
        if mariadb is not None:
            self._open_mariadb(path, mariadb, accept_empty)
            return
        self.engine = SQLITE
        self.path = self.where = str(path)
        db = Path(self.path)
        on_disk = self.path != ":memory:"
        blank = on_disk and (not db.exists() or db.stat().st_size == 0)
        if blank:
            before_new_history(db, accept_empty, "is missing" if not db.exists() else "is an empty file")
        if on_disk:
            private_history_file(db)
        self._conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=10.0)
        self._lock = threading.Lock()
        with self._lock:
            before = stored_version(self._conn)
            if on_disk and before is None and not blank:
                try:
                    before_new_history(db, accept_empty, "holds no swapaware tables")
                except HistoryMissing:
                    self._conn.close()
                    raise
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")
            if before is not None and before < SCHEMA_VERSION:
                self._backup(before)
                migrate(self._conn)
                log.warning("history %s: schema %d migrated to %d in place (runs and observations it held are "
                            "kept as legacy: known by job id only)", self.path, before, stored_version(self._conn))
            self._conn.executescript(SCHEMA)
            self._check_version()
        if on_disk:
            note_history(db, created=before is None)
        self._rconn, self._rlock = self._conn, self._lock
        if self.path != ":memory:":  # (an in-memory database is one connection's own)
            self._rconn = self._reader()
            self._rlock = threading.Lock()
            self._ident = _identity(self.path)

    def _open_mariadb(self, path: Path | str, cfg: HistoryConfig, accept_empty: bool) -> None:
        """``path`` stays service.db_path: the decision journal lies beside it, on local disk. An
        empty database where files beside ``path`` show that this host had a history (its SQLite
        file's marker, a journal) is refused unless ``accept_empty``: a switch of backend without
        ``swapaware history migrate`` would start every class over without a word."""
        self.engine, self.path, self.where = mariadb_engine(), str(path), cfg.where()
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._conn, self._lock = MyConn(cfg), threading.Lock()
        self._rconn, self._rlock = MyConn(cfg, read_only=True), threading.Lock()
        with self._lock:
            before = stored_version(self._conn, self.engine)
            if before is None and self.path != ":memory:":
                before_new_history(Path(self.path), accept_empty, f"is not used: [history] names {self.where}, which "
                                   f"holds no swapaware tables (copy the SQLite history there first: `swapaware "
                                   f"history migrate --from {self.path}`)")
            if before is not None and before < SCHEMA_VERSION:
                migrate(self._conn, self.engine)
            for statement in MARIADB_SCHEMA:
                self._conn.execute(statement)
            self._check_version()
        if before is None:
            log.warning("history %s: a new, empty history created", self.where)

    def _check_version(self) -> None:
        self._conn.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
        found = self._conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0]
        if int(found) != SCHEMA_VERSION:
            raise RuntimeError(f"{self.where}: history schema {found}, this build reads {SCHEMA_VERSION}")

    def _read(self, sql: str, args=()) -> list[tuple]:
        """One statement on the read connection (its own snapshot; never waits for a writer)."""
        with self._rlock:
            return list(self._rconn.execute(sql, args).fetchall())

    def close(self) -> None:
        with self._lock:
            self._conn.close()
        if self._rconn is not self._conn:
            with self._rlock:
                self._rconn.close()

    @property
    def seq(self) -> str:
        """The column that numbers decisions in the order they were recorded (a decision recorded
        again gets a new number): SQLite's rowid, MariaDB's ``seq``."""
        return "rowid" if self.engine is SQLITE else "seq"

    def open_reader(self):
        """A read-only connection of its own (for a long scan that must not hold up Admit's reads);
        the caller closes it. Statements in SQLite's spelling, as everywhere in the store."""
        if self.engine is SQLITE:
            return sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=10)
        return MyConn(self._conn.cfg, read_only=True)

    # --- decisions -----------------------------------------------------------------------
    def record_decision(self, *, decision_id: str, decided_at: float, job_class: str, user: str, account: str,
                        partition: str, job_name: str, action: str, shards: int, model_version: str,
                        keys: Mapping[KeyLevel, str], facts_pb: bytes, decision_pb: bytes) -> None:
        keys_json = json.dumps({k.value: v for k, v in keys.items()}, sort_keys=True)
        row = (decision_id, decided_at, job_class, user, account, partition, job_name, action, shards, model_version,
               keys_json, facts_pb, decision_pb)
        if self.fence is not None:
            with self._tx() as c:
                c.execute(_INSERT_DECISION, row)
            return
        with self._lock:  # one statement: autocommit is its own transaction
            self._conn.execute(_INSERT_DECISION, row)

    def record(self, records) -> None:
        """Decisions from the decision journal (history.decision_log.DecisionRecord), in one
        transaction; a decision recorded again (journal replay) is the same row."""
        rows = [(r.decision_id, r.decided_at, r.job_class, r.user, r.account, r.partition, r.job_name, r.action,
                 r.shards, r.model_version, json.dumps(r.keys, sort_keys=True), r.facts_pb, r.decision_pb)
                for r in records]
        with self._tx() as c:
            c.executemany(_INSERT_DECISION, rows)

    def decision(self, decision_id: str) -> DecisionRow | None:
        rows = self._read(f"SELECT {DECISION_COLS} FROM decisions WHERE decision_id=?", (decision_id,))
        return decision_row(rows[0]) if rows else None

    def known_decisions(self, decision_ids: Iterable[str]) -> set[str]:
        """Which of these decision ids the history holds (recorded, or known as never held)."""
        ids = sorted(set(decision_ids))
        known: set[str] = set()
        for i in range(0, len(ids), 500):
            part = ids[i:i + 500]
            marks = ",".join("?" * len(part))
            known.update(r[0] for r in self._read(
                f"SELECT decision_id FROM decisions WHERE decision_id IN ({marks}) UNION "
                f"SELECT decision_id FROM decision_status WHERE decision_id IN ({marks})", part + part))
        return known

    def decisions(self) -> Iterator[DecisionRow]:
        ids = [r[0] for r in self._read("SELECT decision_id FROM decisions ORDER BY decided_at")]
        for d_id in ids:
            row = self.decision(d_id)
            if row is not None:
                yield row

    # --- whether Slurm held a decision (slurm/reconcile.py) -------------------------------
    def unchecked_decisions(self, since: float, until: float) -> list[str]:
        """Decisions made in [since, until] whose status is not known yet."""
        return [r[0] for r in self._read(
            "SELECT d.decision_id FROM decisions d LEFT JOIN decision_status s USING (decision_id) "
            "WHERE s.decision_id IS NULL AND d.decided_at BETWEEN ? AND ?", (since, until))]

    def mark_decisions(self, ids: Iterable[str], status: str, at: float) -> None:
        with self._tx() as c:
            c.executemany("INSERT OR REPLACE INTO decision_status VALUES (?,?,?)", [(i, status, at) for i in ids])

    def drop_decisions(self, ids: Iterable[str]) -> int:
        """Delete the records (facts and decision) of decisions no job followed, that no observation
        names; their status rows stay, so that the id is still known as never held. Returns how
        many were deleted."""
        with self._tx() as c:
            return sum(c.execute("DELETE FROM decisions WHERE decision_id=? AND NOT EXISTS (SELECT 1 FROM "
                                 "observations WHERE decision_id=?)", (i, i)).rowcount for i in ids)

    def decision_status(self, decision_id: str) -> str:
        rows = self._read("SELECT status FROM decision_status WHERE decision_id=?", (decision_id,))
        return rows[0][0] if rows else ""

    # --- class statistics ----------------------------------------------------------------
    def stats(self, keys: Mapping[KeyLevel, str]) -> dict[KeyLevel, ClassStats]:
        if not keys:
            return {}
        where = " OR ".join("(level=? AND key=?)" for _ in keys)
        args = [x for level, key in keys.items() for x in (level.value, key)]
        rows = self._read(f"SELECT level, key, stats_json FROM class_stats WHERE {where}", args)
        out = {}
        for level, key, text in rows:
            out[KeyLevel(level)], bad = self._checked(text)
            if bad:  # written by other means than the service: bounded, never believed as stored
                log.warning("history %s: statistics of %s key %s out of range (%s): brought within bounds",
                            self.where, level, key, ", ".join(bad))
        return out

    def _checked(self, text: str) -> tuple[ClassStats, tuple[str, ...]]:
        """``checked_stats(text)``, remembered: bringing a key's statistics within bounds was 3 in 4
        of an Admit's CPU (every Admit reads 3-5 keys, a wide key holding up to 64 users' figures),
        and a key's stored text changes only when an observation is folded into it. The result is
        a pure function of the text and immutable (frozen, tuples), so a remembered one is the same
        value; least recently used texts are forgotten past STATS_MEMO_CHARS."""
        if not isinstance(text, (str, bytes)):
            return checked_stats(text)  # NULL: no statistics
        memo = self._stats_memo
        with self._stats_memo_lock:
            hit = memo.get(text)
            if hit is not None:
                memo.move_to_end(text)
                return hit
        hit = checked_stats(text)
        with self._stats_memo_lock:
            if text not in memo:
                memo[text] = hit
                self._stats_memo_chars += len(text)
                while self._stats_memo_chars > STATS_MEMO_CHARS and len(memo) > 1:
                    old, _ = memo.popitem(last=False)
                    self._stats_memo_chars -= len(old)
        return hit

    # --- runs and events -----------------------------------------------------------------
    # A run is one job instance on one node (a multi-node job has one per node); its key is the
    # instance's (history_schema). Events arrive in any order and more than once.
    def event_seen(self, event_id: str) -> bool:
        return event_id in self.events_seen([event_id])

    def events_seen(self, event_ids: Iterable[str]) -> set[str]:
        """Which of these event ids were already applied."""
        ids = sorted({e for e in event_ids if e})
        seen: set[str] = set()
        for i in range(0, len(ids), 500):
            part = ids[i:i + 500]
            seen.update(r[0] for r in self._read(
                f"SELECT event_id FROM events WHERE event_id IN ({','.join('?' * len(part))})", part))
        return seen

    def record_start(self, *, event_id: str, job_id: int, decision_id: str, node: str, gpus: Iterable[int],
                     started_at: float, received_at: float, instance: str = "", submit_time: int = 0) -> bool:
        """Record a job instance's start on a node; False when this event was already applied.
        ``instance``: its key ("": unresolved, known by job id, node and start second only)."""
        instance = instance or unresolved_key(job_id, node, started_at)
        with self._tx() as c:
            if not _claim_event(c, event_id, "start", received_at):
                return False
            c.execute("INSERT INTO runs (instance, node, job_id, submit_time, decision_id, gpu_indices, started_at) "
                      "VALUES (?,?,?,?,?,?,?) ON CONFLICT(instance, node) DO UPDATE SET "
                      "decision_id=CASE WHEN excluded.decision_id!='' THEN excluded.decision_id ELSE runs.decision_id "
                      "END, gpu_indices=excluded.gpu_indices, started_at=excluded.started_at, "
                      "submit_time=MAX(runs.submit_time, excluded.submit_time)",
                      (instance, node, job_id, submit_time, decision_id, json.dumps(sorted(gpus)), started_at))
        return True

    def run(self, job_id: int) -> RunRow | None:
        """The newest run recorded under this job id, of any instance (for people and tests; events
        go by instance: ``run_of``)."""
        return self._one_run("job_id=?", (job_id,))

    def run_of(self, instance: str, node: str | None = None) -> RunRow | None:
        """The run of a job instance (on ``node``; None: its newest on any node)."""
        if node is None:
            return self._one_run("instance=?", (instance,))
        return self._one_run("instance=? AND node=?", (instance, node))

    def _one_run(self, where: str, args: tuple) -> RunRow | None:
        rows = self._read(f"SELECT {RUN_COLS} FROM runs WHERE {where} "
                          "ORDER BY started_at IS NULL, started_at DESC LIMIT 1", args)
        return run_row(rows[0]) if rows else None

    def open_runs_of(self, job_id: int, node: str) -> list[RunRow]:
        """Runs of this job id on this node that have no finish yet, newest first (not legacy ones)."""
        rows = self._read(f"SELECT {RUN_COLS} FROM runs WHERE job_id=? AND node=? AND finished_at IS NULL "
                          "AND started_at IS NOT NULL AND instance NOT LIKE ? ORDER BY started_at DESC",
                          (job_id, node, LEGACY_PREFIX + "%"))
        return [run_row(r) for r in rows]

    def overlapping_runs(self, node: str, gpus: Iterable[int], start: float, end: float, exclude_instance: str,
                         open_since: float | None = None) -> list[RunRow]:
        """Runs of other instances on the same node and any of the same GPUs whose interval overlaps
        [start, end]. A run with no finish counts as running on, unless it started before
        ``open_since`` (its JobFinished may never come: the node died, the epilog never ran)."""
        wanted = set(gpus)
        since = float("-inf") if open_since is None else open_since
        rows = self._read(f"SELECT {RUN_COLS} FROM runs WHERE node=? AND instance!=? AND started_at IS NOT NULL "
                          "AND started_at < ? AND (finished_at > ? OR (finished_at IS NULL AND started_at >= ?))",
                          (node, exclude_instance, end, start, since))
        return [r for r in map(run_row, rows) if wanted & set(r.gpu_indices)]

    def record_finish(self, obs: ObservationRow, keys: Mapping[KeyLevel, str],
                      fold: Callable[[KeyLevel, ClassStats], ClassStats]) -> bool:
        """Store an observation and fold it into each key's statistics (``fold(level, stats)``), in one transaction
        (no lost update between concurrent finishes of one class); False on replay. Closes the
        instance's run on that node, and an unresolved run of the same job id there that started
        after the instance was submitted (the same job, started while Slurm could not be asked)."""
        instance = obs.instance or unresolved_key(obs.job_id, obs.node, obs.started_at)
        with self._tx() as c:
            if not _claim_event(c, obs.event_id, "finish", obs.received_at):
                return False
            c.execute(f"INSERT INTO observations ({OBSERVATION_COLS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                      (obs.event_id, obs.job_id, obs.decision_id, obs.node, json.dumps(list(obs.gpu_indices)),
                       obs.started_at, obs.finished_at, obs.runtime_s, obs.exit_code, obs.peak_bytes, int(obs.oom),
                       obs.co_runners, int(obs.shared), obs.telemetry_source, obs.received_at, instance,
                       obs.submit_time))
            c.execute("INSERT INTO runs (instance, node, job_id, submit_time, decision_id, gpu_indices, started_at, "
                      "finished_at) VALUES (?,?,?,?,?,?,?,?) ON CONFLICT(instance, node) DO UPDATE SET "
                      "finished_at=excluded.finished_at, submit_time=MAX(runs.submit_time, excluded.submit_time), "
                      "decision_id=CASE WHEN runs.decision_id='' THEN excluded.decision_id ELSE runs.decision_id END",
                      (instance, obs.node, obs.job_id, obs.submit_time, obs.decision_id,
                       json.dumps(list(obs.gpu_indices)), obs.started_at, obs.finished_at))
            if obs.submit_time > 0:
                c.execute("UPDATE runs SET finished_at=? WHERE job_id=? AND node=? AND finished_at IS NULL "
                          "AND instance LIKE ? AND instance!=? AND started_at >= ?",
                          (obs.finished_at, obs.job_id, obs.node, UNRESOLVED_PREFIX + "%", instance, obs.submit_time))
            for level, key in keys.items():
                row = c.execute("SELECT stats_json FROM class_stats WHERE level=? AND key=?",
                                (level.value, key)).fetchone()
                new = fold(level, stats_from_json(row[0]) if row else ClassStats())
                c.execute("INSERT OR REPLACE INTO class_stats VALUES (?,?,?,?)",
                          (level.value, key, stats_to_json(new), obs.received_at))
        return True

    def observations(self, *, job_id: int | None = None, decision_id: str | None = None,
                     instance: str | None = None) -> list[ObservationRow]:
        sql = f"SELECT {OBSERVATION_COLS} FROM observations"
        args: tuple = ()
        if job_id is not None:
            sql, args = sql + " WHERE job_id=?", (job_id,)
        elif decision_id is not None:
            sql, args = sql + " WHERE decision_id=?", (decision_id,)
        elif instance is not None:
            sql, args = sql + " WHERE instance=?", (instance,)
        return [observation_row(r) for r in self._read(sql + " ORDER BY finished_at", args)]


# (the columns named: a MariaDB history has one more, ``seq``, that numbers the rows as SQLite's rowid)
_INSERT_DECISION = ("INSERT OR REPLACE INTO decisions (decision_id, decided_at, job_class, user, account, partition, "
                    "job_name, action, shards, model_version, keys_json, facts_pb, decision_pb) "
                    "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)")


def open_history(cfg, accept_empty: bool = False, fence: str | None = None) -> HistoryStore:
    """The history the Config names: [history] backend (SQLite at service.db_path by default)."""
    if cfg.history.backend is HistoryBackend.MARIADB:
        return HistoryStore(cfg.service.db_path, accept_empty, fence=fence, mariadb=cfg.history)
    return HistoryStore(cfg.service.db_path, accept_empty, fence=fence)


def _claim_event(c, event_id: str, kind: str, now: float) -> bool:
    if not event_id:
        return True
    cur = c.execute("INSERT OR IGNORE INTO events VALUES (?,?,?)", (event_id, kind, now))
    return cur.rowcount == 1
