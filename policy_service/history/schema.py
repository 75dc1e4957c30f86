"""The history's SQLite schema, its migrations, and the rows read from it (shared by the service's
``HistoryStore`` and the reports' ``ReadOnlyHistory``).

Schema 3 keys runs and observations by the job INSTANCE, not the job id alone: Slurm ids restart
at 1 after a state reset, and a requeued job gets a new submit time. An instance key is
``<cluster>/<job id>/<submit time>`` (read from Slurm), ``sluid/<SLUID>`` (Slurm 25.11+, sent by
the hooks), ``unresolved/<job id>/<node>/<start second>`` when neither could be had, and
``legacy/<job id>`` for the runs and observations a schema-2 history held (no new event ever
produces that key, so an old run never matches a new job of the same id).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from google.protobuf import json_format

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.history.db import SQLITE, Engine, table_exists
from policy_service.core.bounds import sane_stats
from policy_service.core.types import ClassStats, KeyLevel

SCHEMA_VERSION = 3  # 2: decisions keep facts and decision as serialized protobuf; 3: runs by job instance
LEGACY_PREFIX = "legacy/"
UNRESOLVED_PREFIX = "unresolved/"

_RUNS_TABLE = """
CREATE TABLE IF NOT EXISTS runs (
    instance TEXT NOT NULL,
    node TEXT NOT NULL DEFAULT '',
    job_id INTEGER NOT NULL,
    submit_time INTEGER NOT NULL DEFAULT 0,
    decision_id TEXT NOT NULL DEFAULT '',
    gpu_indices TEXT NOT NULL DEFAULT '[]',
    started_at REAL,
    finished_at REAL,
    PRIMARY KEY (instance, node)
);
"""
SCHEMA = """
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
""" + _RUNS_TABLE + """
CREATE INDEX IF NOT EXISTS runs_node ON runs(node, started_at);
CREATE INDEX IF NOT EXISTS runs_node_finish ON runs(node, finished_at, started_at);
CREATE INDEX IF NOT EXISTS runs_job ON runs(job_id);
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
    received_at REAL NOT NULL,
    instance TEXT NOT NULL DEFAULT '',
    submit_time INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS observations_job ON observations(job_id);
CREATE INDEX IF NOT EXISTS observations_decision ON observations(decision_id);
CREATE INDEX IF NOT EXISTS observations_instance ON observations(instance);
CREATE TABLE IF NOT EXISTS class_stats (
    level TEXT NOT NULL,
    key TEXT NOT NULL,
    stats_json TEXT NOT NULL,
    updated_at REAL NOT NULL,
    PRIMARY KEY (level, key)
);
-- How often the statistics changed: one more in the transaction of each insert, update or delete
-- of class_stats, whoever makes it (history/class_stats.py: a service's statistics reads are
-- remembered while it stays). Added in place: no version.
INSERT OR IGNORE INTO meta VALUES ('stats_generation', '0');
CREATE TRIGGER IF NOT EXISTS class_stats_inserted AFTER INSERT ON class_stats BEGIN
    UPDATE meta SET value = CAST(value AS INTEGER) + 1 WHERE key = 'stats_generation'; END;
CREATE TRIGGER IF NOT EXISTS class_stats_updated AFTER UPDATE ON class_stats BEGIN
    UPDATE meta SET value = CAST(value AS INTEGER) + 1 WHERE key = 'stats_generation'; END;
CREATE TRIGGER IF NOT EXISTS class_stats_deleted AFTER DELETE ON class_stats BEGIN
    UPDATE meta SET value = CAST(value AS INTEGER) + 1 WHERE key = 'stats_generation'; END;
-- Whether Slurm ever held a decision (slurm/reconcile.py): 'held' when a job's AdminComment
-- named it, 'never_held' when none did once slurmctld had long answered (the job was refused
-- after the plugin ran, or slurmctld gave up waiting for the answer). Added in place: no version.
CREATE TABLE IF NOT EXISTS decision_status (
    decision_id TEXT PRIMARY KEY,
    status TEXT NOT NULL,
    checked_at REAL NOT NULL
);
-- Which service writes (HistoryStore.claim_writer, fence=): one row; the epoch grows whenever the
-- holder changes; expires_at on the database's clock. Added in place: no version.
CREATE TABLE IF NOT EXISTS writer_lease (
    name TEXT PRIMARY KEY,
    holder TEXT NOT NULL,
    epoch INTEGER NOT NULL,
    expires_at REAL NOT NULL
);
"""

# Schema 2 -> 3, in place, in one transaction: runs are re-keyed (instance, node) with every old
# run marked legacy; observations gain their instance (legacy) and submit time (0: unknown).
_MIGRATE_2_TO_3 = (
    "ALTER TABLE runs RENAME TO runs_v2",
    "DROP INDEX IF EXISTS runs_node",
    _RUNS_TABLE,
    "INSERT INTO runs (instance, node, job_id, submit_time, decision_id, gpu_indices, started_at, finished_at) "
    f"SELECT '{LEGACY_PREFIX}' || job_id, node, job_id, 0, decision_id, gpu_indices, started_at, finished_at "
    "FROM runs_v2",
    "DROP TABLE runs_v2",
    "ALTER TABLE observations ADD COLUMN instance TEXT NOT NULL DEFAULT ''",
    "ALTER TABLE observations ADD COLUMN submit_time INTEGER NOT NULL DEFAULT 0",
    f"UPDATE observations SET instance = '{LEGACY_PREFIX}' || job_id",
    "UPDATE meta SET value = '3' WHERE key = 'schema_version'",
)
MIGRATIONS = {2: _MIGRATE_2_TO_3}
# Per engine: a MariaDB history starts at schema 3 (db.MARIADB_SCHEMA); its later steps go
# here, in the same form (MariaDB commits each DDL statement at once: write steps that can be run
# again).
ENGINE_MIGRATIONS = {"sqlite": MIGRATIONS, "mariadb": {}}


def stored_version(conn, engine: Engine = SQLITE) -> int | None:
    """The schema version a database holds; None for a new (empty) one."""
    if not table_exists(conn, engine, "meta"):
        return None
    row = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
    return None if row is None else int(row[0])


def migrate(conn, engine: Engine = SQLITE) -> int | None:
    """Bring an older history to ``SCHEMA_VERSION`` in place (each step one transaction). Returns the
    version found before (None: a new database). A version with no migration is left as it is
    (the caller refuses it)."""
    found = stored_version(conn, engine)
    version = found
    steps = ENGINE_MIGRATIONS[engine.name]
    while version is not None and version in steps:
        conn.execute(engine.begin)
        try:
            for statement in steps[version]:
                conn.execute(statement)
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        version = stored_version(conn, engine)
    return found


def unresolved_key(job_id: int, node: str, started_at: float | None) -> str:
    """The key of a run no instance could be found for: its job id, node and start second."""
    return f"{UNRESOLVED_PREFIX}{job_id}/{node}/{int(started_at or 0)}"


# ----------------------------------------------------------------------------- rows
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
    instance: str = ""
    submit_time: int = 0


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
    instance: str = ""  # the job instance's key (module docstring); "" only before it is stored
    submit_time: int = 0  # the instance's submit time as Slurm gave it; 0: unknown


def stats_to_json(s: ClassStats) -> str:
    return json.dumps(dataclasses.asdict(s), sort_keys=True)


def stats_from_json(text: str) -> ClassStats:
    return checked_stats(text)[0]


def checked_stats(text: str) -> tuple[ClassStats, tuple[str, ...]]:
    """A key's statistics as stored, every figure brought within the model's bounds
    (``core.bounds.sane_stats``), and the fields that were out of them (text that is not a JSON
    object: every field, and the key's statistics start again)."""
    try:
        data = json.loads(text)
    except (TypeError, ValueError):
        data = None
    if not isinstance(data, dict):
        return ClassStats(), ("stats_json",)
    return sane_stats(data)


DECISION_COLS = "decision_id, decided_at, job_class, user, action, shards, keys_json, facts_pb, decision_pb"
RUN_COLS = "job_id, decision_id, node, gpu_indices, started_at, finished_at, instance, submit_time"
OBSERVATION_COLS = ("event_id, job_id, decision_id, node, gpu_indices, started_at, finished_at, runtime_s, exit_code, "
                    "peak_bytes, oom, co_runners, shared, telemetry_source, received_at, instance, submit_time")
# The same columns from a schema-2 observations table (no instance yet: every row is legacy).
OBSERVATION_COLS_V2 = OBSERVATION_COLS.replace(", instance, submit_time", f", '{LEGACY_PREFIX}' || job_id, 0")


def decision_row(row: tuple) -> DecisionRow:
    keys = {KeyLevel(k): v for k, v in json.loads(row[6]).items()}
    return DecisionRow(row[0], row[1], row[2], row[3], row[4], row[5], keys, bytes(row[7]), bytes(row[8]))


def run_row(row: tuple) -> RunRow:
    return RunRow(row[0], row[1], row[2], tuple(json.loads(row[3])), row[4], row[5], row[6], int(row[7] or 0))


def observation_row(r: tuple) -> ObservationRow:
    return ObservationRow(r[0], r[1], r[2], r[3], tuple(json.loads(r[4])), r[5], r[6], r[7], r[8], r[9],
                          bool(r[10]), r[11], bool(r[12]), r[13], r[14], r[15], int(r[16] or 0))
