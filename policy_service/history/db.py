"""What differs between the history's two engines (docs/history-backends.md): SQLite on local
disk (the single-host default) and MariaDB/MySQL through PyMySQL (a history both controller
hosts reach). ``HistoryStore`` writes its SQL once, in SQLite's spelling with ``?`` placeholders;
a MariaDB connection (``MyConn``) rewrites each statement once (``mariadb_sql``) and offers the
same ``execute`` / ``executemany`` / cursor as ``sqlite3``.

Errors: ``HistoryUnavailable`` (the server is gone, a lock wait timed out, a deadlock was
broken) is worth retrying; every other error is the caller's to see. A connection that was lost
is reopened on its next use; a read outside a transaction is retried once on a new connection.
"""
from __future__ import annotations

import functools
import logging
import re
import socket
import sqlite3
from dataclasses import dataclass
from typing import Any

from policy_service.config import read_token
from policy_service.history.config import HistoryConfig

log = logging.getLogger("swapaware.history")

# MariaDB client/server error codes: the connection is gone (2006 server gone away, 2013 lost
# during query, 2003 cannot connect, 2002 socket, 2055 lost at handshake, 4031 idle timeout),
# and lock conflicts (1205 lock wait timeout, 1213 deadlock).
LOST_CODES = frozenset({2002, 2003, 2006, 2013, 2055, 4031})
LOCK_CODES = frozenset({1205, 1213})


class HistoryUnavailable(RuntimeError):
    """The history cannot be written or read just now (connection lost, locked): retry later."""


# --------------------------------------------------------------------------- SQL spelling
_REWRITES = (
    (re.compile(r"%"), "%%"),  # PyMySQL formats with %: a literal % is %%
    (re.compile(r"\?"), "%s"),
    (re.compile(r"\bINSERT OR REPLACE\b"), "REPLACE"),
    (re.compile(r"\bINSERT OR IGNORE\b"), "INSERT IGNORE"),
    (re.compile(r"ON CONFLICT\([^)]*\) DO UPDATE SET"), "ON DUPLICATE KEY UPDATE"),
    (re.compile(r"\bexcluded\.(\w+)"), r"VALUES(\1)"),
    (re.compile(r"\bMAX\((\w+\.\w+|VALUES\(\w+\)), "), r"GREATEST(\1, "),  # two-argument max()
    (re.compile(r"(?<![`\w.])(key|partition)\b(?!`)"), r"`\1`"),  # reserved words in MariaDB
)


@functools.lru_cache(maxsize=512)
def mariadb_sql(text: str) -> str:
    """A statement in SQLite's spelling as MariaDB takes it."""
    for pattern, repl in _REWRITES:
        text = pattern.sub(repl, text)
    return text


# --------------------------------------------------------------------------- schema
# The same tables as schema.SCHEMA (decisions has ``seq``: the order rows were recorded
# in, as SQLite's rowid, for readers that follow new decisions): keys VARCHAR (an index needs a length), REAL ->
# DOUBLE, BLOB -> LONGBLOB, InnoDB, utf8mb4 compared byte for byte, trailing spaces too (user and
# job names are case-sensitive; utf8mb4_nopad_bin: MariaDB 10.2 and later). MariaDB commits DDL at
# once: the schema is created statement by statement.
_T = "ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_nopad_bin"
_K = "VARCHAR(255) NOT NULL"
MARIADB_SCHEMA = (
    f"CREATE TABLE IF NOT EXISTS meta (`key` {_K} PRIMARY KEY, value TEXT NOT NULL) {_T}",
    f"""CREATE TABLE IF NOT EXISTS decisions (
        decision_id {_K} PRIMARY KEY, decided_at DOUBLE NOT NULL, job_class TEXT NOT NULL, user {_K},
        account TEXT NOT NULL, `partition` TEXT NOT NULL, job_name TEXT NOT NULL, action TEXT NOT NULL,
        shards INTEGER NOT NULL, model_version TEXT NOT NULL, keys_json TEXT NOT NULL, facts_pb LONGBLOB NOT NULL,
        decision_pb LONGBLOB NOT NULL, seq BIGINT NOT NULL AUTO_INCREMENT, UNIQUE KEY decisions_seq (seq),
        INDEX decisions_user (user, decided_at)) {_T}""",
    f"""CREATE TABLE IF NOT EXISTS runs (
        instance {_K}, node VARCHAR(255) NOT NULL DEFAULT '', job_id BIGINT NOT NULL,
        submit_time BIGINT NOT NULL DEFAULT 0, decision_id VARCHAR(255) NOT NULL DEFAULT '',
        gpu_indices TEXT NOT NULL, started_at DOUBLE, finished_at DOUBLE,
        PRIMARY KEY (instance, node), INDEX runs_node (node, started_at), INDEX runs_job (job_id)) {_T}""",
    # co-runners (history/runs.py overlapping_runs): added in place, on every start
    "CREATE INDEX IF NOT EXISTS runs_node_finish ON runs (node, finished_at, started_at)",
    f"CREATE TABLE IF NOT EXISTS events (event_id {_K} PRIMARY KEY, kind TEXT NOT NULL, received_at DOUBLE NOT NULL) {_T}",
    f"""CREATE TABLE IF NOT EXISTS observations (
        event_id {_K} PRIMARY KEY, job_id BIGINT NOT NULL, decision_id {_K}, node TEXT NOT NULL,
        gpu_indices TEXT NOT NULL, started_at DOUBLE, finished_at DOUBLE NOT NULL, runtime_s DOUBLE,
        exit_code INTEGER NOT NULL, peak_bytes BIGINT, oom INTEGER NOT NULL, co_runners INTEGER NOT NULL,
        shared INTEGER NOT NULL, telemetry_source TEXT NOT NULL, received_at DOUBLE NOT NULL,
        instance VARCHAR(255) NOT NULL DEFAULT '', submit_time BIGINT NOT NULL DEFAULT 0,
        INDEX observations_job (job_id), INDEX observations_decision (decision_id),
        INDEX observations_instance (instance)) {_T}""",
    f"""CREATE TABLE IF NOT EXISTS class_stats (
        level VARCHAR(32) NOT NULL, `key` {_K}, stats_json TEXT NOT NULL, updated_at DOUBLE NOT NULL,
        PRIMARY KEY (level, `key`)) {_T}""",
    f"""CREATE TABLE IF NOT EXISTS decision_status (
        decision_id {_K} PRIMARY KEY, status TEXT NOT NULL, checked_at DOUBLE NOT NULL) {_T}""",
    f"""CREATE TABLE IF NOT EXISTS writer_lease (
        name VARCHAR(64) NOT NULL PRIMARY KEY, holder {_K}, epoch BIGINT NOT NULL, expires_at DOUBLE NOT NULL) {_T}""",
)
# The admission-table catch-up archive (admission/archive.py) beside the history, so that
# every service sharing the database reads every writer's versions. Added in place: no version.
ARCHIVE_MARIADB_SCHEMA = tuple(
    f"""CREATE TABLE IF NOT EXISTS admission_{table} (id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
        digest VARBINARY(16) NOT NULL, body LONGBLOB NOT NULL, UNIQUE KEY admission_{table}_digest (digest)) {_T}"""
    for table in ("blobs", "chunks")) + (
    f"""CREATE TABLE IF NOT EXISTS admission_versions (
        version VARCHAR(64) NOT NULL PRIMARY KEY, put_at DOUBLE NOT NULL, chunks LONGBLOB NOT NULL) {_T}""",
)
MARIADB_SCHEMA += ARCHIVE_MARIADB_SCHEMA


# --------------------------------------------------------------------------- the engines
@dataclass(frozen=True)
class Engine:
    """One engine's spelling. ``now_sql``: the database's clock, seconds since the epoch (the
    writer lease is timed by it, never by a host's own clock); ``lock_row``: what makes a SELECT
    lock the rows it reads until the transaction ends; ``begin``: a write transaction."""

    name: str
    now_sql: str
    lock_row: str
    begin: str
    errors: tuple[type[BaseException], ...]


SQLITE = Engine("sqlite", "(julianday('now') - 2440587.5) * 86400.0", "", "BEGIN IMMEDIATE", (sqlite3.Error,))


def _pymysql():
    try:
        import pymysql  # noqa: PLC0415 - only the mariadb backend needs the driver
    except ImportError:
        raise HistoryUnavailable("history.backend = mariadb needs PyMySQL (pip install 'swapaware[mariadb]')") from None
    return pymysql


def mariadb_engine() -> Engine:
    return Engine("mariadb", "UNIX_TIMESTAMP(NOW(6))", " FOR UPDATE", "START TRANSACTION", (_pymysql().Error,))


def retryable(exc: BaseException) -> bool:
    """Whether a failed history operation is worth trying again (the store stays usable)."""
    if isinstance(exc, HistoryUnavailable):
        return True
    if isinstance(exc, sqlite3.OperationalError):
        return "locked" in str(exc) or "busy" in str(exc)
    code = exc.args[0] if exc.args and isinstance(exc.args[0], int) else None
    return code in LOST_CODES or code in LOCK_CODES


# A TCP session whose link has gone (a network cut) ends after this many seconds without an
# acknowledgement from the server's host: of what it sent (TCP_USER_TIMEOUT), or of keepalive
# probes while it waits for an answer. Its thread then gets HistoryUnavailable, not after its
# read timeout (120 s for a write), and a link that comes back finds a new session. A server that
# is slow but reachable acknowledges both: its statements are never cut short.
DEAD_LINK_S = 10
KEEPALIVE_S = 2  # idle time before the first probe, and between probes


def end_on_dead_link(sock) -> bool:
    """Set DEAD_LINK_S on a TCP socket (a Unix socket has no link to lose). True where set."""
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return False
    for level, option, value in ((socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1),
                                 (socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_S),
                                 (socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_S),
                                 (socket.IPPROTO_TCP, socket.TCP_KEEPCNT, DEAD_LINK_S // KEEPALIVE_S),
                                 (socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, DEAD_LINK_S * 1000)):
        sock.setsockopt(level, option, value)
    return True


# The lease session's wait for the lease row (locked by a data write's fence, history/lease.py),
# seconds: a write holds it for milliseconds, so a longer wait means a stuck one, which
# history.idle_transaction_timeout_s ends on the server; the role's next round claims again.
LEASE_LOCK_WAIT_S = 2


class MyConn:
    """A PyMySQL connection that speaks like ``sqlite3.Connection`` (execute, executemany, close)
    and reopens itself after the server went away. Not shared between threads (the store holds a
    lock around each)."""

    def __init__(self, cfg: HistoryConfig, read_only: bool = False, lease: bool = False):
        self.cfg, self.read_only, self.lease = cfg, read_only, lease
        self._pymysql = _pymysql()
        self._raw: Any = None
        self.in_tx = False

    def _open(self):
        password = read_token(self.cfg.password_file) if self.cfg.password_file else ""
        where = ({"unix_socket": self.cfg.unix_socket} if self.cfg.unix_socket
                 else {"host": self.cfg.host or "127.0.0.1", "port": self.cfg.port})
        try:
            # A server that stops answering (network cut) must not hold a thread forever: a read
            # gives up after twice the connect timeout (Admit's reads), a claim or release of the
            # writer lease after its lock wait and that again, a write after 120 s (above InnoDB's
            # lock wait); either is then a lost connection (HistoryUnavailable).
            timeout = (2 * self.cfg.connect_timeout_s if self.read_only
                       else LEASE_LOCK_WAIT_S + 2 * self.cfg.connect_timeout_s if self.lease
                       else max(120.0, 2 * self.cfg.connect_timeout_s))
            raw = self._pymysql.connect(user=self.cfg.user, password=password or "", database=self.cfg.database,
                                        connect_timeout=self.cfg.connect_timeout_s, read_timeout=timeout,
                                        write_timeout=timeout, autocommit=True, charset="utf8mb4", **where)
        except self._pymysql.Error as exc:
            raise _unavailable(exc, f"cannot connect to {self.cfg.where()}") if retryable(exc) else exc
        end_on_dead_link(getattr(raw, "_sock", None))  # (PyMySQL's socket: it has no option for these)
        with raw.cursor() as cur:  # '||' concatenates (as in SQLite); strict types; UTC timestamps
            cur.execute("SET SESSION sql_mode='STRICT_ALL_TABLES,PIPES_AS_CONCAT,NO_ENGINE_SUBSTITUTION', "
                        "time_zone='+00:00'")
            cur.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
            if self.read_only:
                cur.execute("SET SESSION TRANSACTION READ ONLY")
            else:
                _limit_idle_transactions(cur, self.cfg)
            if self.lease:  # a lease row locked by a stuck write: the next round tries again
                cur.execute(f"SET SESSION innodb_lock_wait_timeout = {LEASE_LOCK_WAIT_S}")
        return raw

    def execute(self, sql: str, args=()):
        return self._run("execute", sql, args)

    def executemany(self, sql: str, rows):
        rows = list(rows)
        if not rows:
            return None
        return self._run("executemany", sql, rows)

    def _run(self, how: str, sql: str, args):
        text = mariadb_sql(sql)
        for attempt in (1, 2):
            if self._raw is None:
                self._raw = self._open()
            cur = self._raw.cursor()
            try:
                getattr(cur, how)(text, tuple(args) if how == "execute" else args)
                return cur
            except self._pymysql.Error as exc:
                code = exc.args[0] if exc.args and isinstance(exc.args[0], int) else None
                if code in LOST_CODES:
                    self._drop()
                    if attempt == 1 and not self.in_tx and sql.lstrip().upper().startswith("SELECT"):
                        continue  # a read outside a transaction: once more, on a new connection
                    raise _unavailable(exc, f"connection to {self.cfg.where()} lost") from None
                if code in LOCK_CODES:
                    raise _unavailable(exc, f"{self.cfg.where()}: lock conflict") from None
                raise
        raise AssertionError("unreachable")

    def begin(self) -> None:
        self.in_tx = True
        try:
            self.execute("START TRANSACTION")
        except BaseException:
            self.in_tx = False
            raise

    def end(self, commit: bool) -> None:
        try:
            if self._raw is not None:
                self.execute("COMMIT" if commit else "ROLLBACK")
            elif commit:
                raise HistoryUnavailable(f"connection to {self.cfg.where()} lost before commit")
        finally:
            self.in_tx = False

    def _drop(self) -> None:
        raw, self._raw = self._raw, None
        close_quietly(raw)

    def close(self) -> None:
        self._drop()


UNKNOWN_VARIABLE = 1193
_idle_limit_missing_logged = False


def _limit_idle_transactions(cur, cfg: HistoryConfig) -> None:
    """The server ends this writing session should it sit idle inside a transaction for
    ``history.idle_transaction_timeout_s`` (history/config.py says why). A server without the
    variable (MySQL; MariaDB before 10.3) is used as it is, said once in the log."""
    global _idle_limit_missing_logged
    try:
        cur.execute(f"SET SESSION idle_transaction_timeout = {int(cfg.idle_transaction_timeout_s)}")
    except _pymysql().Error as exc:
        if not (exc.args and exc.args[0] == UNKNOWN_VARIABLE):
            raise
        if not _idle_limit_missing_logged:
            _idle_limit_missing_logged = True
            log.warning("history %s has no idle_transaction_timeout: a writer cut off inside a transaction keeps "
                        "the writer lease's row locked until the server drops its connection", cfg.where())


def _unavailable(exc: BaseException, what: str) -> HistoryUnavailable:
    return HistoryUnavailable(f"{what}: {exc.args[-1] if exc.args else exc}")


def table_exists(conn, engine: Engine, name: str) -> bool:
    if engine.name == "sqlite":
        sql = "SELECT 1 FROM sqlite_master WHERE type='table' AND name=?"
    else:
        sql = "SELECT 1 FROM information_schema.tables WHERE table_schema=DATABASE() AND table_name=?"
    return conn.execute(sql, (name,)).fetchone() is not None


def close_quietly(conn) -> None:
    """Close a database connection (SQLite's or MariaDB's) that may be broken already; None: none."""
    if conn is not None:
        try:
            conn.close()
        except Exception:  # noqa: BLE001 - it is gone already
            pass
