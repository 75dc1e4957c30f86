"""Publishes the admission table: the class table and the queue gate (core/admission.py).

A background thread, never on Admit's path:
  * the keys: the facts of the decisions recorded in the last admission.horizon_s (read from the
    history by rowid, only new rows after the first pass), newest first, at most max_entries;
  * each key is decided through the handler's own path (PolicyHandler._decide) once per gate state
    some queue reaches, with a queue snapshot in that state, then policy.mode is applied as Admit
    applies it; a key whose history keys learned nothing since, under the same mode, enforcement
    and partitions, keeps its decisions;
  * rebuilt at most every refresh_s, when something it depends on changed (observations learned,
    new decisions, mode, nodes' enforcement, partitions), at once when the mode changed, and
    re-published at least every valid_s / 2 (the same version when nothing it holds changed);
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
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.adapters.admission_archive import TableArchive, stored_entry
from policy_service.adapters.atomic_file import write_atomically
from policy_service.config import Config, PolicyMode
from policy_service.core import admission, admission_format
from policy_service.core.mode import apply_mode
from policy_service.decision_proto import decision_record
from policy_service.handler import HandlerError, PolicyHandler

log = logging.getLogger("swapaware.admission")

_PROVISIONAL = "0" * 16
TABLE_MODE = 0o640  # the table and gate files: the service's user and slurmctld's group


def _pieces(doc: dict, built: list) -> Iterator[bytes]:
    """The class table's file (core/admission_format.table_pieces) of the keys as built."""
    return admission_format.table_pieces(doc, (
        (known.digest, key, known.entry, (part.partition("\t")[::2] for part in known.text.split("\n")))
        for key, known in built))


class _Known(NamedTuple):
    """A key's entry as last built: numbers, strings and bytes only (no decision objects), kept
    as a plain tuple so that the garbage collector stops tracking it; its full passes, which run
    in whichever thread allocates (Admit's too), then stay short however many keys are held."""

    context: int  # the generation of (mode, enforcement, partitions) it was built under
    learned: tuple  # observations learned then under the history keys its decisions read (deps)
    deps: tuple
    entry: int  # its entry number
    text: str  # its decisions, one "<state>\t<decision line>" per line (admission_format; "": none publishable)
    templates: tuple  # (its states, digest, body) as the archive stores them (admission_archive.stored_entry)
    digest: str  # admission_format.key_digest of its key, the plugin's index


@dataclasses.dataclass(frozen=True)
class Publication:
    version: str
    entries: int
    templates: int
    bytes: int
    built_s: float
    reused: bool  # the previous version re-published (nothing it holds changed)


class AdmissionPublisher:
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
        self._numbers: dict[str, int] = {}  # key -> entry number, stable while the process runs
        # key -> _Known as a plain tuple: the collector stops tracking a tuple of atoms (it never
        # stops tracking a NamedTuple's instance)
        self._known: dict[str, tuple] = {}
        self._context: tuple | None = None  # (mode, enforcement, partitions) of the last build
        self._context_number = 0
        self._published: Publication | None = None
        self._published_at = 0.0
        self._content = b""  # digest of what the published version holds
        self._inputs: tuple | None = None  # what the last build depended on
        self._built_at = float("-inf")
        self._gate_written: tuple | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.RLock()  # one build at a time (the thread, a test)
        # the class table file: held while it is written, by a build or by ``learning`` (which
        # never waits for a build to decide its keys, only for a write under way)
        self._file_lock = threading.Lock()
        self._written: tuple | None = None  # (doc, [(key, _Known)]) of the file as last written
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
        if why:
            self._publish(why, inputs)
        return True

    def _depends(self) -> tuple:
        h = self.handler
        enforcement = h.node_enforcement.view(self.clock(), self.cfg.policy.enforcement_max_age_s)
        parts = h.partitions() if h.partitions else None
        return (h.mode, (enforcement.victim_enforced, enforcement.summary), parts, sum(h.learned.values()),
                self._newest_rowid())

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
        if now - self._built_at < self.cfg.admission.refresh_s:
            return ""
        names = ("mode", "enforcement", "partitions", "observations learned", "decisions recorded")
        changed = [n for n, a, b in zip(names, inputs, self._inputs) if a != b]
        return ", ".join(changed) + " changed" if changed else ""

    # ------------------------------------------------------------------ keys
    def _reader(self):
        return self.handler.store.open_reader()  # its own connection: a long scan never holds up Admit

    def _newest_rowid(self) -> int:
        db, seq = self._reader(), self.handler.store.seq
        try:
            return int(db.execute(f"SELECT COALESCE(MAX({seq}), 0) FROM decisions").fetchone()[0])
        finally:
            db.close()

    def _read_keys(self, now: float) -> list[tuple[str, bytes]]:
        """The keys to publish, newest first: (key, facts_pb)."""
        self.handler.flush()  # decisions handed out so far are in the history
        db, seq = self._reader(), self.handler.store.seq
        try:
            if int(db.execute(f"SELECT COALESCE(MAX({seq}), 0) FROM decisions").fetchone()[0]) < self._last_rowid:
                self._last_rowid = 0  # another history file (restored): read it all again
            rows = db.execute(f"SELECT {seq}, decided_at, facts_pb FROM decisions WHERE {seq} > ? ORDER BY {seq}",
                              (self._last_rowid,))
            for rowid, at, facts_pb in rows:
                self._last_rowid = rowid
                try:
                    key = admission.table_key(pb.JobFacts.FromString(facts_pb))
                except Exception:  # noqa: BLE001 - a record that does not parse is not published
                    continue
                seen = self._facts.get(key)
                if seen is None or at >= seen[0]:
                    self._facts[key] = (at, facts_pb)
        finally:
            db.close()
        cutoff = now - self.cfg.admission.horizon_s
        for key in [k for k, (at, _) in self._facts.items() if at < cutoff]:
            del self._facts[key]
        newest = sorted(self._facts.items(), key=lambda kv: -kv[1][0])[:self.cfg.admission.max_entries]
        return [(key, facts_pb) for key, (_, facts_pb) in newest]

    def _number(self, key: str) -> int:
        n = self._numbers.get(key)
        if n is None:
            if len(self._numbers) > admission.MAX_ENTRY:
                self._numbers.clear()  # only after ten million distinct keys in one run
            n = self._numbers[key] = len(self._numbers)
        return n

    # ------------------------------------------------------------------ deciding
    def _decisions(self, key: str, facts_pb: bytes, i: int, context: tuple, queues: dict) -> _Known | None:
        generation = self._generation(context)
        """A key's entry (number ``i``): the last build's while nothing its decisions read changed,
        else decided again under each gate state."""
        h = self.handler
        held = self._known.get(key)
        known = _Known._make(held) if held is not None else None
        if (known is not None and known.entry == i and known.context == generation
                and known.learned == self._learned(known.deps)):
            return known
        facts = pb.JobFacts.FromString(facts_pb)
        if not admission.publishable(facts):
            return None
        read: dict = {}

        def stats_of(keys):  # one read of the history for all the states
            if "stats" not in read:
                read["stats"] = h.store.stats(keys)
            return read["stats"]

        out, jr, keys = {}, None, {}
        for state, queue in queues.items():
            try:
                d, jr, keys = h._decide(facts, queue=queue, decision_id=admission.PLACEHOLDER_ID, stats_of=stats_of)
            except HandlerError:
                return None  # refused as Admit refuses it: the RPC path answers
            except Exception as exc:  # one odd record must not keep the others from the table
                log.warning("admission table: key of %s/%s left out: %s", facts.user, facts.job_name, exc)
                return None
            out[state] = dataclasses.replace(apply_mode(d, context[0], self.cfg.policy.admin_comment_max_chars),
                                             decided_at=0.0)
        facts.uid = 0  # not part of the key: catch-up fills in the job's own
        facts.work_dir = ""
        user = jr.user if jr is not None else facts.user
        deps = admission.keys_read(keys, read.get("stats", {}), self.cfg, user=user)
        text, templates = self._fragment(i, out, jr, keys, facts)
        known = _Known(generation, self._learned(deps), deps, i, text, templates, admission_format.key_digest(key))
        self._known[key] = tuple(known)
        return known

    def _generation(self, context: tuple) -> int:
        """A number for ``context``, new whenever it changed."""
        if context != self._context:
            self._context, self._context_number = context, self._context_number + 1
        return self._context_number

    def _learned(self, deps: tuple) -> tuple:
        learned = self.handler.learned
        return tuple(learned[k] for k in deps)

    # ------------------------------------------------------------------ publishing
    def publish(self, why: str, inputs: tuple | None = None) -> Publication:
        """Build and write the class table now (and archive it)."""
        with self._lock:
            return self._publish(why, inputs)

    def _publish(self, why: str, inputs: tuple | None) -> Publication:
        started = time.monotonic()
        inputs = inputs or self._depends()
        now = self.clock()
        mode = inputs[0]
        context = inputs[:3]
        queues = admission.state_queues(self.cfg)
        keys = self._read_keys(now)
        content = hashlib.blake2b(repr((mode.value, self.handler.dialect.name)).encode(), digest_size=16)
        built: list[tuple[str, _Known]] = []
        for n, (key, facts_pb) in enumerate(keys):
            known = self._decisions(key, facts_pb, self._number(key), context, queues)
            if known is not None and known.text:
                built.append((key, known))
                content.update(f"{key}\0{known.entry}\0{known.text}".encode())
            if n % 256 == 255:
                time.sleep(0)  # let Admit's threads in
        for key in set(self._known) - {k for k, _ in keys}:
            del self._known[key]
        digest = content.digest()
        reused = self._published is not None and digest == self._content and self._published.version
        version = reused or os.urandom(8).hex()
        if reused:
            self.archive.touch(version)
        else:
            self.archive.put_stored(version, {known.entry: known.templates for _, known in built})  # before a
            # job can name it
        doc = admission.table_file(version, now, now + self.cfg.admission.valid_s, self.handler.dialect.name,
                                   mode.value, self.cfg.policy.queue_per_qos, None)
        with self._file_lock:
            built = self._unlearned(built)  # an observation may have come while the keys were decided
            size = write_atomically(self.table, _pieces(doc, built), TABLE_MODE, self.reader_gid)
            self._written = (doc, built)
        self._prune(now)
        pub = Publication(version, len(built), sum(len(k.templates[0]) for _, k in built), size,
                          time.monotonic() - started, bool(reused))
        self._published, self._published_at, self._content = pub, now, digest
        self._inputs, self._built_at, self.last, self._claimed = inputs, now, pub, False
        log.info("admission table %s %s (%s): %d entries, %d bytes, %.2f s", version,
                 "re-published" if reused else "published", why, pub.entries, pub.bytes, pub.built_s)
        return pub

    def _unlearned(self, built: list) -> list:
        """``built`` less the entries whose history keys learned something since they were decided."""
        return [(key, known) for key, known in built if known.learned == self._learned(known.deps)]

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
            write_atomically(self.table, _pieces(doc, kept), TABLE_MODE, self.reader_gid)
        except OSError as exc:  # the file keeps the entries: remove it rather than answer stale
            log.error("admission table: entries whose class learned could not be dropped (%s): the table is removed "
                      "until the next build", exc)
            self._unlink_table()
            return
        self._written = (doc, kept)
        log.info("admission table: %d entr%s dropped until the next build (an observation of their class)",
                 len(built) - len(kept), "y" if len(built) - len(kept) == 1 else "ies")

    def _unlink_table(self) -> None:
        """Under _file_lock."""
        try:
            self.table.unlink()
        except FileNotFoundError:
            pass
        self._written = None

    def _fragment(self, i: int, decisions: dict, jr, keys: dict, facts: pb.JobFacts) -> tuple[str, tuple]:
        """(the entry's decisions as ``_Known.text``, its templates in stored form) under the
        provisional version: the file's decisions hold no token (the plugin writes it), the
        archive stores templates without the version. ("", ()) when no state has a publishable
        decision."""
        max_chars = self.cfg.policy.admin_comment_max_chars
        rewrites = {s: d.rewrite for s, d in decisions.items()}
        lines = []
        records = {}
        for state, ref in admission.entry_refs(_PROVISIONAL, i, rewrites).items():
            d = decisions[next(iter(decisions)) if state == admission.ALL_STATES else state]
            rw = admission.tokenised(d.rewrite, ref, max_chars)
            decision = admission.table_decision(rw) if rw is not None else None
            if decision is None:
                continue
            lines.append(f"{state}\t{admission_format.decision_text(decision)}")
            reasons = admission.template_reasons(d.reasons, state, self.cfg)
            records[state] = decision_record(dataclasses.replace(d, rewrite=rw, reasons=reasons), jr, keys, facts)
        if not records:
            return "", ()
        return "\n".join(lines), (tuple(records), *stored_entry(_PROVISIONAL, i, records))

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
