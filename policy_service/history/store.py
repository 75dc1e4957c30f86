"""History store: decisions, job runs, observations and per-key statistics in SQLite (WAL).

Two connections, each behind its own lock: writes are short transactions on one; reads go
through the other, so a write that waits for SQLite's file lock (another process holding it, a
slow disk) never holds up a read (WAL: readers run beside a writer). Admit only reads. Replayed
events (same event id) are applied once.

This module opens the history (SQLite or MariaDB, its schema checked and migrated) and holds its
connections; what it records and reads is in its parts: decisions.py (decisions and whether Slurm
held them), class_stats.py (the per-key statistics read), runs.py (runs, observations, events).
"""
from __future__ import annotations

import collections
import logging
import sqlite3
import threading
from pathlib import Path

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
from policy_service.core.types import ClassStats
from policy_service.history.config import HistoryBackend, HistoryConfig
from policy_service.history.class_stats import ClassStatsReads
from policy_service.history.decisions import DecisionRecords
from policy_service.history.runs import RunsAndEvents

log = logging.getLogger(__name__)


class HistoryStore(SqliteFile, FencedWrites, DecisionRecords, ClassStatsReads, RunsAndEvents):
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
        self.closed = False  # close() was called: a reader still at work (a thread of a stopping service) may fail
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
        self._lconn, self._llock = self._conn, self._lock  # (SQLite has one writer: the lease's too)
        self._stats_counted = True  # (SCHEMA's triggers: class_stats.py)
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
        self._lconn, self._llock = MyConn(cfg, lease=True), threading.Lock()  # (lease.py: why apart)
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
        self.closed = True
        with self._lock:
            self._conn.close()
        if self._rconn is not self._conn:
            with self._rlock:
                self._rconn.close()
        if self._lconn is not self._conn:
            with self._llock:
                self._lconn.close()

    @property
    def seq(self) -> str:
        """The column that numbers decisions in the order they were recorded (a decision recorded
        again gets a new number): SQLite's rowid, MariaDB's ``seq``."""
        return "rowid" if self.engine is SQLITE else "seq"

    @property
    def opened(self) -> tuple[int, int] | None:
        """(device, inode) of the SQLite file this store has open; another once the file was
        restored while the service ran (file.py). None: MariaDB, or a history in memory."""
        return self._ident

    def open_reader(self):
        """A read-only connection of its own (for a long scan that must not hold up Admit's reads);
        the caller closes it, and uses it from one thread at a time (any thread: the admission
        publisher keeps it between its ticks). Statements in SQLite's spelling, as everywhere in the
        store."""
        if self.engine is SQLITE:
            return sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=10, check_same_thread=False)
        return MyConn(self._conn.cfg, read_only=True)


def open_history(cfg, accept_empty: bool = False, fence: str | None = None) -> HistoryStore:
    """The history the Config names: [history] backend (SQLite at service.db_path by default)."""
    if cfg.history.backend is HistoryBackend.MARIADB:
        return HistoryStore(cfg.service.db_path, accept_empty, fence=fence, mariadb=cfg.history)
    return HistoryStore(cfg.service.db_path, accept_empty, fence=fence)
