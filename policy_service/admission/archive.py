"""The published admission tables, kept for catch-up: (version, entry, state) -> DecisionRecord.

A job decided by the plugin from the class table carries ``tbl=<version>:<i><g>`` in its
AdminComment (core/admission.py); catch-up (admission/catchup.py) looks the template up
here and records it with the job's own id, time and uid.

Where it lives follows the history ([history] backend, docs/history-backends.md):
  * SQLite history: a SQLite file beside it (``<db_path>.admission``, 0600), this service's own;
  * MariaDB history: tables ``admission_blobs``, ``admission_chunks``, ``admission_versions`` in
    the same database (history/db.py ARCHIVE_MARIADB_SCHEMA, created with the history's tables), so
    that after ``scontrol takeover`` the new writer finds the versions the old writer published
    (docs/ha.md): jobs the plugin decided from the old writer's table are recorded from their
    template, not from the AdminComment alone.

Content-deduplicated, since consecutive versions are nearly identical:
  blobs    one row per distinct entry: its states' templates together (they share most of their
           bytes), each with its table token swapped for a placeholder of the same length (every
           token has the same length, so the protobuf bytes stay valid)
  chunks   one row per distinct run of CHUNK entries' (entry, state, blob) triples
  versions per version: when it was last published and the list of its chunks
A version costs its chunk list plus what changed. ``prune`` drops versions last published
before a time and then the chunks and blobs no version names.

Not fenced by the history's writer lease (history/lease.py), on purpose: a write here never
decides anything by itself. ``put`` adds a version under a new random name before any job can
name it, and what it stores is exactly what that version's table file tells the plugin, so a
service that just lost the lease adds only true templates: a fence would only lose the templates
of a table the plugin may still be reading (the old writer's last file stays in place until the
new writer replaces it). ``touch`` and ``prune`` only move or drop versions by age. What a shared
archive does need is that a ``put`` and another service's ``prune`` never interleave (a prune
deleting a template that a new version then names): each first locks every version row
(``SELECT ... FOR UPDATE``; SQLite's BEGIN IMMEDIATE locks the whole file), and on MariaDB a
``put`` looks every template up again (this process's memory of row ids is trusted only for its
own file). Times are the publishing host's clock: skew between hosts is seconds, the archive
keeps versions for valid_s + the reconcile window.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import sqlite3
import struct
import threading
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping

from policy_service.history.journal_records import DecisionRecord
from policy_service.history.db import SQLITE, MyConn, mariadb_engine, table_exists
from policy_service.history.lease import unfenced_tx
from policy_service.core.admission import LETTER_STATE, MAX_ENTRY, STATE_LETTER, TOKEN_CHARS, TableRef
from policy_service.history.config import HistoryBackend, HistoryConfig

CHUNK = 1024  # entries per chunk
MADE_MAX = 4096  # templates lookup() keeps made (forgotten all at once when full)
_TRIPLE = struct.Struct("<IBq")  # entry, state letter, blob id
_SLOT = struct.Struct("<Iq")  # chunk number, chunk id
_FRAME = struct.Struct("<BI")  # state letter, length of the template that follows
_PLACEHOLDER = b"tbl=" + b"@" * (TOKEN_CHARS - 4)

SCHEMA = """
CREATE TABLE IF NOT EXISTS blobs (id INTEGER PRIMARY KEY, digest BLOB UNIQUE NOT NULL, body BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS chunks (id INTEGER PRIMARY KEY, digest BLOB UNIQUE NOT NULL, body BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS versions (version TEXT PRIMARY KEY, put_at REAL NOT NULL, chunks BLOB NOT NULL);
"""


def archive_path(history_path: str) -> Path:
    """Where the archive of a history lives (beside it)."""
    return Path(f"{history_path}.admission")


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def stored_entry(version: str, entry: int, records: Mapping[str, DecisionRecord]) -> tuple[bytes, bytes]:
    """(digest, body) of one entry's templates (gate state -> record) as the archive stores them:
    together (an entry's states share most of their bytes), each with its table token (of
    ``version``, ``entry``, its state) swapped for the placeholder, so that what versions hold
    alike is stored once."""
    frames = []
    for state in sorted(records, key=lambda st: STATE_LETTER[st]):
        rec = records[state]
        token = TableRef(version, entry, state).token.encode()
        if len(token) != len(_PLACEHOLDER) or token not in rec.decision_pb:
            raise ValueError(f"the template for ({entry}, {state!r}) does not carry {token!r}")
        plain = dataclasses.replace(rec, decision_pb=rec.decision_pb.replace(token, _PLACEHOLDER)).encode()[8:]
        frames.append(_FRAME.pack(ord(STATE_LETTER[state]), len(plain)) + plain)
    body = zlib.compress(b"".join(frames), 1)
    return _digest(body), body


def _frames(body: bytes) -> Iterator[tuple[str, bytes]]:
    data, at = zlib.decompress(body), 0
    while at < len(data):
        letter, size = _FRAME.unpack_from(data, at)
        at += _FRAME.size
        yield chr(letter), data[at:at + size]
        at += size


@dataclass(frozen=True)
class _Tables:
    blobs: str
    chunks: str
    versions: str


_FILE_TABLES = _Tables("blobs", "chunks", "versions")
_MARIADB_TABLES = _Tables("admission_blobs", "admission_chunks", "admission_versions")
_BATCH = 500  # digests or ids per statement


class TableArchive:
    """put / lookup / prune over one SQLite file (``path``) or the MariaDB history's database
    (``mariadb``: its [history] config; the history's tables, this archive's among them, are
    created by HistoryStore, opened first); safe to share between threads."""

    def __init__(self, path: Path | None = None, clock=time.time, *, mariadb: HistoryConfig | None = None):
        self.clock = clock
        self._lock = threading.Lock()
        if mariadb is not None:
            self.path, self.where, self.engine, self._t = None, mariadb.where(), mariadb_engine(), _MARIADB_TABLES
            self._conn = MyConn(mariadb)
            if not table_exists(self._conn, self.engine, self._t.versions):
                self._conn.close()
                raise RuntimeError(f"{self.where}: no {self._t.versions} table (the history, opened first, creates "
                                   "it: this build's HistoryStore on that database)")
        else:
            self.path, self.engine, self._t = Path(path), SQLITE, _FILE_TABLES
            self.where = str(self.path)
            if not self.path.exists():
                os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600))
            self._conn = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._conn.executescript(SCHEMA)
        # digest -> row id, what this process has put or seen: only for its own file (on a shared
        # database another service's prune may delete a row this process remembers)
        self._own = self.engine is SQLITE
        self._blob_ids: dict[bytes, int] = {}
        self._chunk_ids: dict[bytes, int] = {}
        self._cache: OrderedDict[tuple[str, int], dict[tuple[int, str], int]] = OrderedDict()
        # (template row id, version, entry, state) -> the template lookup() made of it, for its own
        # file only (a shared database's rows another service prunes must read as gone): a row's
        # body never changes (rows are content-addressed), and the catch-up looks the same slot up
        # for every job a class's burst made (decoding it was half its CPU per job); cleared with
        # the chunks by prune
        self._made: dict[tuple[int, str, int, str], DecisionRecord] = {}

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    # ------------------------------------------------------------------ put
    def put(self, version: str, templates: Mapping[tuple[int, str], DecisionRecord]) -> None:
        """Keep ``templates`` ((entry, state) -> record with the table token in its decision's
        AdminComment) as ``version``; a version put again is replaced."""
        by_entry: dict[int, dict[str, DecisionRecord]] = {}
        for (entry, state), rec in templates.items():
            by_entry.setdefault(entry, {})[state] = rec
        self.put_stored(version, {entry: (tuple(recs), *stored_entry(version, entry, recs))
                                  for entry, recs in by_entry.items()})

    def put_stored(self, version: str, entries: Mapping[int, tuple[tuple[str, ...], bytes, bytes]]) -> None:
        """``put`` of entries already in their stored form: entry -> (its states, and the digest
        and body ``stored_entry`` made; the publisher keeps them, built once while an entry holds)."""
        for entry, (states, _, _) in entries.items():
            if not 0 <= entry <= MAX_ENTRY or not states or any(st not in STATE_LETTER for st in states):
                raise ValueError(f"bad table slot ({entry}, {states!r})")
        t = self._t
        try:
            with unfenced_tx(self) as c:
                self._lock_versions(c)
                blob_ids = self._rows(c, t.blobs, self._blob_ids, {d: b for _, d, b in entries.values()})
                triples = sorted((entry, STATE_LETTER[st], blob_ids[digest])
                                 for entry, (states, digest, _) in entries.items() for st in states)
                by_chunk: dict[int, list] = {}
                for tr in triples:
                    by_chunk.setdefault(tr[0] // CHUNK, []).append(tr)
                bodies = {number: zlib.compress(b"".join(_TRIPLE.pack(e, ord(g), b) for e, g, b in rows), 1)
                          for number, rows in sorted(by_chunk.items())}
                chunk_ids = self._rows(c, t.chunks, self._chunk_ids, {_digest(b): b for b in bodies.values()})
                slots = b"".join(_SLOT.pack(number, chunk_ids[_digest(body)]) for number, body in bodies.items())
                c.execute(f"INSERT OR REPLACE INTO {t.versions} (version, put_at, chunks) VALUES (?, ?, ?)",
                          (version, self.clock(), slots))
                self._forget(version)
        except BaseException:
            self._blob_ids.clear()
            self._chunk_ids.clear()
            raise

    def touch(self, version: str, at: float | None = None) -> bool:
        """Note that ``version`` was published again (kept as long as from a new put); False when
        it is not archived."""
        with unfenced_tx(self) as c:
            if c.execute(f"UPDATE {self._t.versions} SET put_at = ? WHERE version = ?",
                         (self.clock() if at is None else at, version)).rowcount > 0:
                return True  # (MariaDB counts changed rows only: the same time again counts 0)
            return c.execute(f"SELECT 1 FROM {self._t.versions} WHERE version = ?", (version,)).fetchone() is not None

    def _lock_versions(self, c) -> None:
        """Every version row locked until the transaction ends: another service's put or prune
        waits (SQLite: BEGIN IMMEDIATE did it already)."""
        if self.engine.lock_row:
            c.execute(f"SELECT version FROM {self._t.versions}{self.engine.lock_row}").fetchall()

    def _rows(self, c, table: str, known: dict[bytes, int], bodies: Mapping[bytes, bytes]) -> dict[bytes, int]:
        """digest -> row id in ``table`` for every (digest, body) given, a row added where none
        holds it (``known``: this process's memory, trusted for its own file only)."""
        ids = {d: known[d] for d in bodies if d in known} if self._own else {}
        for _ in (1, 2):  # what is there; then what was missing, once inserted
            missing = [d for d in bodies if d not in ids]
            for i in range(0, len(missing), _BATCH):
                part = missing[i:i + _BATCH]
                ids.update((bytes(d), int(n)) for d, n in c.execute(
                    f"SELECT digest, id FROM {table} WHERE digest IN ({','.join('?' * len(part))})", part).fetchall())
            missing = [d for d in bodies if d not in ids]
            if not missing:
                break
            c.executemany(f"INSERT OR IGNORE INTO {table} (digest, body) VALUES (?, ?)",
                          [(d, bodies[d]) for d in missing])
        if self._own:
            known.update(ids)
        return ids

    # ------------------------------------------------------------------ lookup
    def versions(self) -> list[tuple[str, float]]:
        """(version, last published) of every archived version, newest first."""
        with self._lock:
            return [(str(v), float(t)) for v, t in self._conn.execute(
                f"SELECT version, put_at FROM {self._t.versions} ORDER BY put_at DESC").fetchall()]

    def lookup(self, version: str, entry: int, state: str) -> DecisionRecord | None:
        """The template the service published for (version, entry, state): decision_id
        PLACEHOLDER_ID, decided_at 0, the table token in its decision's AdminComment. None when
        the version or the slot is not archived."""
        if state not in STATE_LETTER or not 0 <= entry <= MAX_ENTRY:
            return None
        with self._lock:
            row = None
            for _ in (1, 2):  # a remembered chunk whose template is gone (pruned): read again
                slots = self._chunk(version, entry // CHUNK)
                blob_id = slots.get((entry, state)) if slots is not None else None
                if blob_id is None:
                    return None
                made = self._made.get((blob_id, version, entry, state)) if self._own else None
                if made is not None:  # (own file: only this process prunes it, and forgets them then)
                    return made
                row = self._conn.execute(f"SELECT body FROM {self._t.blobs} WHERE id = ?", (blob_id,)).fetchone()
                if row is not None or self._own:
                    break
                self._forget(version)
            if row is None:
                return None
            letter = STATE_LETTER[state]
            plain = next((frame for g, frame in _frames(bytes(row[0])) if g == letter), None)
            if plain is None:
                return None
            rec = DecisionRecord.decode(plain)
            token = TableRef(version, entry, state).token.encode()
            made = dataclasses.replace(rec, decision_pb=rec.decision_pb.replace(_PLACEHOLDER, token))
            if self._own:
                if len(self._made) >= MADE_MAX:
                    self._made.clear()
                self._made[(blob_id, version, entry, state)] = made
            return made

    def _chunk(self, version: str, number: int) -> dict[tuple[int, str], int] | None:
        key = (version, number)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        row = self._conn.execute(f"SELECT chunks FROM {self._t.versions} WHERE version = ?", (version,)).fetchone()
        if row is None:
            return None
        chunk_id = next((c for n, c in _SLOT.iter_unpack(bytes(row[0])) if n == number), None)
        slots: dict[tuple[int, str], int] = {}
        if chunk_id is not None:
            body = self._conn.execute(f"SELECT body FROM {self._t.chunks} WHERE id = ?", (chunk_id,)).fetchone()
            if body is not None:
                slots = {(e, LETTER_STATE[chr(g)]): b
                         for e, g, b in _TRIPLE.iter_unpack(zlib.decompress(bytes(body[0])))}
        self._cache[key] = slots
        if len(self._cache) > 64:
            self._cache.popitem(last=False)
        return slots

    def _forget(self, version: str) -> None:
        for key in [k for k in self._cache if k[0] == version]:
            del self._cache[key]
        for key in [k for k in self._made if k[1] == version]:
            del self._made[key]

    # ------------------------------------------------------------------ prune
    def prune(self, older_than: float) -> int:
        """Drop the versions last published before ``older_than``, then the chunks and templates
        no remaining version names. Returns how many versions were dropped."""
        gone: list[str] = []
        t = self._t
        try:
            with unfenced_tx(self) as c:
                self._lock_versions(c)
                gone = [str(v) for (v,) in c.execute(f"SELECT version FROM {t.versions} WHERE put_at < ?",
                                                     (older_than,)).fetchall()]
                if gone:
                    c.execute(f"DELETE FROM {t.versions} WHERE put_at < ?", (older_than,))
                    self._collect(c)
                self._cache.clear()
                self._made.clear()
        finally:
            if gone:
                self._blob_ids.clear()
                self._chunk_ids.clear()
        return len(gone)

    def _collect(self, c) -> None:
        t = self._t
        chunk_ids = {cid for (slots,) in c.execute(f"SELECT chunks FROM {t.versions}").fetchall()
                     for _, cid in _SLOT.iter_unpack(bytes(slots))}
        self._keep_only(c, t.chunks, chunk_ids)
        blob_ids = {b for (body,) in c.execute(f"SELECT body FROM {t.chunks}").fetchall()
                    for _, _, b in _TRIPLE.iter_unpack(zlib.decompress(bytes(body)))}
        self._keep_only(c, t.blobs, blob_ids)

    @staticmethod
    def _keep_only(c, table: str, keep: set[int]) -> None:
        drop = [i for (i,) in c.execute(f"SELECT id FROM {table}").fetchall() if int(i) not in keep]
        for i in range(0, len(drop), _BATCH):
            part = drop[i:i + _BATCH]
            c.execute(f"DELETE FROM {table} WHERE id IN ({','.join('?' * len(part))})", part)


def open_archive(cfg) -> TableArchive:
    """The archive of the service's history (the one Config): in the MariaDB database when the
    history is there, else the SQLite file beside service.db_path."""
    if cfg.history.backend is HistoryBackend.MARIADB:
        return TableArchive(mariadb=cfg.history)
    return TableArchive(archive_path(str(cfg.service.db_path)))
