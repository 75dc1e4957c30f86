"""A decision as the journal frames it (history/decision_log.py writes and reads the journal):
``DecisionRecord`` (what the history stores of one decision), its framing (4-byte little-endian
length, 4-byte CRC-32, then a JSON object), ``read_journal`` (the whole records of a journal's
bytes), and Admit's memo of one decision template's text (``RecordText``, ``NoteText``: each
record or note that text with its own id put in)."""
from __future__ import annotations

import base64
import json
import math
import struct
import zlib
from dataclasses import dataclass, fields

_HEADER = struct.Struct("<II")
MAX_RECORD_BYTES = 4 << 20  # far above any decision (requests are at most 256 KiB)


@dataclass(frozen=True)
class DecisionRecord:
    """One decision as the history stores it (HistoryStore.record_decision's arguments)."""

    decision_id: str
    decided_at: float
    job_class: str
    user: str
    account: str
    partition: str
    job_name: str
    action: str
    shards: int
    model_version: str
    keys: dict  # KeyLevel value -> key
    facts_pb: bytes
    decision_pb: bytes

    def encode(self) -> bytes:
        d = {name: getattr(self, name) for name in _RECORD_FIELDS}  # shallow: asdict deep-copies
        d["facts_pb"] = base64.b64encode(self.facts_pb).decode()
        d["decision_pb"] = base64.b64encode(self.decision_pb).decode()
        body = _ENCODE(d).encode()
        return _HEADER.pack(len(body), zlib.crc32(body)) + body

    @classmethod
    def decode(cls, body: bytes) -> "DecisionRecord":
        d = json.loads(body)
        d["facts_pb"] = base64.b64decode(d["facts_pb"])
        d["decision_pb"] = base64.b64decode(d["decision_pb"])
        return cls(**d)


_RECORD_FIELDS = tuple(f.name for f in fields(DecisionRecord))


class RecordText:
    """``encode()`` of records that differ from ``rec`` only in their decision id, time and decision
    message (Admit's memo: one decision template, each Admit its own id): ``rec`` is encoded once
    with a marker in each of those three places, and each record is that text with its own values
    put in, as ``encode`` writes them. ``usable``: False where a marker was not found once."""

    _ID, _AT, _PB = "swapaware-record-id-marker", 1.2345678901234567e-300, b"swapaware-record-pb-marker"

    def __init__(self, rec: DecisionRecord):
        probe = DecisionRecord(**{**{name: getattr(rec, name) for name in _RECORD_FIELDS},
                                  "decision_id": self._ID, "decided_at": self._AT, "decision_pb": self._PB})
        text = probe.encode()[_HEADER.size:].decode("ascii")
        markers = (_FLOAT(self._AT), _STRING(self._ID), _STRING(base64.b64encode(self._PB).decode()))
        self.usable = all(text.count(m) == 1 for m in markers)
        self._pieces: list[str] = []
        for m in markers:
            head, _, text = text.partition(m)
            self._pieces.append(head)
        self._pieces.append(text)

    def encode(self, decision_id: str, decided_at: float, decision_pb: bytes) -> bytes:
        """``encode()`` of the record with these three values."""
        at = _FLOAT(decided_at) if type(decided_at) is float and math.isfinite(decided_at) else _ENCODE(decided_at)
        a, b, c, d = self._pieces
        body = f"{a}{at}{b}{_STRING(decision_id)}{c}\"{base64.b64encode(decision_pb).decode()}\"{d}".encode()
        return _HEADER.pack(len(body), zlib.crc32(body)) + body


class NoteText:
    """``json.dumps(note, sort_keys=True)`` of notes that differ from ``note`` only in their
    "decision_id" (Admit's memo: one decision template, each Admit its own id): the text made once
    with a marker there, each note's that text with its own id put in. ``usable``: False where the
    marker was not found once."""

    _ID = RecordText._ID

    def __init__(self, note: dict):
        text = json.dumps({**note, "decision_id": self._ID}, sort_keys=True)
        marker = _STRING(self._ID)
        self.usable = text.count(marker) == 1
        self._head, _, self._tail = text.partition(marker)

    def text(self, decision_id: str) -> str:
        return f"{self._head}{_STRING(decision_id)}{self._tail}"


_FLOAT = float.__repr__  # how json writes a finite float
_STRING = json.encoder.encode_basestring_ascii  # and a string (ensure_ascii, the default)
# json.dumps(d, separators=(",", ":"), sort_keys=True), without a new encoder per record
_ENCODE = json.JSONEncoder(separators=(",", ":"), sort_keys=True).encode


def read_journal(data: bytes) -> tuple[list[DecisionRecord], int]:
    """The whole records in ``data`` and how many bytes at its end were torn or corrupt."""
    out, pos = [], 0
    while pos + _HEADER.size <= len(data):
        size, crc = _HEADER.unpack_from(data, pos)
        body = data[pos + _HEADER.size: pos + _HEADER.size + size]
        if size > MAX_RECORD_BYTES or len(body) < size or zlib.crc32(body) != crc:
            break
        try:
            out.append(DecisionRecord.decode(body))
        except (ValueError, TypeError, KeyError):
            break
        pos += _HEADER.size + size
    return out, len(data) - pos
