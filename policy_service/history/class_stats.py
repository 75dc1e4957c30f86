"""The per-key statistics ``HistoryStore`` reads for a decision, each key's stored text checked
once and remembered (the statistics are written with a run's observation: history/runs.py)."""
from __future__ import annotations

import logging
from typing import Mapping

from policy_service.core.types import ClassStats, KeyLevel
from policy_service.history.schema import checked_stats

log = logging.getLogger("policy_service.history.store")
# What HistoryStore remembers of the statistics it read (their stored text, checked): a few MB
# (a class key's text is ~0.5 KB, a wide key's up to ~10 KB with 64 users' figures).
STATS_MEMO_CHARS = 8 << 20


class ClassStatsReads:
    """``HistoryStore``'s statistics reads (uses its where, _read and the memo, _stats_memo,
    _stats_memo_chars and _stats_memo_lock, that its __init__ makes)."""

    def stats(self, keys: Mapping[KeyLevel, str]) -> dict[KeyLevel, ClassStats]:
        if not keys:
            return {}
        where = " OR ".join("(level=? AND key=?)" for _ in keys)
        args = [x for level, key in keys.items() for x in (level.value, key)]
        rows = self._read(f"SELECT level, key, stats_json FROM class_stats WHERE {where}", args)
        out = {}
        for level, key, text in rows:
            out[KeyLevel(level)], bad = self._checked(text)
            if bad:  # written by other means than the service: bounded, never believed as stored
                log.warning("history %s: statistics of %s key %s out of range (%s): brought within bounds",
                            self.where, level, key, ", ".join(bad))
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
