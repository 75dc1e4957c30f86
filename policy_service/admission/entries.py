"""The admission table's entries (admission/publish.py builds the table from them): which
keys are published (the facts of the decisions recorded in the last admission.horizon_s, read by
rowid, newest first, at most max_entries), each key's stable entry number, and each key's decisions
under every gate state, decided through the handler's own path (PolicyHandler._decide) and kept
while the history keys they read learned nothing under the same mode, enforcement and partitions.

``EntryBuilding`` is mixed into AdmissionPublisher, whose __init__ sets what it reads (handler, cfg,
_facts, _last_rowid, _keys_epoch, _oldest_at, _numbers, _known, _context, _context_number, _db, _db_of,
_left_out).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import NamedTuple

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.admission.archive import stored_entry
from policy_service.config import Config
from policy_service.core import admission, admission_format
from policy_service.core.mode import apply_mode
from policy_service.history.db import close_quietly
from policy_service.serving.decision_proto import decision_record
from policy_service.serving.handler_error import HandlerError

log = logging.getLogger("swapaware.admission")

_PROVISIONAL = "0" * 16


class Known(NamedTuple):
    """A key's entry as last built: numbers, strings and bytes only (no decision objects), kept
    as a plain tuple so that the garbage collector stops tracking it; its full passes, which run
    in whichever thread allocates (Admit's too), then stay short however many keys are held."""

    context: int  # the generation of (mode, enforcement, partitions) it was built under
    learned: tuple  # observations learned then under the history keys its decisions read (deps)
    deps: tuple
    entry: int  # its entry number
    text: str  # its decisions, one "<state>\t<decision line>" per line (admission_format; "": none publishable)
    templates: tuple  # (its states, digest, body) as the archive stores them (archive.stored_entry)
    digest: str  # admission_format.key_digest of its key, the plugin's index


def fragment(cfg: Config, i: int, decisions: dict, jr, keys: dict, facts: pb.JobFacts) -> tuple[str, tuple]:
    """(the entry's decisions as ``Known.text``, its templates in stored form) under the
    provisional version: the file's decisions hold no token (the plugin writes it), the
    archive stores templates without the version. ("", ()) when no state has a publishable
    decision."""
    max_chars = cfg.policy.admin_comment_max_chars
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
        reasons = admission.template_reasons(d.reasons, state, cfg)
        records[state] = decision_record(dataclasses.replace(d, rewrite=rw, reasons=reasons), jr, keys, facts)
    if not records:
        return "", ()
    return "\n".join(lines), (tuple(records), *stored_entry(_PROVISIONAL, i, records))


class EntryBuilding:
    """AdmissionPublisher's keys and their entries."""

    def _reader(self):
        """The publisher's own read-only connection to the history (a scan never holds up Admit's
        reads), kept from tick to tick: opening one cost a tick more than its query (SQLite reads
        the schema again; MariaDB logs in). Opened again after an error, and once the store has
        another file open (the history restored while the service ran)."""
        store = self.handler.store
        if self._db is not None and self._db_of != store.opened:
            self._close_reader()
        if self._db is None:
            self._db, self._db_of = store.open_reader(), store.opened
        return self._db

    def _close_reader(self) -> None:
        db, self._db = self._db, None
        close_quietly(db)

    def _absorb(self) -> None:
        """The rows recorded since the last read into ``_facts`` (each key's newest decided_at and
        facts). ``_keys_epoch`` counts what may change the published keys: a key not held before,
        or any row while ``max_entries`` keys or more are held (a newer row may move the cut). A
        row of a held key, as each table-made decision the catch-up records is, changes nothing
        published, and no build is due for it."""
        db, seq = self._reader(), self.handler.store.seq
        try:
            if int(db.execute(f"SELECT COALESCE(MAX({seq}), 0) FROM decisions").fetchone()[0]) < self._last_rowid:
                self._last_rowid = 0  # another history file (restored): read it all again
                self._keys_epoch += 1
            rows = db.execute(f"SELECT {seq}, decided_at, facts_pb FROM decisions WHERE {seq} > ? ORDER BY {seq}",
                              (self._last_rowid,))
            for rowid, at, facts_pb in rows:
                self._last_rowid = rowid
                try:
                    key = admission.table_key(pb.JobFacts.FromString(facts_pb))
                except Exception:  # noqa: BLE001 - a record that does not parse is not published
                    continue
                seen = self._facts.get(key)
                if seen is None or len(self._facts) >= self.cfg.admission.max_entries:
                    self._keys_epoch += 1
                if seen is None or at >= seen[0]:
                    self._facts[key] = (at, facts_pb)
                    self._oldest_at = min(self._oldest_at, at)
        except Exception:
            self._close_reader()  # the next tick opens another
            raise

    def _expire(self, now: float) -> None:
        """The keys decided last before the horizon dropped (``_oldest_at``: no key was decided
        last before it, so most calls scan nothing)."""
        cutoff = now - self.cfg.admission.horizon_s
        if cutoff <= self._oldest_at:
            return
        gone = [k for k, (at, _) in self._facts.items() if at < cutoff]
        for key in gone:
            del self._facts[key]
        self._keys_epoch += bool(gone)
        self._oldest_at = min((at for at, _ in self._facts.values()), default=float("inf"))

    def _key_set(self, now: float) -> int:
        """What a build depends on of the history's decisions: ``_keys_epoch`` after the new rows."""
        self._absorb()
        self._expire(now)
        return self._keys_epoch

    def _read_keys(self, now: float) -> list[tuple[str, bytes]]:
        """The keys to publish, newest first: (key, facts_pb)."""
        self.handler.flush()  # decisions handed out so far are in the history
        self._key_set(now)
        newest = sorted(self._facts.items(), key=lambda kv: -kv[1][0])[:self.cfg.admission.max_entries]
        return [(key, facts_pb) for key, (_, facts_pb) in newest]

    def _number(self, key: str) -> int:
        n = self._numbers.get(key)
        if n is None:
            if len(self._numbers) > admission.MAX_ENTRY:
                self._numbers.clear()  # only after ten million distinct keys in one run
            n = self._numbers[key] = len(self._numbers)
        return n

    def _decisions(self, key: str, facts_pb: bytes, i: int, generation: int, mode, queues: dict) -> Known | None:
        """A key's entry (number ``i``): the last build's while nothing its decisions read changed
        (``generation``: of the build's mode, enforcement and partitions, _generation), else
        decided again under each gate state in ``mode``."""
        h = self.handler
        held = self._known.get(key)
        known = Known._make(held) if held is not None else None
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
                self._left_out += 1
                return None  # refused as Admit refuses it: the RPC path answers
            except Exception as exc:  # one odd record must not keep the others from the table
                log.warning("admission table: key of %s/%s left out: %s", facts.user, facts.job_name, exc)
                self._left_out += 1
                return None
            out[state] = dataclasses.replace(apply_mode(d, mode, self.cfg.policy.admin_comment_max_chars),
                                             decided_at=0.0)
        facts.uid = 0  # not part of the key: catch-up fills in the job's own
        facts.work_dir = ""
        user = jr.user if jr is not None else facts.user
        deps = admission.keys_read(keys, read.get("stats", {}), self.cfg, user=user)
        text, templates = fragment(self.cfg, i, out, jr, keys, facts)
        known = Known(generation, self._learned(deps), deps, i, text, templates, admission_format.key_digest(key))
        self._known[key] = tuple(known)
        return known

    def _generation(self, context: tuple) -> int:
        """A number for ``context``, new whenever it changed (compared once per build: its
        partitions are dataclasses of Fractions, whose comparison is not cheap)."""
        if context != self._context:
            self._context, self._context_number = context, self._context_number + 1
        return self._context_number

    def _learned(self, deps: tuple) -> tuple:
        learned = self.handler.learned
        return tuple(learned[k] for k in deps)

    def _unlearned(self, built: list) -> list:
        """``built`` less the entries whose history keys learned something since they were decided."""
        return [(key, known) for key, known in built if known.learned == self._learned(known.deps)]
