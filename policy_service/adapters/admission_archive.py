"""The published admission tables, kept for catch-up: (version, entry, state) -> DecisionRecord.

A job decided by the plugin from the class table carries ``tbl=<version>:<i><g>`` in its
AdminComment (core/admission.py); catch-up (adapters/admission_catchup.py) looks the template up
here and records it with the job's own id, time and uid.

SQLite beside the history (``<db_path>.admission``, 0600), content-deduplicated, since
consecutive versions are nearly identical:
  blobs    one row per distinct entry: its states' templates together (they share most of their
           bytes), each with its table token swapped for a placeholder of the same length (every
           token has the same length, so the protobuf bytes stay valid)
  chunks   one row per distinct run of CHUNK entries' (entry, state, blob) triples
  versions per version: when it was last published and the list of its chunks
A version costs its chunk list plus what changed. ``prune`` drops versions last published
before a time and then the chunks and blobs no version names.
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
from pathlib import Path
from typing import Iterable, Iterator, Mapping

from policy_service.adapters.decision_log import DecisionRecord
from policy_service.core.admission import LETTER_STATE, MAX_ENTRY, STATE_LETTER, TOKEN_CHARS, TableRef

CHUNK = 1024  # entries per chunk
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


class TableArchive:
    """put / lookup / prune over one SQLite file; safe to share between threads."""

    def __init__(self, path: Path, clock=time.time):
        self.path, self.clock = Path(path), clock
        if not self.path.exists():
            os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600))
        self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)
        self._lock = threading.Lock()
        self._blob_ids: dict[bytes, int] = {}  # digest -> id, what this process has put or seen
        self._chunk_ids: dict[bytes, int] = {}
        self._cache: OrderedDict[tuple[str, int], dict[tuple[int, str], int]] = OrderedDict()

    def close(self) -> None:
        with self._lock:
            self._db.close()

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
        triples = []
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                for entry, (states, digest, body) in entries.items():
                    if not 0 <= entry <= MAX_ENTRY or not states or any(st not in STATE_LETTER for st in states):
                        raise ValueError(f"bad table slot ({entry}, {states!r})")
                    blob_id = self._row("blobs", self._blob_ids, body, digest)
                    triples.extend((entry, STATE_LETTER[st], blob_id) for st in states)
                triples.sort()
                slots = []
                by_chunk: dict[int, list] = {}
                for t in triples:
                    by_chunk.setdefault(t[0] // CHUNK, []).append(t)
                for number, rows in sorted(by_chunk.items()):
                    body = zlib.compress(b"".join(_TRIPLE.pack(e, ord(g), b) for e, g, b in rows), 1)
                    slots.append(_SLOT.pack(number, self._row("chunks", self._chunk_ids, body, _digest(body))))
                self._db.execute("INSERT OR REPLACE INTO versions (version, put_at, chunks) VALUES (?, ?, ?)",
                                 (version, self.clock(), b"".join(slots)))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                self._blob_ids.clear()
                self._chunk_ids.clear()
                raise
            self._forget(version)

    def touch(self, version: str, at: float | None = None) -> bool:
        """Note that ``version`` was published again (kept as long as from a new put); False when
        it is not archived."""
        with self._lock:
            cur = self._db.execute("UPDATE versions SET put_at = ? WHERE version = ?",
                                   (self.clock() if at is None else at, version))
            return cur.rowcount > 0

    def _row(self, table: str, known: dict[bytes, int], body: bytes, digest: bytes) -> int:
        row_id = known.get(digest)
        if row_id is None:
            row = self._db.execute(f"SELECT id FROM {table} WHERE digest = ?", (digest,)).fetchone()
            if row is None:
                row_id = self._db.execute(f"INSERT INTO {table} (digest, body) VALUES (?, ?)",
                                          (digest, body)).lastrowid
            else:
                row_id = row[0]
            known[digest] = row_id
        return row_id

    # ------------------------------------------------------------------ lookup
    def versions(self) -> list[tuple[str, float]]:
        """(version, last published) of every archived version, newest first."""
        with self._lock:
            return [(v, t) for v, t in self._db.execute("SELECT version, put_at FROM versions ORDER BY put_at DESC")]

    def lookup(self, version: str, entry: int, state: str) -> DecisionRecord | None:
        """The template the service published for (version, entry, state): decision_id
        PLACEHOLDER_ID, decided_at 0, the table token in its decision's AdminComment. None when
        the version or the slot is not archived."""
        if state not in STATE_LETTER or not 0 <= entry <= MAX_ENTRY:
            return None
        with self._lock:
            slots = self._chunk(version, entry // CHUNK)
            blob_id = slots.get((entry, state)) if slots is not None else None
            if blob_id is None:
                return None
            row = self._db.execute("SELECT body FROM blobs WHERE id = ?", (blob_id,)).fetchone()
        if row is None:
            return None
        letter = STATE_LETTER[state]
        plain = next((frame for g, frame in _frames(row[0]) if g == letter), None)
        if plain is None:
            return None
        rec = DecisionRecord.decode(plain)
        token = TableRef(version, entry, state).token.encode()
        return dataclasses.replace(rec, decision_pb=rec.decision_pb.replace(_PLACEHOLDER, token))

    def _chunk(self, version: str, number: int) -> dict[tuple[int, str], int] | None:
        key = (version, number)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        row = self._db.execute("SELECT chunks FROM versions WHERE version = ?", (version,)).fetchone()
        if row is None:
            return None
        chunk_id = next((c for n, c in _SLOT.iter_unpack(row[0]) if n == number), None)
        slots: dict[tuple[int, str], int] = {}
        if chunk_id is not None:
            body = self._db.execute("SELECT body FROM chunks WHERE id = ?", (chunk_id,)).fetchone()
            if body is not None:
                slots = {(e, LETTER_STATE[chr(g)]): b for e, g, b in _TRIPLE.iter_unpack(zlib.decompress(body[0]))}
        self._cache[key] = slots
        if len(self._cache) > 64:
            self._cache.popitem(last=False)
        return slots

    def _forget(self, version: str) -> None:
        for key in [k for k in self._cache if k[0] == version]:
            del self._cache[key]

    # ------------------------------------------------------------------ prune
    def prune(self, older_than: float) -> int:
        """Drop the versions last published before ``older_than``, then the chunks and templates
        no remaining version names. Returns how many versions were dropped."""
        gone: list[str] = []
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                gone = [v for (v,) in self._db.execute("SELECT version FROM versions WHERE put_at < ?",
                                                       (older_than,))]
                if gone:
                    self._db.execute("DELETE FROM versions WHERE put_at < ?", (older_than,))
                    self._collect()
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            finally:
                if gone:
                    self._blob_ids.clear()
                    self._chunk_ids.clear()
                self._cache.clear()
        return len(gone)

    def _collect(self) -> None:
        chunk_ids = {c for (slots,) in self._db.execute("SELECT chunks FROM versions")
                     for _, c in _SLOT.iter_unpack(slots)}
        self._keep_only("chunks", chunk_ids)
        blob_ids = {b for (body,) in self._db.execute("SELECT body FROM chunks")
                    for _, _, b in _TRIPLE.iter_unpack(zlib.decompress(body))}
        self._keep_only("blobs", blob_ids)

    def _keep_only(self, table: str, ids: Iterable[int]) -> None:
        self._db.execute("CREATE TEMP TABLE IF NOT EXISTS keep (id INTEGER PRIMARY KEY)")
        self._db.execute("DELETE FROM keep")
        self._db.executemany("INSERT INTO keep (id) VALUES (?)", ((i,) for i in ids))
        self._db.execute(f"DELETE FROM {table} WHERE id NOT IN (SELECT id FROM keep)")
