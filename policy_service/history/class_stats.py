"""The per-key statistics ``HistoryStore`` reads for a decision, each key's stored text checked
once and remembered (the statistics are written with a run's observation: history/runs.py).

A SQLite history counts its statistics' changes: triggers on class_stats add one to the meta row
``stats_generation`` in the transaction of each insert, update or delete, whichever process or
tool makes it (schema.SCHEMA). The statistics read are remembered per key with the generation read
in the same statement, and handed out while it has not changed: a decision whose keys were all
read before reads that one meta row instead of 3-5 keys' statistics."""
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
_GENERATION_ROW = "SELECT NULL, NULL, value FROM meta WHERE key='stats_generation'"  # (level NULL: not a key's)
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
            return self._stats_read(keys)[0]
        state = self._stats_seen
        if state is not None and all((level, key) in state[1] for level, key in keys.items()):
            rows = self._read(_GENERATION_SQL)  # all remembered: served while the generation stays
            if rows and rows[0][0] == state[0]:
                return self._stats_served(keys, state[1])
        out, generation, seen = self._stats_read(keys)  # the statistics and their generation, in one snapshot
        if generation is None:  # (no such row: not counted)
            return out
        state = self._stats_seen
        if state is None or state[0] != generation or len(state[1]) >= STATS_SEEN_MAX:
            state = self._stats_seen = (generation, {})  # (one tuple, replaced whole)
        state[1].update(seen)
        return self._stats_served(keys, seen)

    def _stats_served(self, keys: Mapping[KeyLevel, str], seen: dict) -> dict[KeyLevel, ClassStats]:
        """``keys``' statistics remembered in ``seen``, their warnings logged as at each read."""
        out = {}
        for level, key in keys.items():
            hit = seen[(level, key)]
            if hit[1]:
                _bounded(self.where, level, key, hit[1])
            if hit[0] is not None:
                out[level] = hit[0]
        return out

    def _stats_read(self, keys: Mapping[KeyLevel, str]) -> tuple[dict[KeyLevel, ClassStats], str | None, dict]:
        """(the statistics of ``keys``, the history's stats_generation in the same snapshot (None:
        not counted; then out-of-range statistics are warned of here), each key's read: (statistics
        or None, what was out of range))."""
        where = " OR ".join("(level=? AND key=?)" for _ in keys)
        args = [x for level, key in keys.items() for x in (level.value, key)]
        sql = f"SELECT level, key, stats_json FROM class_stats WHERE {where}"
        rows = self._read(f"{sql} UNION ALL {_GENERATION_ROW}" if self._stats_counted else sql, args)
        out, generation, seen = {}, None, {}
        for level, key, text in rows:
            if level is None:
                generation = text
                continue
            level = _LEVEL.get(level) or KeyLevel(level)
            out[level], bad = seen[(level, key)] = self._checked(text)
        for level, key in keys.items():
            seen.setdefault((level, key), _ABSENT)
        if generation is None:
            for (level, key), (_, bad) in seen.items():
                if bad:
                    _bounded(self.where, level, key, bad)
        return out, generation, seen

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
