"""The admission table's files (admission/publish.py builds what they hold): the class
table's entries dropped before an observation of their class is recorded (``learning``), the table
removed where it cannot be looked through, and the gate file rewritten after each queue poll. Files
are written atomically (temporary file in the same directory, fsync, rename), mode 0640, group
SlurmUser's (they name every published class's user, job name and comment).

``TableFiles`` is mixed into AdmissionPublisher, whose __init__ sets what it reads (handler, cfg,
clock, table, gate, reader_gid, _file_lock, _written, _body, _gate_lock, _gate_written, _gate_error, _stop).
"""
from __future__ import annotations

import contextlib
import json
import logging
import socket
from typing import Iterator

from policy_service.atomic_file import write_atomically
from policy_service.config import PolicyMode
from policy_service.core import admission, admission_format

log = logging.getLogger("swapaware.admission")

TABLE_MODE = 0o640  # the table and gate files: the service's user and slurmctld's group


def body_of(built: list) -> admission_format.Body:
    """The class table's body (core/admission_format.table_body) of the keys as built."""
    return admission_format.table_body(
        (known.digest, key, known.entry, (part.partition("\t")[::2] for part in known.text.split("\n")))
        for key, known in built)


class TableFiles:
    """AdmissionPublisher's writes of the table and gate files outside a build."""

    def _write_table(self, doc: dict, built: list) -> int:
        """Under _file_lock: the class table file of ``built`` (key, Known) under ``doc``'s header;
        the bytes written. The body is rendered again for another list than the one last written,
        and kept: a refresh (publish.py) writes the same list, only the header's times new. What it
        keeps is the file's size again (about 100 bytes a key)."""
        body = self._body[1] if self._body is not None and self._body[0] is built else body_of(built)
        size = write_atomically(self.table, admission_format.table_pieces(doc, body), TABLE_MODE, self.reader_gid)
        self._written, self._body = (doc, built), (built, body)
        return size

    def on_queue_poll(self, pending, state) -> None:
        """QueueMonitor.on_poll: the gate file follows each new snapshot at once."""
        if self.handler.mode is PolicyMode.OFF:
            return
        try:
            self.write_gate()
        except OSError as exc:  # never in the way of what follows the poll (catch-up, re-decisions)
            if str(exc) != self._gate_error:
                log.error("admission gate file not written (the plugin takes the queue state as unknown once the "
                          "last one expires): %s", exc)
            self._gate_error = str(exc)
        else:
            self._gate_error = ""

    @contextlib.contextmanager
    def learning(self, keys: tuple[str, ...]) -> Iterator[None]:
        """EventApplier.learning: an observation is about to be folded into ``keys``. Before it is
        recorded, the written table loses every entry whose decisions read one of them (rewritten,
        same version: the others' templates stand), and no build writes the file until it is counted
        in ``handler.learned`` (a build then leaves out what it decided before): an observation a
        reader of the history can see never has its classes answered from before it. Those classes
        take the round trip until the next build. Costs one file write per class per build at most
        (a dropped entry is not in the file for the next observation to drop)."""
        with self._file_lock:
            self._drop(set(keys))
            yield

    def _drop(self, keys: set) -> None:
        """Under _file_lock. A table this process did not write (a previous process's, left in
        place across a restart, or the last writer's) cannot be looked through: it is removed, and
        jobs take the round trip until the next build."""
        if self._written is None:
            if keys and self.table.exists():
                self._unlink_table()
                log.info("admission table %s removed until this service's next build: an observation arrived "
                         "before it published one", self.table)
            return
        doc, built = self._written
        kept = [(key, known) for key, known in built if keys.isdisjoint(known.deps)]
        if len(kept) == len(built):
            return
        try:
            self._write_table(doc, kept)
        except OSError as exc:  # the file keeps the entries: remove it rather than answer stale
            log.error("admission table: entries whose class learned could not be dropped (%s): the table is removed "
                      "until the next build", exc)
            self._unlink_table()
            return
        log.info("admission table: %d entr%s dropped until the next build (an observation of their class)",
                 len(built) - len(kept), "y" if len(built) - len(kept) == 1 else "ies")

    def _unlink_table(self) -> None:
        """Under _file_lock."""
        try:
            self.table.unlink()
        except FileNotFoundError:
            pass
        self._written = self._body = None

    # ------------------------------------------------------------------ the gate
    def write_gate(self) -> bool:
        """Rewrite the gate file when the queue's state or snapshot changed; True when written."""
        with self._gate_lock:
            return False if self._stop.is_set() else self._write_gate()

    def _write_gate(self) -> bool:
        now = self.clock()
        snap = self.handler.queue.snapshot() if self.handler.queue is not None else None
        doc = admission.gate_file(snap, self.cfg, now, rpc_only=self.handler.shards_refused(snap),
                                  controller=socket.gethostname() if self.cfg.ha.enabled
                                  and self.handler.dialect.takeover_zero_shards else "")
        seen = (doc["valid_until"], doc["other"], tuple(sorted(doc["views"].items())), doc.get("rpc_only"),
                doc.get("controller"))
        last = self._gate_written
        if (last is not None and abs(seen[0] - last[0]) < 0.01 and seen[1:] == last[1:]  # the same snapshot
                and self.gate.exists()):
            return False
        write_atomically(self.gate, json.dumps(doc, separators=(",", ":")).encode(), TABLE_MODE, self.reader_gid)
        self._gate_written = seen
        return True
