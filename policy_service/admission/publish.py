"""Publishes the admission table: the class table and the queue gate (core/admission.py).

A background thread, never on Admit's path:
  * the keys: the facts of the decisions recorded in the last admission.horizon_s (read from the
    history by rowid, only new rows after the first pass), newest first, at most max_entries,
    written in entry order;
  * each key is decided through the handler's own path (PolicyHandler._decide) once per gate state
    some queue reaches, with a queue snapshot in that state, then policy.mode is applied as Admit
    applies it; a key whose history keys learned nothing since, under the same mode, enforcement
    and partitions, keeps its decisions;
  * rebuilt at most every refresh_s (longer for a costly table: _build_every), when something it
    depends on changed (observations learned, a class decided that the table does not hold, mode,
    nodes' enforcement, partitions; not the decisions of classes it holds, as every table hit's),
    at once when the mode changed, and re-published at least every valid_s / 2 (the same version
    when nothing it holds changed; when nothing it depends on changed either, the last build's
    file again under a new valid_until, no key decided again: ``_refresh``);
  * an observation about to be folded into history keys first drops every entry of the written
    file whose decisions read one of them (``learning``, the file rewritten without them), and no
    build writes until it is recorded and counted (a build leaves out entries learned since they
    were decided): those classes take the Admit round trip until the next build decides them
    again, and the table never answers a decision made before an observation the history holds;
  * the gate file is rewritten after each queue poll (QueueMonitor.on_poll, ``on_queue_poll``),
    and checked by the thread's ticks (queue_poll_s / 4, at most 1 s);
  * each version's templates go to the TableArchive (catch-up records table-made decisions from it);
  * policy.mode = off: the class table is removed (every job takes the Admit round trip).
Files are written atomically (temporary file in the same directory, fsync, rename), mode 0640,
group SlurmUser's (they name every published class's user, job name and comment).

This module holds the thread, when a build is due, the build and the archive; the keys and their
entries are admission/entries.py's, the files' writes outside a build (an observation's
drop, the gate after a queue poll) admission/files.py's.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from policy_service.admission.archive import TableArchive
from policy_service.admission.entries import EntryBuilding, Known
from policy_service.admission.files import TableFiles
from policy_service.config import Config, PolicyMode
from policy_service.core import admission

if TYPE_CHECKING:  # an adapter imports nothing of the handler but its type
    from policy_service.serving.handler import PolicyHandler

log = logging.getLogger("swapaware.admission")
# Builds take at most this share of the publisher's time while changes keep coming (a table of
# 10,000 keys takes about 0.2 s of CPU a build: one every 10 s, where a small table's is due every
# refresh_s) ...
BUILD_SHARE = 0.02
# ... but a change waits at most this long for its build (or refresh_s, where that is longer).
BUILD_WAIT_MAX_S = 30.0


@dataclasses.dataclass(frozen=True)
class Publication:
    version: str
    entries: int
    templates: int
    bytes: int
    built_s: float
    reused: bool  # the previous version re-published (nothing it holds changed)


class AdmissionPublisher(EntryBuilding, TableFiles):
    def __init__(self, handler: PolicyHandler, cfg: Config, archive: TableArchive,
                 clock: Callable[[], float] = time.time, reader_gid: int | None = None):
        self.handler, self.cfg, self.archive, self.clock = handler, cfg, archive, clock
        # The files name every published class's user, job name and comment: readable by their
        # owner and slurmctld's group (SlurmUser's) alone, never by every local user (0640).
        self.reader_gid = reader_gid
        self.table = Path(cfg.table_path)
        self.gate = Path(f"{cfg.table_path}.gate")
        self._facts: dict[str, tuple[float, bytes]] = {}  # key -> (newest decided_at, facts_pb)
        self._last_rowid = 0
        self._db = None  # the history reader kept between ticks (entries.py _reader), and the file it reads
        self._db_of: tuple | None = None
        self._keys_epoch = 0  # changes of the keys to publish (entries.py _absorb)
        self._oldest_at = float("inf")  # no key in _facts was decided last before this
        self._numbers: dict[str, int] = {}  # key -> entry number, stable while the process runs
        # key -> Known as a plain tuple: the collector stops tracking a tuple of atoms (it never
        # stops tracking a NamedTuple's instance)
        self._known: dict[str, tuple] = {}
        self._left_out = 0  # keys a build could not decide (a refusal, an error): decided again at the next
        self._context: tuple | None = None  # (mode, enforcement, partitions) of the last build
        self._context_number = 0
        self._published: Publication | None = None
        self._published_at = 0.0
        self._content = b""  # digest of what the published version holds
        self._inputs: tuple | None = None  # what the last build depended on
        self._built_at = float("-inf")
        self._build_cpu = 0.0  # the last build's CPU time (this thread's), which spaces the next (_build_every)
        self._gate_written: tuple | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.RLock()  # one build at a time (the thread, a test)
        # the class table file: held while it is written, by a build or by ``learning`` (which
        # never waits for a build to decide its keys, only for a write under way)
        self._file_lock = threading.Lock()
        self._written: tuple | None = None  # (doc, [(key, Known)]) of the file as last written
        self._body: tuple | None = None  # (that list, its rendered body): files.py _write_table
        self._complete = False  # the last build decided every key it read (none left out for an error)
        # the gate file: written after each queue poll by the monitor's thread, which never waits
        # for a build
        self._gate_lock = threading.Lock()
        self._gate_error = ""  # the last gate write's error, logged once
        self._claimed = False  # [ha]: became the writer since its last publication (became_writer)
        self.last: Publication | None = None

    # ------------------------------------------------------------------ the thread
    def start(self) -> "AdmissionPublisher":
        self._thread = threading.Thread(target=self._loop, name="admission-publish", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Publishes nothing more: no tick, and no gate file after the queue's polls either (a gate
        write under way when stop is called ends before it returns)."""
        self._stop.set()
        with self._gate_lock:
            pass
        if self._thread is not None:
            self._thread.join(30)
        with self._lock:
            self._close_reader()

    def _loop(self) -> None:
        every = min(1.0, self.cfg.policy.queue_poll_s / 4)
        failing = ""
        while not self._stop.is_set():
            try:
                self.tick()
                if failing:
                    log.warning("admission table published again")
                failing = ""
            except Exception as exc:  # never let the table take the service down: the next tick retries
                why = f"{type(exc).__name__}: {exc}"
                if why != failing:  # one log line per distinct failure, not one per tick
                    log.exception("admission table not published (retried every %.1f s)", every)
                failing = why
            self._stop.wait(every)

    def became_writer(self, writer: bool) -> None:
        """RoleKeeper.on_change ([ha] enabled): a service that becomes the writer publishes at its
        next tick, whatever it published before: since then the files may hold the last writer's
        table and gate (with a SQLite history this service's archive lacks their versions; a
        MariaDB history's archive is shared, but the gate names the last writer's controller)."""
        if writer:
            self._claimed = True
            with self._gate_lock:
                self._gate_written = None
        with self._file_lock:  # the file may be the other writer's since: not ours to rewrite
            self._written = None

    def tick(self) -> None:
        """One pass: rebuild the class table when due, rewrite the gate when the queue changed."""
        with self._lock:
            if not self._tick():
                return
        self.write_gate()

    def _tick(self) -> bool:
        """False when nothing is published (policy.mode = off)."""
        now = self.clock()
        inputs = self._depends()
        mode = inputs[0]
        if mode is PolicyMode.OFF:
            if self._published is not None or self.table.exists():
                self._remove("policy.mode = off")
            return False
        why = self._why(inputs, now)
        if why and self._inputs is not None and inputs[0] is not self._inputs[0]:
            # the table of the old mode goes at once: jobs take the round trip (the new mode) until
            # the new table is built
            self._remove(f"policy.mode is now {mode.value}", gate=False)
        if why and self._holds_the_same(inputs):
            self._refresh(why)
        elif why:
            self._publish(why, inputs)
        return True

    def _holds_the_same(self, inputs: tuple) -> bool:
        """Whether a build now would decide what the last one did: nothing it depends on changed
        (its keys, observations learned, mode, enforcement, partitions, the interference model),
        it decided every key, and this service has been the writer since."""
        return self._published is not None and self._complete and not self._claimed and inputs == self._inputs

    def _depends(self) -> tuple:
        h = self.handler
        enforcement = h.node_enforcement.view(self.clock(), self.cfg.policy.enforcement_max_age_s)
        parts = h.partitions() if h.partitions else None
        return (h.mode, (enforcement.victim_enforced, enforcement.summary), parts, sum(h.learned.values()),
                self._key_set(self.clock()), h.interference.view)

    def _why(self, inputs: tuple, now: float) -> str:
        """Why the table is rebuilt now ("" : it is not)."""
        if self._published is None:
            return "first publication"
        if self._claimed:
            return "this service is now the writer"
        if inputs[0] is not self._inputs[0]:
            return f"policy.mode is {inputs[0].value}"
        if now - self._published_at >= self.cfg.admission.valid_s / 2:
            return "valid_s / 2 since the last publication"
        if now - self._built_at < self._build_every():
            return ""
        names = ("mode", "enforcement", "partitions", "observations learned", "classes decided", "interference model")
        changed = [n for n, a, b in zip(names, inputs, self._inputs) if a != b]
        return ", ".join(changed) + " changed" if changed else ""

    def _build_every(self) -> float:
        """The least time between two builds: refresh_s, or longer for a table whose build is
        costly: its last build's CPU time / BUILD_SHARE, up to BUILD_WAIT_MAX_S."""
        return max(self.cfg.admission.refresh_s, min(BUILD_WAIT_MAX_S, self._build_cpu / BUILD_SHARE))

    # ------------------------------------------------------------------ publishing
    def publish(self, why: str, inputs: tuple | None = None) -> Publication:
        """Build and write the class table now (and archive it)."""
        with self._lock:
            return self._publish(why, inputs)

    def _publish(self, why: str, inputs: tuple | None) -> Publication:
        started, cpu = time.monotonic(), time.thread_time()
        inputs = inputs or self._depends()
        now = self.clock()
        mode = inputs[0]
        generation = self._generation(inputs[:3])
        queues = admission.state_queues(self.cfg)
        keys = self._read_keys(now)
        left_out = self._left_out
        built: list[tuple[str, Known]] = []
        for n, (key, facts_pb) in enumerate(keys):
            known = self._decisions(key, facts_pb, self._number(key), generation, mode, queues)
            if known is not None and known.text:
                built.append((key, known))
            if n % 256 == 255:
                time.sleep(0)  # let Admit's threads in
        for key in set(self._known) - {k for k, _ in keys}:
            del self._known[key]
        # the file (and what its version names) in entry order, not by recency: a build that
        # decided what the last one did writes the same bytes under the same version. The version
        # also names the templates catch-up records table-made decisions from: an entry decided
        # again alike but for its reasons (a class's first observed run while it stays whole:
        # "1 so far") is another version, else its jobs would be recorded with the old reasons
        built.sort(key=lambda kv: kv[1].entry)
        content = hashlib.blake2b(repr((mode.value, self.handler.dialect.name)).encode(), digest_size=16)
        for key, known in built:
            content.update(f"{key}\0{known.entry}\0{known.text}\0".encode())
            content.update(known.templates[1])  # (the digest of its archived templates: archive.stored_entry)
        digest = content.digest()
        reused = self._published is not None and digest == self._content and self._published.version
        version = reused or os.urandom(8).hex()
        if reused:
            self.archive.touch(version)
        else:
            self.archive.put_stored(version, {known.entry: known.templates for _, known in built})  # before a
            # job can name it
        with self._file_lock:
            built = self._unlearned(built)  # an observation may have come while the keys were decided
            size = self._write_table(self._doc(version, mode, now), built)
        self._complete = self._left_out == left_out
        self._content, self._inputs, self._claimed = digest, inputs, False
        self._built_at, self._build_cpu = now, time.thread_time() - cpu
        return self._published_now(why, version, built, size, started, now, bool(reused))

    def _refresh(self, why: str) -> Publication:
        """The file last written, published again under a new valid_until (``_holds_the_same``):
        no key is decided again and its body is written as last rendered. An observation's drop
        (``learning``, under the same lock) has left its classes out of what was last written."""
        started, now, version = time.monotonic(), self.clock(), self._published.version
        self.archive.touch(version)
        with self._file_lock:
            written = self._written
            if written is not None:
                size = self._write_table(self._doc(version, self._inputs[0], now), written[1])
        if written is None:  # removed since (an entry's drop could not be written): built anew
            return self._publish(why, None)
        return self._published_now(why, version, written[1], size, started, now, True)

    def _doc(self, version: str, mode: PolicyMode, now: float) -> dict:
        return admission.table_file(version, now, now + self.cfg.admission.valid_s, self.handler.dialect.name,
                                    mode.value, self.cfg.policy.queue_per_qos, None)

    def _published_now(self, why: str, version: str, built: list, size: int, started: float, now: float,
                       reused: bool) -> Publication:
        self._prune(now)
        pub = Publication(version, len(built), sum(len(k.templates[0]) for _, k in built), size,
                          time.monotonic() - started, reused)
        self._published, self._published_at, self.last = pub, now, pub
        log.info("admission table %s %s (%s): %d entries, %d bytes, %.2f s", version,
                 "re-published" if reused else "published", why, pub.entries, pub.bytes, pub.built_s)
        return pub

    def _prune(self, now: float) -> None:
        keep_s = self.cfg.admission.valid_s + self.cfg.service.reconcile_window_s
        older_than = now - keep_s
        versions = self.archive.versions()
        if len(versions) > self.cfg.admission.archive_keep:
            older_than = min(older_than, versions[self.cfg.admission.archive_keep - 1][1])
        else:
            older_than = min(older_than, versions[-1][1] if versions else older_than)
        dropped = self.archive.prune(older_than)
        if dropped:
            log.info("admission archive: %d version(s) published before %.0f dropped", dropped, older_than)

    def _remove(self, why: str, gate: bool = True) -> None:
        with self._gate_lock:
            with self._file_lock:
                self._unlink_table()
            if gate:
                try:
                    self.gate.unlink()
                except FileNotFoundError:
                    pass
                self._gate_written = None
        log.warning("admission table %s removed (%s): every job takes the Admit round trip", self.table, why)
        self._published, self._inputs = None, None
