"""The per-key statistics ``HistoryStore`` reads for a decision, each key's stored text checked
once and remembered (the statistics are written with a run's observation: history/runs.py).

A SQLite history counts its statistics' changes: triggers on class_stats add one to the meta row
``stats_generation`` in the transaction of each insert, update or delete, whichever process or
tool makes it (schema.STATS_GENERATION). The statistics read are remembered per key with the
generation read before them, and handed out while it has not changed: a decision reads one meta
row instead of every key's statistics (each Admit read 3-5 keys)."""
from __future__ import annotations

import logging
from typing import Mapping

from policy_service.core.types import ClassStats, KeyLevel
from policy_service.history.schema import checked_stats

log = logging.getLogger("policy_service.history.store")
# What HistoryStore remembers of the statistics it read (their stored text, checked): a few MB
# (a class key's text is ~0.5 KB, a wide key's up to ~10 KB with 64 users' figures).
STATS_MEMO_CHARS = 8 << 20
STATS_SEEN_MAX = 65536  # (level, key) entries remembered for one generation (forgotten all at once when full)
_LEVEL = {level.value: level for level in KeyLevel}
_GENERATION_SQL = "SELECT value FROM meta WHERE key='stats_generation'"
_ABSENT = (None, ())  # a key without statistics, remembered as such


class ClassStatsReads:
    """``HistoryStore``'s statistics reads (uses its where, _read and the memo, _stats_memo,
    _stats_memo_chars and _stats_memo_lock, that its __init__ makes; ``_stats_counted``, set where
    the history counts its statistics' changes)."""

    _stats_counted = False  # False: every decision reads its keys (MariaDB, read-only histories)
    # (generation, {(level, key): (statistics or None, what was out of range)}): one tuple, replaced whole
    _stats_seen: tuple[str, dict] | None = None

    def stats(self, keys: Mapping[KeyLevel, str]) -> dict[KeyLevel, ClassStats]:
        if not keys:
            return {}
        if not self._stats_counted:
            return self._stats_read(keys, None)
        rows = self._read(_GENERATION_SQL)
        if not rows:  # (no such row: not counted; read as it is)
            return self._stats_read(keys, None)
        state = self._stats_seen
        if state is None or state[0] != rows[0][0] or len(state[1]) >= STATS_SEEN_MAX:
            # what a generation's dict holds was read after that generation was (a reader still
            # holding an older one finishes with it)
            state = self._stats_seen = (rows[0][0], {})
        seen = state[1]
        missing = {level: key for level, key in keys.items() if (level, key) not in seen}
        if missing:
            self._stats_read(missing, seen)
        out = {}
        for level, key in keys.items():
            hit = seen.get((level, key), _ABSENT)
            if hit[1]:
                _bounded(self.where, level, key, hit[1])
            if hit[0] is not None:
                out[level] = hit[0]
        return out

    def _stats_read(self, keys: Mapping[KeyLevel, str], seen: dict | None) -> dict[KeyLevel, ClassStats]:
        """The statistics of ``keys`` from the history; each key's (a key without any: absent)
        put in ``seen`` where given (its warnings then left to the caller)."""
        where = " OR ".join("(level=? AND key=?)" for _ in keys)
        args = [x for level, key in keys.items() for x in (level.value, key)]
        rows = self._read(f"SELECT level, key, stats_json FROM class_stats WHERE {where}", args)
        out = {}
        for level, key, text in rows:
            level = _LEVEL.get(level) or KeyLevel(level)
            out[level], bad = hit = self._checked(text)
            if seen is not None:
                seen[(level, key)] = hit
            elif bad:
                _bounded(self.where, level.value, key, bad)
        if seen is not None:
            for level, key in keys.items():
                seen.setdefault((level, key), _ABSENT)
        return out

    def _checked(self, text: str) -> tuple[ClassStats, tuple[str, ...]]:
        """``checked_stats(text)``, remembered: bringing a key's statistics within bounds was 3 in 4
        of an Admit's CPU (every Admit reads 3-5 keys, a wide key holding up to 64 users' figures),
        and a key's stored text changes only when an observation is folded into it. The result is
        a pure function of the text and immutable (frozen, tuples), so a remembered one is the same
        value; least recently used texts are forgotten past STATS_MEMO_CHARS."""
        if not isinstance(text, (str, bytes)):
            return checked_stats(text)  # NULL: no statistics
        memo = self._stats_memo
        with self._stats_memo_lock:
            hit = memo.get(text)
            if hit is not None:
                memo.move_to_end(text)
                return hit
        hit = checked_stats(text)
        with self._stats_memo_lock:
            if text not in memo:
                memo[text] = hit
                self._stats_memo_chars += len(text)
                while self._stats_memo_chars > STATS_MEMO_CHARS and len(memo) > 1:
                    old, _ = memo.popitem(last=False)
                    self._stats_memo_chars -= len(old)
        return hit


def _bounded(where: str, level, key: str, bad: tuple[str, ...]) -> None:
    """Statistics written by other means than the service: bounded, never believed as stored."""
    log.warning("history %s: statistics of %s key %s out of range (%s): brought within bounds",
                where, getattr(level, "value", level), key, ", ".join(bad))
