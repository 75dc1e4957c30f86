"""The history opened read-only for reports (``swapaware report``): never creates or migrates it.
Reads schema 3 and, for a history the service has not opened since an upgrade, schema 2 (whose
runs and observations all count as legacy: known by job id only). A SQLite file (``mode=ro``), or
the MariaDB database a ``HistoryConfig`` names (a read-only session)."""
from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Iterable
from urllib.parse import quote

from policy_service.history.db import HistoryUnavailable, MyConn, mariadb_engine
from policy_service.history.schema import (
    DECISION_COLS,
    OBSERVATION_COLS,
    OBSERVATION_COLS_V2,
    SCHEMA_VERSION,
    DecisionRow,
    ObservationRow,
    decision_row,
    observation_row,
)
from policy_service.history.config import HistoryConfig

READABLE_VERSIONS = (2, SCHEMA_VERSION)


class HistoryUnreadable(RuntimeError):
    """The history file is missing, not ours, or of another schema version."""


class ReadOnlyHistory:
    """The history opened read-only (``mode=ro``) for reports: never creates or migrates it."""

    CHUNK = 500  # ids per IN (...) query, below SQLite's variable limit

    def __init__(self, path: Path | str | HistoryConfig):
        if isinstance(path, HistoryConfig):
            self._errors: tuple = (HistoryUnavailable, *mariadb_engine().errors)
            self._conn = MyConn(path, read_only=True)
            where = path.where()
        else:
            path = where = Path(path)
            self._errors = (sqlite3.Error,)
            if not path.is_file():
                raise HistoryUnreadable(f"no history database at {path}")
        try:
            if isinstance(path, Path):
                self._conn = sqlite3.connect(f"file:{quote(str(path.resolve()))}?mode=ro", uri=True, timeout=10.0)
            row = self._conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        except self._errors as exc:
            raise HistoryUnreadable(f"{where} is not a swapaware history database (or unreadable): {exc}") from None
        if row is None or int(row[0]) not in READABLE_VERSIONS:
            self._conn.close()
            raise HistoryUnreadable(f"{where}: history schema {row[0] if row else '?'}, this build reads "
                                    f"{' and '.join(map(str, READABLE_VERSIONS))}")
        self.version = int(row[0])

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
        except self._errors as exc:
            raise HistoryUnreadable(f"cannot read the history: {exc}") from None
        return out

    def run_instances(self, job_ids: Iterable[int]) -> list[tuple[int, int, str]]:
        """(job id, submit time, decision id) of every run of these ids that names a decision; submit
        time 0 where the instance is not known by it (legacy, SLUID-only or unresolved runs)."""
        submit = "submit_time" if self.version >= 3 else "0"
        rows = self._select_in(f"SELECT DISTINCT job_id, {submit}, decision_id FROM runs WHERE job_id IN ({{marks}}) "
                               "AND decision_id != ''", job_ids)
        return [(int(j), int(s or 0), d) for j, s, d in rows]

    def run_decisions(self, job_ids: Iterable[int]) -> dict[int, str]:
        """Job id -> the decision its newest start record names (jobs with none are left out)."""
        rows = self._select_in("SELECT job_id, decision_id FROM runs WHERE job_id IN ({marks}) AND decision_id != '' "
                               "ORDER BY started_at IS NULL DESC, started_at", job_ids)
        return {int(j): d for j, d in rows}  # the newest start last: it wins

    def observations_of(self, job_ids: Iterable[int]) -> list[ObservationRow]:
        cols = OBSERVATION_COLS if self.version >= 3 else OBSERVATION_COLS_V2
        return [observation_row(r) for r in
                self._select_in(f"SELECT {cols} FROM observations WHERE job_id IN ({{marks}})", job_ids)]

    def decisions_by_id(self, decision_ids: Iterable[str]) -> dict[str, DecisionRow]:
        rows = self._select_in(f"SELECT {DECISION_COLS} FROM decisions WHERE decision_id IN ({{marks}})",
                               (d for d in decision_ids if d))
        return {r[0]: decision_row(r) for r in rows}
