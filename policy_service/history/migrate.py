"""``swapaware history migrate``: copy a SQLite history into the configured MariaDB database
(docs/history-backends.md). The source is opened read-only and must be of this build's schema
(a service of this build opens an older one in place first). The target's schema is created by
the store itself. Rows go over in batches, one transaction each, table by table; a target that
holds rows already is refused unless ``resume`` (a copy that was interrupted: rows already there
are skipped, every key being unique). At the end each table's row count is compared."""
from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable
from urllib.parse import quote

from policy_service.history.store import HistoryStore
from policy_service.history.schema import SCHEMA_VERSION
from policy_service.history.config import HistoryConfig

# Every table a history holds, in the order copied (meta is the target's own; the writer lease
# belongs to the services of the target).
TABLES = ("decisions", "decision_status", "runs", "events", "observations", "class_stats")


class MigrationError(RuntimeError):
    """The copy cannot start, or the counts differ at its end."""


@dataclass(frozen=True)
class TableCopy:
    table: str
    source_rows: int
    target_rows: int
    seconds: float


@dataclass(frozen=True)
class Migration:
    tables: tuple[TableCopy, ...]
    seconds: float

    @property
    def rows(self) -> int:
        return sum(t.source_rows for t in self.tables)

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else 0.0


def _columns(src: sqlite3.Connection, table: str) -> list[str]:
    return [r[1] for r in src.execute(f"PRAGMA table_info({table})")]


def _count(conn, table: str) -> int:
    return int(conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0])


def open_source(path: Path) -> sqlite3.Connection:
    if not path.is_file():
        raise MigrationError(f"no SQLite history at {path}")
    src = sqlite3.connect(f"file:{quote(str(path.resolve()))}?mode=ro", uri=True)
    try:
        row = src.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
    except sqlite3.Error as exc:
        src.close()
        raise MigrationError(f"{path} is not a swapaware history: {exc}") from None
    if row is None or int(row[0]) != SCHEMA_VERSION:
        src.close()
        raise MigrationError(f"{path}: history schema {row[0] if row else '?'}; this build copies schema "
                             f"{SCHEMA_VERSION} (start this build's service on it once: it migrates in place)")
    return src


def migrate_history(source: Path, target: HistoryConfig, db_path: Path | str, *, resume: bool = False,
                    batch: int = 5000, progress: Callable[[str], None] = lambda _: None) -> Migration:
    """Copy ``source`` (SQLite) into ``target`` (MariaDB); ``db_path``: service.db_path (where the
    target store's journal would lie; nothing is written there)."""
    src = open_source(source)
    store = HistoryStore(db_path, accept_empty=True, mariadb=target)  # (an empty target is what a copy fills)
    try:
        held = {t: _count(store._conn, t) for t in TABLES}
        if any(held.values()) and not resume:
            raise MigrationError(f"{target.where()} already holds rows ({', '.join(f'{t} {n}' for t, n in held.items() if n)}): "
                                 "refusing to mix two histories; copy into an empty database, or pass --resume to "
                                 "finish a copy of this same history that was interrupted")
        t0 = time.monotonic()
        copies = []
        for table in TABLES:
            cols = _columns(src, table)
            total = _count(src, table)
            insert = f"INSERT OR IGNORE INTO {table} ({', '.join(cols)}) VALUES ({','.join('?' * len(cols))})"
            started, done = time.monotonic(), 0
            cur = src.execute(f"SELECT {', '.join(cols)} FROM {table} ORDER BY rowid")
            while True:
                rows = cur.fetchmany(batch)
                if not rows:
                    break
                with store._tx(fenced=False) as c:
                    c.executemany(insert, rows)
                done += len(rows)
                progress(f"{table}: {done}/{total}")
            copies.append(TableCopy(table, total, _count(store._conn, table), time.monotonic() - started))
        result = Migration(tuple(copies), time.monotonic() - t0)
    finally:
        store.close()
        src.close()
    wrong = [f"{t.table} {t.source_rows} in {source}, {t.target_rows} in {target.where()}"
             for t in result.tables if t.source_rows != t.target_rows]
    if wrong:
        raise MigrationError("row counts differ after the copy: " + "; ".join(wrong))
    return result
