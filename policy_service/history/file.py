"""The SQLite history's file (``HistoryStore`` on SQLite): its read-only second connection, the
copy kept before a schema migration, and the restore of a file removed or replaced while the
service ran. Nothing here applies to a MariaDB history."""
from __future__ import annotations

import logging
import os
import sqlite3
import time
from pathlib import Path

from policy_service.history.guard import note_history, private_history_file

log = logging.getLogger("policy_service.history.store")


class SqliteFile:
    """What ``HistoryStore`` does with its SQLite file (path, _conn, _rconn, _lock, _rlock, _ident)."""

    def _reader(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=10.0)
        conn.execute("PRAGMA query_only=1")
        return conn

    def check_file(self) -> str:
        """Whether the file at ``path`` is still the database this store has open. When it was
        removed or replaced while the service ran, the open database (its connections keep the
        old file alive) is copied back to ``path`` (a replacing file is kept beside it as
        ``<path>.replaced-<time>``) and the store reopens it. Returns what happened ("": nothing)."""
        if self._ident is None or _identity(self.path) == self._ident:  # (None: in memory, or not a file)
            return ""
        with self._lock, self._rlock:
            now = _identity(self.path)
            if now == self._ident:
                return ""
            what = "was removed" if now is None else "was replaced by another file"
            if now is not None:
                aside = f"{self.path}.replaced-{int(time.time())}"
                os.replace(self.path, aside)
                what += f" (kept as {aside})"
            tmp = Path(f"{self.path}.restoring")
            tmp.unlink(missing_ok=True)
            private_history_file(tmp)
            dest = sqlite3.connect(str(tmp))
            try:
                self._conn.backup(dest)
                decisions = dest.execute("SELECT count(*) FROM decisions").fetchone()[0]
            finally:
                dest.close()
            self._conn.close()
            self._rconn.close()
            for leftover in ("-wal", "-shm"):  # a stray WAL must never be applied to the restored file
                Path(self.path + leftover).unlink(missing_ok=True)
            os.replace(tmp, self.path)
            self._conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=10.0)
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._rconn = self._reader()
            self._ident = _identity(self.path)
        note_history(Path(self.path), created=False)  # its marker may have gone with it
        message = f"history {self.path} {what} while the service ran: restored from the open database " \
                  f"({decisions} decisions)"
        log.error("%s", message)
        return message

    def _backup(self, version: int) -> None:
        """A copy of a history about to be migrated, beside it (``<path>.schema<N>.bak``, 0600)."""
        if self.path == ":memory:" or self.engine.name != "sqlite":
            return
        copy = Path(f"{self.path}.schema{version}.bak")
        if copy.exists():
            return
        private_history_file(copy)
        dest = sqlite3.connect(str(copy))
        try:
            self._conn.backup(dest)
        finally:
            dest.close()


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


