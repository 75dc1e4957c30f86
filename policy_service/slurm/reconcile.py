"""Which recorded decisions Slurm ever held, checked against the AdminComments Slurm keeps.

A decision is journaled before Admit answers (history/decision_log.py), so every decision Slurm
holds is in the history. The converse needs Slurm: a job refused by slurmctld after the plugin
ran (a script over max_script_size, a name Slurm rejects), or an answer slurmctld stopped waiting
for (the service hung past the plugin's deadline), leaves a decision that no job names. Every
``service.reconcile_s`` the reconciler takes the decisions made between ``reconcile_window_s``
and ``reconcile_settle_s`` ago that have no status yet, reads the decision ids in Slurm's
AdminComments (one ``squeue`` for the jobs slurmctld holds, one ``sacct`` for the accounting of
the window) and marks each ``held`` or ``never_held``. A never-held decision was never a job (a
``--test-only`` submission, which slurmctld runs through job_submit exactly as a real one, or a
job refused after the plugin ran): its record, the facts and the decision, is deleted, and only
its id and status stay, so that `swapaware explain` can say what became of it. When Slurm
cannot be read nothing is marked: the next round tries again.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable

from policy_service.history.db import HistoryUnavailable
from policy_service.history.store import HistoryStore
from policy_service.slurm.slurm import SlurmError

log = logging.getLogger("swapaware.decisions")


@dataclass(frozen=True)
class Reconciled:
    checked: int
    held: int
    never_held: tuple[str, ...]
    error: str = ""


def split_held(ids: list[str], held: set[str]) -> tuple[list[str], list[str]]:
    """(held, never held) of ``ids`` given the ids Slurm's AdminComments name."""
    return [i for i in ids if i in held], [i for i in ids if i not in held]


class Reconciler:
    def __init__(self, store: HistoryStore, slurm, window_s: float, settle_s: float,
                 clock: Callable[[], float], catchup=None):
        self.store, self.slurm, self.window_s, self.settle_s, self.clock = store, slurm, window_s, settle_s, clock
        # admission/catchup.AdmissionCatchup when a table is published: each round sweeps
        # Slurm for table-made decisions (the same squeue and sacct tell which decisions were held)
        self.catchup = catchup

    def _held_ids(self, since: float, checking: bool) -> set[str]:
        if self.catchup is not None:
            return self.catchup.sweep(since if checking else None)
        return self.slurm.held_decision_ids(since) if checking else set()

    def run_once(self) -> Reconciled:
        now = self.clock()
        ids = self.store.unchecked_decisions(now - self.window_s, now - self.settle_s)
        if not ids and self.catchup is None:
            return Reconciled(0, 0, ())
        try:
            held_ids = self._held_ids(now - self.window_s, bool(ids))
            if not ids:
                return Reconciled(0, 0, ())
        except (SlurmError, AttributeError) as exc:
            log.warning("cannot check %d decision(s) against Slurm's AdminComments: %s", len(ids), exc)
            return Reconciled(0, 0, (), str(exc))
        held, never = split_held(ids, held_ids)
        dropped = self.store.settle_decisions(held, never, now)
        if never:
            log.warning("%d decision(s) were never held by Slurm (no job's AdminComment names them: a --test-only "
                        "submission, refused after the plugin ran, or answered after slurmctld stopped waiting); "
                        "%d record(s) deleted: %s", len(never), dropped,
                        ", ".join(never[:10]) + (" ..." if len(never) > 10 else ""))
        return Reconciled(len(ids), len(held), tuple(never))

    def start(self, every_s: float, stop: threading.Event) -> threading.Thread:
        def loop() -> None:
            while not stop.wait(every_s):
                try:
                    self.run_once()
                except HistoryUnavailable as exc:  # nothing was marked: the next round checks them again
                    log.warning("cannot record what Slurm held (the history: %s); the next round checks again", exc)
                except Exception:
                    log.exception("reconciling decisions with Slurm failed")

        t = threading.Thread(target=loop, name="reconcile", daemon=True)
        t.start()
        return t
