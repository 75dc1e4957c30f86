"""History store: decisions, job runs, observations and per-key statistics in SQLite (WAL).

One connection guarded by a lock: every operation is a short transaction, so the store
serves the gRPC thread pool and the local socket at once. Replayed events (same event id)
are applied once.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote
from typing import Callable, Iterable, Iterator, Mapping

from google.protobuf import json_format

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.core.types import ClassStats, KeyLevel

log = logging.getLogger(__name__)

SCHEMA_VERSION = 2  # 2: decisions keep facts and decision as serialized protobuf
_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS decisions (
    decision_id TEXT PRIMARY KEY,
    decided_at REAL NOT NULL,
    job_class TEXT NOT NULL,
    user TEXT NOT NULL,
    account TEXT NOT NULL,
    partition TEXT NOT NULL,
    job_name TEXT NOT NULL,
    action TEXT NOT NULL,
    shards INTEGER NOT NULL,
    model_version TEXT NOT NULL,
    keys_json TEXT NOT NULL,
    facts_pb BLOB NOT NULL,
    decision_pb BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS decisions_user ON decisions(user, decided_at);
CREATE TABLE IF NOT EXISTS runs (
    job_id INTEGER PRIMARY KEY,
    decision_id TEXT NOT NULL DEFAULT '',
    node TEXT NOT NULL DEFAULT '',
    gpu_indices TEXT NOT NULL DEFAULT '[]',
    started_at REAL,
    finished_at REAL
);
CREATE INDEX IF NOT EXISTS runs_node ON runs(node, started_at);
CREATE TABLE IF NOT EXISTS events (event_id TEXT PRIMARY KEY, kind TEXT NOT NULL, received_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS observations (
    event_id TEXT PRIMARY KEY,
    job_id INTEGER NOT NULL,
    decision_id TEXT NOT NULL,
    node TEXT NOT NULL,
    gpu_indices TEXT NOT NULL,
    started_at REAL,
    finished_at REAL NOT NULL,
    runtime_s REAL,
    exit_code INTEGER NOT NULL,
    peak_bytes INTEGER,
    oom INTEGER NOT NULL,
    co_runners INTEGER NOT NULL,
    shared INTEGER NOT NULL,
    telemetry_source TEXT NOT NULL,
    received_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS observations_job ON observations(job_id);
CREATE INDEX IF NOT EXISTS observations_decision ON observations(decision_id);
CREATE TABLE IF NOT EXISTS class_stats (
    level TEXT NOT NULL,
    key TEXT NOT NULL,
    stats_json TEXT NOT NULL,
    updated_at REAL NOT NULL,
    PRIMARY KEY (level, key)
);
"""


@dataclass(frozen=True)
class DecisionRow:
    decision_id: str
    decided_at: float
    job_class: str
    user: str
    action: str
    shards: int
    keys: dict[KeyLevel, str]
    facts_pb: bytes  # swapaware.v1.JobFacts, serialized (cheap to write on the Admit path)
    decision_pb: bytes  # swapaware.v1.Decision, serialized

    @property
    def facts(self) -> pb.JobFacts:
        return pb.JobFacts.FromString(self.facts_pb)

    @property
    def decision(self) -> pb.Decision:
        return pb.Decision.FromString(self.decision_pb)

    @property
    def facts_json(self) -> str:
        """Canonical proto3 JSON of the facts (for reports and people)."""
        return json_format.MessageToJson(self.facts, indent=None)

    @property
    def decision_json(self) -> str:
        return json_format.MessageToJson(self.decision, indent=None)


@dataclass(frozen=True)
class RunRow:
    job_id: int
    decision_id: str
    node: str
    gpu_indices: tuple[int, ...]
    started_at: float | None
    finished_at: float | None


@dataclass(frozen=True)
class ObservationRow:
    event_id: str
    job_id: int
    decision_id: str
    node: str
    gpu_indices: tuple[int, ...]
    started_at: float | None
    finished_at: float
    runtime_s: float | None
    exit_code: int
    peak_bytes: int | None
    oom: bool
    co_runners: int
    shared: bool
    telemetry_source: str
    received_at: float


def stats_to_json(s: ClassStats) -> str:
    return json.dumps(dataclasses.asdict(s), sort_keys=True)


def stats_from_json(text: str) -> ClassStats:
    data = json.loads(text)
    known = {f.name for f in dataclasses.fields(ClassStats)}
    return ClassStats(**{k: v for k, v in data.items() if k in known})


class HistoryOwnerError(RuntimeError):
    """The history file belongs to another user: the service refuses to use it."""


def private_history_file(path: Path) -> None:
    """Make ``path`` the service's own: a new history is created 0600 in a 0700 directory (SQLite
    gives its -wal/-shm files the database's mode); an existing one must belong to this user
    (else ``HistoryOwnerError``), and a group- or world-readable one is narrowed to 0600."""
    if not path.parent.exists():
        path.parent.mkdir(parents=True, mode=0o700)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        os.close(fd)
        return
    except FileExistsError:
        pass
    st = os.stat(path)
    if st.st_uid != os.geteuid():
        raise HistoryOwnerError(f"{path} belongs to uid {st.st_uid}, not to this service (uid {os.geteuid()}): "
                                "refusing to use a history another user can change; chown it or start the "
                                "service as its owner")
    if st.st_mode & 0o077:
        log.warning("history %s was mode %o: now 0600 (only the service reads the job facts it holds)",
                    path, st.st_mode & 0o777)
        os.chmod(path, 0o600)


class HistoryStore:
    """SQLite-backed history. ``path`` may be ':memory:' for tests of callers."""

    def __init__(self, path: Path | str):
        self.path = str(path)
        if self.path != ":memory:":
            private_history_file(Path(self.path))
        self._conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=10.0)
        self._lock = threading.Lock()
        with self._lock:
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._conn.executescript(_SCHEMA)
            self._conn.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            found = self._conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0]
        if int(found) != SCHEMA_VERSION:
            raise RuntimeError(f"{self.path}: history schema {found}, this build reads {SCHEMA_VERSION}")

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def _tx(self) -> "_Tx":
        return _Tx(self._conn, self._lock)

    # --- decisions -----------------------------------------------------------------------
    def record_decision(self, *, decision_id: str, decided_at: float, job_class: str, user: str, account: str,
                        partition: str, job_name: str, action: str, shards: int, model_version: str,
                        keys: Mapping[KeyLevel, str], facts_pb: bytes, decision_pb: bytes) -> None:
        keys_json = json.dumps({k.value: v for k, v in keys.items()}, sort_keys=True)
        with self._lock:  # one statement: autocommit is its own transaction
            self._conn.execute("INSERT OR REPLACE INTO decisions VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                               (decision_id, decided_at, job_class, user, account, partition, job_name, action,
                                shards, model_version, keys_json, facts_pb, decision_pb))

    def decision(self, decision_id: str) -> DecisionRow | None:
        with self._tx() as c:
            row = c.execute(f"SELECT {_DECISION_COLS} FROM decisions WHERE decision_id=?", (decision_id,)).fetchone()
        return None if row is None else _decision_row(row)

    def decisions(self) -> Iterator[DecisionRow]:
        with self._tx() as c:
            ids = [r[0] for r in c.execute("SELECT decision_id FROM decisions ORDER BY decided_at")]
        for d_id in ids:
            row = self.decision(d_id)
            if row is not None:
                yield row

    # --- class statistics ----------------------------------------------------------------
    def stats(self, keys: Mapping[KeyLevel, str]) -> dict[KeyLevel, ClassStats]:
        if not keys:
            return {}
        where = " OR ".join("(level=? AND key=?)" for _ in keys)
        args = [x for level, key in keys.items() for x in (level.value, key)]
        with self._lock:  # a single read needs no write transaction
            rows = self._conn.execute(f"SELECT level, stats_json FROM class_stats WHERE {where}", args).fetchall()
        return {KeyLevel(level): stats_from_json(text) for level, text in rows}

    # --- runs and events -----------------------------------------------------------------
    def event_seen(self, event_id: str) -> bool:
        with self._tx() as c:
            return c.execute("SELECT 1 FROM events WHERE event_id=?", (event_id,)).fetchone() is not None

    def record_start(self, *, event_id: str, job_id: int, decision_id: str, node: str, gpus: Iterable[int],
                     started_at: float, received_at: float) -> bool:
        """Record a job start; False when this event was already applied."""
        with self._tx() as c:
            if not _claim_event(c, event_id, "start", received_at):
                return False
            c.execute("INSERT INTO runs (job_id, decision_id, node, gpu_indices, started_at) VALUES (?,?,?,?,?) "
                      "ON CONFLICT(job_id) DO UPDATE SET decision_id=CASE WHEN excluded.decision_id!='' "
                      "THEN excluded.decision_id ELSE runs.decision_id END, node=excluded.node, "
                      "gpu_indices=excluded.gpu_indices, started_at=excluded.started_at",
                      (job_id, decision_id, node, json.dumps(sorted(gpus)), started_at))
        return True

    def run(self, job_id: int) -> RunRow | None:
        with self._tx() as c:
            row = c.execute("SELECT job_id, decision_id, node, gpu_indices, started_at, finished_at FROM runs "
                            "WHERE job_id=?", (job_id,)).fetchone()
        return None if row is None else _run_row(row)

    def overlapping_runs(self, node: str, gpus: Iterable[int], start: float, end: float,
                         exclude_job: int) -> list[RunRow]:
        """Runs on the same node and any of the same GPUs whose interval overlaps [start, end]."""
        wanted = set(gpus)
        with self._tx() as c:
            rows = c.execute("SELECT job_id, decision_id, node, gpu_indices, started_at, finished_at FROM runs "
                             "WHERE node=? AND job_id!=? AND started_at IS NOT NULL AND started_at < ? "
                             "AND (finished_at IS NULL OR finished_at > ?)", (node, exclude_job, end, start)).fetchall()
        return [r for r in map(_run_row, rows) if wanted & set(r.gpu_indices)]

    def record_finish(self, obs: ObservationRow, keys: Mapping[KeyLevel, str],
                      fold: Callable[[ClassStats], ClassStats]) -> bool:
        """Store an observation and fold it into each key's statistics, in one transaction
        (no lost update between concurrent finishes of one class); False on replay."""
        with self._tx() as c:
            if not _claim_event(c, obs.event_id, "finish", obs.received_at):
                return False
            c.execute("INSERT INTO observations VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                      (obs.event_id, obs.job_id, obs.decision_id, obs.node, json.dumps(list(obs.gpu_indices)),
                       obs.started_at, obs.finished_at, obs.runtime_s, obs.exit_code, obs.peak_bytes, int(obs.oom),
                       obs.co_runners, int(obs.shared), obs.telemetry_source, obs.received_at))
            c.execute("INSERT INTO runs (job_id, decision_id, node, gpu_indices, started_at, finished_at) "
                      "VALUES (?,?,?,?,?,?) ON CONFLICT(job_id) DO UPDATE SET finished_at=excluded.finished_at, "
                      "decision_id=CASE WHEN runs.decision_id='' THEN excluded.decision_id ELSE runs.decision_id END",
                      (obs.job_id, obs.decision_id, obs.node, json.dumps(list(obs.gpu_indices)), obs.started_at,
                       obs.finished_at))
            for level, key in keys.items():
                row = c.execute("SELECT stats_json FROM class_stats WHERE level=? AND key=?",
                                (level.value, key)).fetchone()
                new = fold(stats_from_json(row[0]) if row else ClassStats())
                c.execute("INSERT OR REPLACE INTO class_stats VALUES (?,?,?,?)",
                          (level.value, key, stats_to_json(new), obs.received_at))
        return True

    def observations(self, *, job_id: int | None = None, decision_id: str | None = None) -> list[ObservationRow]:
        sql = "SELECT * FROM observations"
        args: tuple = ()
        if job_id is not None:
            sql, args = sql + " WHERE job_id=?", (job_id,)
        elif decision_id is not None:
            sql, args = sql + " WHERE decision_id=?", (decision_id,)
        with self._tx() as c:
            rows = c.execute(sql + " ORDER BY finished_at", args).fetchall()
        return [_observation_row(r) for r in rows]


_DECISION_COLS = "decision_id, decided_at, job_class, user, action, shards, keys_json, facts_pb, decision_pb"


def _decision_row(row: tuple) -> DecisionRow:
    keys = {KeyLevel(k): v for k, v in json.loads(row[6]).items()}
    return DecisionRow(row[0], row[1], row[2], row[3], row[4], row[5], keys, bytes(row[7]), bytes(row[8]))


def _observation_row(r: tuple) -> ObservationRow:
    return ObservationRow(r[0], r[1], r[2], r[3], tuple(json.loads(r[4])), r[5], r[6], r[7], r[8], r[9],
                          bool(r[10]), r[11], bool(r[12]), r[13], r[14])


class HistoryUnreadable(RuntimeError):
    """The history file is missing, not ours, or of another schema version."""


class ReadOnlyHistory:
    """The history opened read-only (``mode=ro``) for reports: never creates or migrates it."""

    CHUNK = 500  # ids per IN (...) query, below SQLite's variable limit

    def __init__(self, path: Path | str):
        path = Path(path)
        if not path.is_file():
            raise HistoryUnreadable(f"no history database at {path}")
        try:
            self._conn = sqlite3.connect(f"file:{quote(str(path.resolve()))}?mode=ro", uri=True, timeout=10.0)
            row = self._conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        except sqlite3.Error as exc:
            raise HistoryUnreadable(f"{path} is not a swapaware history database (or unreadable): {exc}") from None
        if row is None or int(row[0]) != SCHEMA_VERSION:
            self._conn.close()
            raise HistoryUnreadable(f"{path}: history schema {row[0] if row else '?'}, this build reads "
                                    f"{SCHEMA_VERSION}")

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> "ReadOnlyHistory":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _select_in(self, sql: str, values: Iterable) -> list[tuple]:
        ids = sorted(set(values))
        out: list[tuple] = []
        try:
            for i in range(0, len(ids), self.CHUNK):
                part = ids[i:i + self.CHUNK]
                out += self._conn.execute(sql.format(marks=",".join("?" * len(part))), part).fetchall()
        except sqlite3.Error as exc:
            raise HistoryUnreadable(f"cannot read the history: {exc}") from None
        return out

    def run_decisions(self, job_ids: Iterable[int]) -> dict[int, str]:
        """Job id -> the decision its start record names (jobs with none are left out)."""
        rows = self._select_in("SELECT job_id, decision_id FROM runs WHERE job_id IN ({marks})", job_ids)
        return {int(j): d for j, d in rows if d}

    def observations_of(self, job_ids: Iterable[int]) -> list[ObservationRow]:
        return [_observation_row(r) for r in
                self._select_in("SELECT * FROM observations WHERE job_id IN ({marks})", job_ids)]

    def decisions_by_id(self, decision_ids: Iterable[str]) -> dict[str, DecisionRow]:
        rows = self._select_in(f"SELECT {_DECISION_COLS} FROM decisions WHERE decision_id IN ({{marks}})",
                               (d for d in decision_ids if d))
        return {r[0]: _decision_row(r) for r in rows}


def _run_row(row: tuple) -> RunRow:
    return RunRow(row[0], row[1], row[2], tuple(json.loads(row[3])), row[4], row[5])


def _claim_event(c: sqlite3.Connection, event_id: str, kind: str, now: float) -> bool:
    if not event_id:
        return True
    cur = c.execute("INSERT OR IGNORE INTO events VALUES (?,?,?)", (event_id, kind, now))
    return cur.rowcount == 1


class _Tx:
    """Lock + BEGIN IMMEDIATE ... COMMIT (ROLLBACK on error)."""

    def __init__(self, conn: sqlite3.Connection, lock: threading.Lock):
        self.conn, self.lock = conn, lock

    def __enter__(self) -> sqlite3.Connection:
        self.lock.acquire()
        try:
            self.conn.execute("BEGIN IMMEDIATE")
        except BaseException:
            self.lock.release()
            raise
        return self.conn

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.conn.execute("ROLLBACK" if exc_type else "COMMIT")
        finally:
            self.lock.release()
