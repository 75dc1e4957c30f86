"""DecisionLog.record_many: the decisions the catch-up learned from one queue poll journaled in one
write, then handed to the history's writer; a write that fails leaves none of them in the journal,
and a backlog that fills meanwhile takes the first and cuts the rest out of the journal again (the
caller offers them again), as record() cuts a decision it refuses: a restart commits no decision
that was refused."""
from __future__ import annotations

import threading

import pytest

from policy_service.history import decision_log
from policy_service.history.decision_log import DecisionLog, JournalError

from tests.adapter.history.test_journal_cut import _held, _rec


class Writer:
    """The history's write, held until released: ``entered`` once the writer thread is inside it."""

    def __init__(self):
        self.entered, self.release, self.written = threading.Event(), threading.Event(), []

    def __call__(self, records):
        self.entered.set()
        self.release.wait()
        self.written.extend(r.decision_id for r in records)


@pytest.fixture
def held(tmp_path):
    writer = Writer()
    path = tmp_path / "h.sqlite3.journal"
    log = DecisionLog(path, writer, backlog=3)
    yield log, path, writer
    writer.release.set()
    log.close()


def test_a_batch_is_journaled_in_one_write_and_reaches_the_history(held, monkeypatch):
    log, path, writer = held
    writes = []
    write = decision_log.os.write
    monkeypatch.setattr(decision_log.os, "write", lambda fd, data: writes.append(len(data)) or write(fd, data))
    assert log.record_many([(_rec(i), None) for i in (1, 2, 3)]) == 3
    assert len(writes) == 1 and _held(path) == (["d1", "d2", "d3"], 0)
    assert log.record_many([]) == 0 and len(writes) == 1  # nothing to write: no write
    writer.release.set()
    assert log.flush(10)
    assert writer.written == ["d1", "d2", "d3"]


def test_a_failed_write_leaves_nothing_of_the_batch(held, monkeypatch):
    log, path, writer = held
    log.record(_rec(1))
    write = decision_log.os.write
    monkeypatch.setattr(decision_log.os, "write", lambda fd, data: write(fd, data[:len(data) // 2]))
    with pytest.raises(JournalError, match="short write"):
        log.record_many([(_rec(i), None) for i in (2, 3)])
    assert _held(path) == (["d1"], 0)  # the records before it whole, none of the batch's
    monkeypatch.undo()
    writer.release.set()
    assert log.flush(10) and writer.written == ["d1"]  # none of the batch was handed to the writer


def test_a_full_backlog_takes_the_first_and_cuts_the_rest_out_of_the_journal(held):
    log, path, writer = held
    log.record(_rec(0))
    assert writer.entered.wait(10)  # the writer holds d0, its backlog (3) is empty
    assert log.record_many([(_rec(i), None) for i in (1, 2, 3, 4, 5)]) == 3
    assert _held(path) == (["d0", "d1", "d2", "d3"], 0)
    with pytest.raises(JournalError, match="wait for the history"):
        log.record(_rec(6))  # record() refuses one, and cuts it out as well
    assert _held(path) == (["d0", "d1", "d2", "d3"], 0)
    writer.release.set()
    assert log.flush(10)
    assert writer.written == ["d0", "d1", "d2", "d3"]
    assert log.record_many([(_rec(i), None) for i in (4, 5)]) == 2  # offered again, taken
    assert log.flush(10) and writer.written[4:] == ["d4", "d5"]
