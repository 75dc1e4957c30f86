"""A decision that could not be made durable leaves nothing of itself in the journal: a short
write (a full disk) or a failed fdatasync cuts what it appended, and the records before it stay
whole (history/decision_log.py: the cut is made from the descriptor's offset after the append)."""
from __future__ import annotations

import threading

import pytest

from policy_service.history import decision_log
from policy_service.history.decision_log import DecisionLog, JournalError
from policy_service.history.journal_records import DecisionRecord, read_journal


def _rec(i: int) -> DecisionRecord:
    return DecisionRecord(decision_id=f"d{i}", decided_at=1000.0 + i, job_class="c", user="alice", account="proj",
                          partition="gpu", job_name="train", action="share", shards=2, model_version="m",
                          keys={"class": "c"}, facts_pb=b"\x00facts" * i, decision_pb=b"\x01")


@pytest.fixture
def journal(tmp_path):
    release = threading.Event()
    path = tmp_path / "h.sqlite3.journal"
    log = DecisionLog(path, lambda records: release.wait(), fsync=True)  # nothing leaves the journal meanwhile
    yield log, path
    release.set()
    log.close()


def _held(path) -> tuple[list[str], int]:
    records, torn = read_journal(path.read_bytes())
    return [r.decision_id for r in records], torn


def test_a_failed_fdatasync_cuts_the_record_it_appended(journal, monkeypatch):
    log, path = journal
    log.record(_rec(1))
    log.record(_rec(2))

    def fails(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(decision_log.os, "fdatasync", fails)
    with pytest.raises(JournalError, match="Input/output error"):
        log.record(_rec(3))
    assert _held(path) == (["d1", "d2"], 0)
    monkeypatch.undo()
    log.record(_rec(4))
    assert _held(path) == (["d1", "d2", "d4"], 0)


def test_a_short_write_cuts_what_it_wrote(journal, monkeypatch):
    log, path = journal
    log.record(_rec(1))
    write = decision_log.os.write
    monkeypatch.setattr(decision_log.os, "write", lambda fd, data: write(fd, data[:len(data) // 2]))
    with pytest.raises(JournalError, match="short write"):
        log.record(_rec(2))
    assert _held(path) == (["d1"], 0)
    monkeypatch.undo()
    log.record(_rec(3))
    assert _held(path) == (["d1", "d3"], 0)


def test_after_the_journal_was_emptied_a_cut_still_takes_only_its_own_record(journal, monkeypatch):
    log, path = journal
    log.record(_rec(1))
    with log._lock:
        decision_log.os.ftruncate(log._fd, 0)  # as _maybe_truncate empties it once all is committed
    log.record(_rec(2))
    monkeypatch.setattr(decision_log.os, "fdatasync", lambda fd: (_ for _ in ()).throw(OSError(28, "No space")))
    with pytest.raises(JournalError):
        log.record(_rec(3))
    assert _held(path) == (["d2"], 0)
