"""The decisions ``HistoryStore`` records (facts and decision, keyed by decision id) and whether
Slurm held each (decision_status: slurm/reconcile.py)."""
from __future__ import annotations

import json
from typing import Iterable, Iterator, Mapping

from policy_service.core.types import KeyLevel
from policy_service.history.schema import DECISION_COLS, DecisionRow, decision_row


class DecisionRecords:
    """``HistoryStore``'s decisions (uses its fence, _conn, _lock, _tx and _read)."""

    def record_decision(self, *, decision_id: str, decided_at: float, job_class: str, user: str, account: str,
                        partition: str, job_name: str, action: str, shards: int, model_version: str,
                        keys: Mapping[KeyLevel, str], facts_pb: bytes, decision_pb: bytes) -> None:
        keys_json = json.dumps({k.value: v for k, v in keys.items()}, sort_keys=True)
        row = (decision_id, decided_at, job_class, user, account, partition, job_name, action, shards, model_version,
               keys_json, facts_pb, decision_pb)
        if self.fence is not None:
            with self._tx() as c:
                c.execute(_INSERT_DECISION, row)
            return
        with self._lock:  # one statement: autocommit is its own transaction
            self._conn.execute(_INSERT_DECISION, row)

    def record(self, records) -> None:
        """Decisions from the decision journal (history.journal_records.DecisionRecord), in one
        transaction; a decision recorded again (journal replay) is the same row."""
        rows = [(r.decision_id, r.decided_at, r.job_class, r.user, r.account, r.partition, r.job_name, r.action,
                 r.shards, r.model_version, json.dumps(r.keys, sort_keys=True), r.facts_pb, r.decision_pb)
                for r in records]
        with self._tx() as c:
            c.executemany(_INSERT_DECISION, rows)

    def decision(self, decision_id: str) -> DecisionRow | None:
        rows = self._read(f"SELECT {DECISION_COLS} FROM decisions WHERE decision_id=?", (decision_id,))
        return decision_row(rows[0]) if rows else None

    def known_decisions(self, decision_ids: Iterable[str]) -> set[str]:
        """Which of these decision ids the history holds (recorded, or known as never held)."""
        ids = sorted(set(decision_ids))
        known: set[str] = set()
        for i in range(0, len(ids), 500):
            part = ids[i:i + 500]
            marks = ",".join("?" * len(part))
            known.update(r[0] for r in self._read(
                f"SELECT decision_id FROM decisions WHERE decision_id IN ({marks}) UNION "
                f"SELECT decision_id FROM decision_status WHERE decision_id IN ({marks})", part + part))
        return known

    def decisions(self) -> Iterator[DecisionRow]:
        ids = [r[0] for r in self._read("SELECT decision_id FROM decisions ORDER BY decided_at")]
        for d_id in ids:
            row = self.decision(d_id)
            if row is not None:
                yield row

    # --- whether Slurm held a decision (slurm/reconcile.py) -------------------------------
    def unchecked_decisions(self, since: float, until: float) -> list[str]:
        """Decisions made in [since, until] whose status is not known yet."""
        return [r[0] for r in self._read(
            "SELECT d.decision_id FROM decisions d LEFT JOIN decision_status s USING (decision_id) "
            "WHERE s.decision_id IS NULL AND d.decided_at BETWEEN ? AND ?", (since, until))]

    def settle_decisions(self, held: Iterable[str], never: Iterable[str], at: float) -> int:
        """Mark ``held`` held and ``never`` never held, and delete the records (facts and decision)
        of the never-held ones that no observation names, in one transaction: a never-held status
        is never seen beside its record, and a failure leaves all of them unchecked for the next
        round. Their status rows stay, so that the id is still known as never held. Returns how
        many records were deleted."""
        never = list(never)
        with self._tx() as c:
            c.executemany("INSERT OR REPLACE INTO decision_status VALUES (?,?,?)",
                          [(i, "held", at) for i in held] + [(i, "never_held", at) for i in never])
            return sum(c.execute("DELETE FROM decisions WHERE decision_id=? AND NOT EXISTS (SELECT 1 FROM "
                                 "observations WHERE decision_id=?)", (i, i)).rowcount for i in never)

    def decision_status(self, decision_id: str) -> str:
        rows = self._read("SELECT status FROM decision_status WHERE decision_id=?", (decision_id,))
        return rows[0][0] if rows else ""


# (the columns named: a MariaDB history has one more, ``seq``, that numbers the rows as SQLite's rowid)
_INSERT_DECISION = ("INSERT OR REPLACE INTO decisions (decision_id, decided_at, job_class, user, account, partition, "
                    "job_name, action, shards, model_version, keys_json, facts_pb, decision_pb) "
                    "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)")
