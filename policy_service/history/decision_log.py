"""Decisions reach the history through a journal: nothing slurmctld was told is lost.

Admit appends the decision to a journal file beside the history (``<db_path>.journal``, 0600)
before it answers: one ``write`` on an O_APPEND descriptor, which the kernel keeps through a
crash of the service (``service.journal_fsync`` adds an ``fdatasync`` for power loss, at the cost
of a disk flush per Admit). A writer thread then puts each decision into SQLite, retrying while
the database is locked, full or failing, and empties the journal once everything in it is
committed. At start, whatever the journal still holds is committed first. So Admit waits for the
page cache, never for SQLite, and a decision whose record reached Slurm survives ``kill -9``
whatever the writer was doing. A decision that cannot be journaled (the disk is full) is refused:
the job then passes unchanged (fail-open) and no record names a decision that was never kept.

Records are framed as history/journal_records.py says (length, CRC-32, JSON). A torn last record
(a crash inside ``write``) fails its length or CRC and is dropped: its Admit never got an answer,
so Slurm never held it.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

from policy_service.history.db import retryable
from policy_service.history.journal_records import DecisionRecord, read_journal
from policy_service.history.lease import NotWriter

log = logging.getLogger("swapaware.decisions")

RETRY_MIN_S, RETRY_MAX_S = 0.05, 5.0
CLOSE_WAIT_S = 10.0  # close(): how long the writer may go on trying to commit what waits (then it stays journaled)
WRITE_INTERVAL_S = 0.05  # how often the writer looks for decisions to commit while they come in
IDLE_WAIT_S = 5.0  # the longest an idle writer sleeps unwoken (record() wakes it at once)
WRITE_BATCH = 256  # decisions per history transaction at most


class JournalError(Exception):
    """A decision could not be made durable (disk full, journal unwritable, writer backlog full)."""


def _cut_last(fd: int, written: int) -> None:
    """Take the ``written`` bytes just appended off the journal: an O_APPEND write leaves the
    descriptor's offset at the end of what it wrote (appends and cuts are made under one lock)."""
    try:
        os.ftruncate(fd, os.lseek(fd, 0, os.SEEK_CUR) - written)
    except OSError:
        pass


def backoff(attempt: int) -> float:
    """Seconds before retry ``attempt`` (1, 2, ...) of a failed write: doubling, bounded."""
    return min(RETRY_MAX_S, RETRY_MIN_S * (2 ** max(0, attempt - 1)))


class DecisionLog:
    """Journal + writer thread. ``write``: puts records into the history in one transaction (raises
    on failure, and then has put none)."""

    def __init__(self, path: Path | None, write: Callable[[list[DecisionRecord]], None], fsync: bool = False,
                 backlog: int = 10_000):
        self.path, self._write, self._fsync = path, write, fsync
        self._lock = threading.Lock()  # journal append + enqueue, and the journal's truncation
        self._queue: queue.Queue = queue.Queue(maxsize=backlog)
        self._wake = threading.Event()  # flush() and close(): commit now; record() when the writer sleeps idle
        self._idle = False  # the writer found nothing to commit and waits to be woken (not polling)
        self._fd: int | None = None
        self.failing = ""  # why the last history write failed ("" while they succeed)
        self._carry: list[DecisionRecord] = []  # the previous run's, not taken at start (retryable)
        self._closing = threading.Event()
        self._nudge = threading.Event()  # retry_now() and close(): end a retry's wait
        self._gave_up = False  # closed while not the writer: what waits stays in the journal
        self._stop_trying = threading.Event()  # close() waited CLOSE_WAIT_S: the history is unreachable
        if path is not None:
            self._recover()
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._thread = threading.Thread(target=self._loop, name="decision-writer", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ start
    def _recover(self) -> None:
        """Commit what a previous run journaled and did not commit, then empty the journal."""
        assert self.path is not None
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return
        records, torn = read_journal(data)
        if records:
            try:
                self._write(records)  # a failure here stops the start: the journal stays as it is
            except Exception as exc:
                if not retryable(exc):
                    raise
                # not the writer yet (NotWriter), or the database is away: the writer thread
                # commits them first, once it can; the journal keeps them until then
                log.warning("decision journal %s: %d decision(s) of the previous run wait for the history (%s)",
                            self.path, len(records), exc)
                self._carry = records
                return
        if records or torn:
            log.warning("decision journal %s: %d decision(s) of the previous run committed to the history%s",
                        self.path, len(records), f"; {torn} torn byte(s) at its end dropped" if torn else "")
        os.truncate(self.path, 0)

    # ------------------------------------------------------------------ Admit's path
    def record(self, rec: DecisionRecord, note: dict | str | None = None, data: bytes | None = None) -> None:
        """Durable (journaled) before this returns; in the history soon after. Raises JournalError.
        ``note``: logged as ``decision {json}`` by the writer once the record is in the history
        (formatting and writing a log line cost Admit ~40 us; the writer runs between Admits);
        a str: its JSON, already made (NoteText).
        ``data``: ``rec.encode()``, already made (RecordText)."""
        data = data if data is not None else rec.encode()
        with self._lock:
            self._journal(data, f"decision {rec.decision_id}")
            if not self._enqueue([(rec, note)]):
                self._cut(len(data))  # refused: no restart may commit it
                raise JournalError(f"{self._queue.maxsize} decisions wait for the history ({self.failing or 'slow'}); "
                                   "refusing more until it catches up")

    def record_many(self, items: list[tuple[DecisionRecord, dict | str | None]]) -> int:
        """``record`` of several decisions with one journal write (the catch-up records what a
        queue poll found at once: a write per decision cost it a system call each). Returns how
        many, from the first, are on their way to the history: fewer than all only when the
        writer's backlog filled meanwhile (the rest are taken out of the journal again, as
        ``record`` takes out what it refuses; the caller offers them again). Raises JournalError
        when none could be journaled."""
        if not items:
            return 0
        encoded = [rec.encode() for rec, _ in items]
        with self._lock:
            self._journal(b"".join(encoded), f"{len(items)} decision(s) from {items[0][0].decision_id}")
            n = self._enqueue(items)
            if n < len(items):
                self._cut(sum(len(e) for e in encoded[n:]))  # not taken: out of the journal too
            return n

    def _journal(self, data: bytes, what: str) -> None:
        """Append ``data`` to the journal in one write (under _lock); raises JournalError."""
        if self._fd is None:
            return
        written = 0  # (a write that fails wrote nothing)
        try:
            written = os.write(self._fd, data)
            if written != len(data):
                raise OSError(f"short write ({written} of {len(data)} bytes: the disk is full)")
            if self._fsync:
                os.fdatasync(self._fd)
        except OSError as exc:
            if written:  # a full disk may have taken part of it, or it is not durable: cut it
                _cut_last(self._fd, written)
            raise JournalError(f"cannot journal {what}: {exc}") from None

    def _cut(self, size: int) -> None:
        """Take the last ``size`` bytes appended (under _lock) off the journal again."""
        if self._fd is not None and size:
            _cut_last(self._fd, size)

    def _enqueue(self, items: list[tuple[DecisionRecord, dict | str | None]]) -> int:
        """Hand ``items`` to the writer (under _lock); how many it took before its backlog was full."""
        n = 0
        for item in items:
            try:
                self._queue.put_nowait(item)
            except queue.Full:
                break
            n += 1
        if n and self._idle:  # the first decision after a quiet spell wakes the writer; in a burst it polls
            self._idle = False
            self._wake.set()
        return n

    # ------------------------------------------------------------------ the writer
    def _loop(self) -> None:
        # The writer looks for work every WRITE_INTERVAL_S instead of being woken by each Admit:
        # a wake-up per decision put this thread beside Admit's own, contending for the GIL while
        # slurmctld waited for the answer. flush() and close() wake it at once.
        if self._carry:
            if not self._commit(self._carry):
                return
            self._carry = []
            self._maybe_truncate()
        found = True
        while True:
            if found:
                self._wake.wait(WRITE_INTERVAL_S)
            else:
                # Nothing came in the last interval: sleep until record() (or flush, close) wakes it,
                # not every WRITE_INTERVAL_S (20 wake-ups a second of an idle service). _idle is set
                # before the queue is looked at again: a record() in between either is seen here or
                # sees _idle and wakes it.
                self._idle = True
                if self._queue.empty():
                    self._wake.wait(IDLE_WAIT_S)
                self._idle = False
            self._wake.clear()
            found = False
            while True:
                batch = []
                while len(batch) < WRITE_BATCH:  # what waits goes into one transaction
                    try:
                        batch.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
                found = found or bool(batch)
                items = [r for r in batch if r is not None]
                records = [rec for rec, _ in items]
                if records and not self._commit(records):  # closed while standby: they stay journaled
                    for _ in batch:
                        self._queue.task_done()
                    return
                if records:
                    for _, note in items:
                        if note is not None:
                            log.info("decision %s", note if type(note) is str else json.dumps(note, sort_keys=True))
                for _ in batch:
                    self._queue.task_done()
                if len(records) < len(batch):  # close() asked to stop
                    return
                if records:
                    self._maybe_truncate()
                if len(batch) < WRITE_BATCH:
                    break

    def _commit(self, records: list[DecisionRecord]) -> bool:
        """Put ``records`` into the history, retrying until it takes them (they stay journaled).
        False: closed while this service is not the writer (NotWriter): they stay in the journal."""
        attempt = 0
        while True:
            try:
                self._write(records)
                break
            except Exception as exc:  # locked, full, gone, not the writer: keep them and try again
                if self._closing.is_set() and (isinstance(exc, NotWriter) or self._stop_trying.is_set()):
                    self._gave_up = True
                    with self._queue.all_tasks_done:
                        self._queue.all_tasks_done.notify_all()
                    return False
                attempt += 1
                why = f"{type(exc).__name__}: {exc}"
                if why != self.failing:
                    (log.info if isinstance(exc, NotWriter) else log.error)(
                        "cannot record %d decision(s) in the history (%s, first %s); kept in the journal, retrying",
                        len(records), why, records[0].decision_id)
                self.failing = why
                if self._closing.is_set():
                    self._stop_trying.wait(backoff(attempt))  # close() cuts it short once it stops waiting
                else:
                    self._nudge.wait(backoff(attempt))  # close() and retry_now() cut the wait short
                    self._nudge.clear()
        if self.failing:
            log.warning("decisions are recorded in the history again")
            self.failing = ""
        return True

    def _maybe_truncate(self) -> None:
        """Empty the journal once every record in it is in the history."""
        if self._fd is None or self._gave_up or self._carry:
            return
        with self._lock:
            if self._queue.unfinished_tasks == 0:
                os.ftruncate(self._fd, 0)

    def pending(self) -> int:
        return self._queue.unfinished_tasks + len(self._carry)

    def retry_now(self) -> None:
        """Try a refused write again now, not at the end of its back-off (the service just became
        the writer: what its journal holds reaches the history at once)."""
        self._nudge.set()
        self._wake.set()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every decision recorded so far is in the history (or, once closing, until
        the history refused them as this service is not the writer), at most ``timeout_s`` (None:
        however long it takes). False: some still wait."""
        self._wake.set()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._queue.all_tasks_done:
            while (self._queue.unfinished_tasks or self._carry) and not self._gave_up:
                if deadline is not None and time.monotonic() >= deadline:
                    return False
                self._queue.all_tasks_done.wait(0.1)
        return True

    def close(self) -> None:
        """Commit what waits and stop; a service that is not the writer stops at once, leaving what
        waits in the journal (read back at its next start)."""
        self._closing.set()
        self._nudge.set()
        if not self.flush(CLOSE_WAIT_S):
            # the history cannot be reached: stop trying; what waits stays in the journal, and the
            # next start commits it (as after a crash)
            log.warning("decision journal %s: the history took no decision for %.0f s while stopping (%s); "
                        "%d decision(s) stay in the journal for the next start", self.path, CLOSE_WAIT_S,
                        self.failing or "slow", self.pending())
            self._stop_trying.set()
            self.flush(RETRY_MAX_S + 1.0)
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass
        self._wake.set()
        self._thread.join(5)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def records(self) -> Iterator[DecisionRecord]:
        """What the journal holds now (for tests and `swapaware doctor`)."""
        if self.path is None:
            return iter(())
        return iter(read_journal(self.path.read_bytes())[0])
