"""The statistics a history store hands out for a decision are its history's as it stands: the
reads remembered per key (history/class_stats.py) are never served once class_stats changed,
whoever changed it (this store, another store on the same history, or any other writer)."""
from __future__ import annotations

import json
import sqlite3

from policy_service.core.types import ClassStats, KeyLevel
from policy_service.history.store import HistoryStore, ObservationRow

KEYS = {KeyLevel.CLASS: "c1", KeyLevel.USER_NAME: "alice", KeyLevel.ACCOUNT: "proj"}


def _obs(n: int) -> ObservationRow:
    return ObservationRow(f"e{n}", n, "", "n1", (0,), 1.0, 2.0, 1.0, 0, 1, False, 0, False, "none", 2.0, f"i/{n}", 0)


def _finish(store, n: int, keys=KEYS, samples: int = 1) -> None:
    store.record_finish(_obs(n), keys, lambda level, s: ClassStats(samples=s.samples + samples))


def _samples(store, keys=KEYS) -> dict[str, int]:
    return {level.value: s.samples for level, s in store.stats(keys).items()}


def test_a_change_made_by_this_store_is_read_at_once(history_backend, tmp_path):
    store = history_backend.open(tmp_path / "history.sqlite3", accept_empty=True)
    try:
        assert _samples(store) == {}
        _finish(store, 1, {KeyLevel.USER_NAME: "alice"})
        assert _samples(store) == {"user_name": 1}  # a key remembered as absent is read again
        _finish(store, 2)
        assert _samples(store) == {"class": 1, "user_name": 2, "account": 1}
        assert _samples(store) == {"class": 1, "user_name": 2, "account": 1}
        _finish(store, 3, {KeyLevel.ACCOUNT: "proj"}, samples=5)
        assert _samples(store) == {"class": 1, "user_name": 2, "account": 6}
    finally:
        store.close()


def test_a_change_made_by_another_store_is_read_at_once(history_backend, tmp_path):
    db = tmp_path / "history.sqlite3"
    a = history_backend.open(db, accept_empty=True)
    b = history_backend.open(db, accept_empty=True)
    try:
        _finish(a, 1)
        assert _samples(b) == {"class": 1, "user_name": 1, "account": 1}
        _finish(a, 2, {KeyLevel.CLASS: "c1"})
        assert _samples(b) == {"class": 2, "user_name": 1, "account": 1}
        _finish(a, 3, {KeyLevel.CLASS: "c2"})
        assert _samples(b, {KeyLevel.CLASS: "c2"}) == {"class": 1}
        assert _samples(b) == {"class": 2, "user_name": 1, "account": 1}
    finally:
        a.close()
        b.close()


def test_any_writer_of_the_sqlite_file_is_seen(tmp_path):
    """Statistics changed by another program on the file (an update, a delete, an insert with
    REPLACE), not through a store: the generation its triggers count tells the store."""
    db = tmp_path / "history.sqlite3"
    store = HistoryStore(db, accept_empty=True)
    try:
        _finish(store, 1)
        assert _samples(store) == {"class": 1, "user_name": 1, "account": 1}
        other = sqlite3.connect(db, isolation_level=None)
        other.execute("UPDATE class_stats SET stats_json=? WHERE level='class'", (json.dumps({"samples": 7}),))
        assert _samples(store) == {"class": 7, "user_name": 1, "account": 1}
        other.execute("DELETE FROM class_stats WHERE level='account'")
        assert _samples(store) == {"class": 7, "user_name": 1}
        other.execute("INSERT OR REPLACE INTO class_stats VALUES ('account', 'proj', ?, 0)", (json.dumps({"samples": 4}),))
        assert _samples(store) == {"class": 7, "user_name": 1, "account": 4}
        other.close()
    finally:
        store.close()


def test_remembered_statistics_spare_the_reads_of_their_keys(tmp_path):
    store = HistoryStore(tmp_path / "history.sqlite3", accept_empty=True)
    try:
        _finish(store, 1)
        first = store.stats(KEYS)
        reads = []
        read = store._read
        store._read = lambda sql, args=(): reads.append(sql) or read(sql, args)
        again = store.stats(KEYS)
        assert all(again[level] is first[level] for level in KEYS)  # the same values (Admit's memo compares them)
        assert not any("class_stats" in sql for sql in reads), reads
        _finish(store, 2, {KeyLevel.USER_NAME: "alice"})
        assert store.stats(KEYS)[KeyLevel.USER_NAME].samples == 2
        assert any("class_stats" in sql for sql in reads)
    finally:
        store.close()


def test_out_of_range_statistics_are_warned_of_at_each_read(tmp_path, caplog):
    db = tmp_path / "history.sqlite3"
    store = HistoryStore(db, accept_empty=True)
    try:
        _finish(store, 1)
        other = sqlite3.connect(db, isolation_level=None)
        other.execute("UPDATE class_stats SET stats_json='not json' WHERE level='class'")
        other.close()
        for _ in range(2):
            caplog.clear()
            assert store.stats(KEYS)[KeyLevel.CLASS].samples == 0
            assert "statistics of class key c1 out of range (stats_json)" in caplog.text
    finally:
        store.close()
