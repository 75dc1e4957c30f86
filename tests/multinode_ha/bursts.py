"""Bursts of submissions across a controller switch, and what the history made of them: each
burst submits held one-GPU jobs one after another (the decision is made at submit; a held job
never runs) and reads back each job's AdminComment. A job whose AdminComment carries a decision must
have exactly that decision in the history, once; a job without one was let through undecided by the
plugin's fail-open. Printed per burst: the failover gap (first to last undecided or refused
submission, seconds), lost (decided in Slurm, missing from the history) and duplicated (a burst job
with more than one decision in the history)."""
from __future__ import annotations

import dataclasses
import time
import uuid
from pathlib import Path
from typing import Callable

from tests.multinode_ha.conftest import PORTS, SUBNET
from tests.slurm_stack import Stack, decision_of, job_field
from tests.waiting import wait_for


@dataclasses.dataclass(frozen=True)
class Submission:
    name: str
    started: float  # time.time() when sbatch began
    ended: float
    job_id: int | None  # None: sbatch refused or failed
    decision_id: str  # "" when the AdminComment carries no decision (fail-open)
    table: str = ""  # the AdminComment's tbl= (<version>:<entry><gate state>): decided by job_submit.lua's table


@dataclasses.dataclass(frozen=True)
class BurstResult:
    tag: str
    switch_at: float
    subs: tuple[Submission, ...]

    @property
    def undecided(self) -> tuple[Submission, ...]:
        return tuple(s for s in self.subs if not s.decision_id)

    @property
    def gap_s(self) -> float:
        """Seconds from the first undecided (or refused) submission's start to the last one's end."""
        u = self.undecided
        return max(s.ended for s in u) - min(s.started for s in u) if u else 0.0

    def first_decided_after(self, t: float) -> Submission | None:
        later = [s for s in self.subs if s.started >= t and s.decision_id]
        return min(later, key=lambda s: s.started) if later else None


def history_db(stack: Stack):
    """A connection to the cluster's swapaware history (MariaDB on the bridge side)."""
    import pymysql

    password = Path(stack.state / "etc" / "swapaware-db.pass").read_text().strip()
    return pymysql.connect(host=f"{SUBNET}.1", port=int(PORTS["SWAPAWARE_DB_PORT"]), user="swapaware",
                           password=password, database="swapaware", connect_timeout=5)


def history_query(stack: Stack, sql: str, args=()) -> tuple:
    """The rows of one statement on the cluster's swapaware history, on a connection of its own."""
    conn = history_db(stack)
    try:
        with conn.cursor() as cur:
            cur.execute(sql, args)
            return cur.fetchall()
    finally:
        conn.close()


def history_rows(stack: Stack, tag: str) -> dict[str, list[tuple[str, float]]]:
    """job name -> (decision id, decided_at) in the MariaDB history, for the burst's job names."""
    rows: dict[str, list[tuple[str, float]]] = {}
    for name, did, at in history_query(stack, "SELECT job_name, decision_id, decided_at FROM decisions "
                                              "WHERE job_name LIKE %s", (f"ha-{tag}-%",)):
        rows.setdefault(name, []).append((did, float(at)))
    return rows


def rows_per(stack: Stack, table: str, column: str, values: list) -> dict:
    """value -> how many rows of the history's ``table`` have it in ``column`` (absent: none)."""
    return {v: int(n) for v, n in history_query(
        stack, f"SELECT {column}, COUNT(*) FROM {table} WHERE {column} IN (" + ",".join(["%s"] * len(values))
        + f") GROUP BY {column}", values)}


def submit_one(stack: Stack, name: str) -> Submission:
    t0 = time.time()
    r = stack.run("sbatch", "--parsable", "--hold", "--gres=gpu:1", f"--job-name={name}",
                  f"--chdir={stack.state}", "--wrap", "true", check=False, timeout=120)
    t1 = time.time()
    if r.returncode != 0:
        return Submission(name, t0, t1, None, "")
    job = int(r.stdout.strip().split(";")[0])
    line = stack.run("scontrol", "show", "job", "-o", str(job), check=False).stdout
    decision = decision_of(job_field(line, "AdminComment"))
    return Submission(name, t0, t1, job, decision.get("id", ""), decision.get("tbl", ""))


def burst(stack: Stack, switch: Callable[[], None], before: int = 8, after_decided: int = 10,
          limit_s: float = 90) -> BurstResult:
    """``before`` submissions, then ``switch()``, then submissions until ``after_decided`` of them
    carried a decision (or ``limit_s`` passed)."""
    tag = uuid.uuid4().hex[:6]
    subs: list[Submission] = [submit_one(stack, f"ha-{tag}-{i}") for i in range(before)]
    switch_at = time.time()
    switch()
    i = before
    while sum(1 for s in subs[before:] if s.decision_id) < after_decided and time.time() - switch_at < limit_s:
        subs.append(submit_one(stack, f"ha-{tag}-{i}"))
        i += 1
    return BurstResult(tag, switch_at, tuple(subs))


@dataclasses.dataclass(frozen=True)
class Counts:
    lost: int  # decided in Slurm (AdminComment), not in the history
    dup: int  # a burst job with more than one decision in the history
    decision_gap_s: float  # the longest pause between the burst's decisions (the history's decided_at)
    decided_at: tuple[float, ...]  # the burst's decisions' times, sorted


def settle_and_count(stack: Stack, res: BurstResult) -> Counts:
    """Waits until every decided job's decision is in the history (the writer drains its journal)."""
    decided = {s.name: s.decision_id for s in res.subs if s.decision_id}

    def missing() -> list[str]:
        rows = history_rows(stack, res.tag)
        return [n for n, d in decided.items() if d not in [r[0] for r in rows.get(n, [])]]

    try:
        wait_for(lambda: not missing(), 60, lambda: f"decisions {missing()} in the history", 0.5)
    except AssertionError:
        pass  # counted below as lost
    rows = history_rows(stack, res.tag)
    times = sorted(at for n, d in decided.items() for did, at in rows.get(n, []) if did == d)
    gap = max((b - a for a, b in zip(times, times[1:])), default=0.0)
    return Counts(len(missing()), sum(1 for s in res.subs if s.job_id is not None and len(rows.get(s.name, [])) > 1),
                  gap, tuple(times))


def report(what: str, res: BurstResult, c: Counts, on_at: float) -> None:
    first = res.first_decided_after(res.switch_at + 0.5)
    resumed = min((t for t in c.decided_at if t >= on_at), default=float("nan"))
    refused = sum(1 for s in res.subs if s.job_id is None)
    print(f"\n[ha] {what}: {len(res.subs)} submissions, {len(res.undecided)} undecided "
          f"({refused} refused by sbatch), failover gap (fail-open) {res.gap_s:.1f} s, longest pause between "
          f"decisions {c.decision_gap_s:.1f} s, first decided submission after the switch ended "
          f"+{(first.ended - res.switch_at) if first else float('nan'):.1f} s, Slurm's takeover (ctl2's "
          f"PrimaryOnProg) +{on_at - res.switch_at:.1f} s, ctl2's first decision {resumed - on_at:.1f} s after that, "
          f"lost {c.lost}, dup {c.dup}")


def check_failover(res: BurstResult, c: Counts, on_at: float) -> None:
    """Slurm's own part (the switch until the backup runs its PrimaryOnProg) is at most
    SlurmctldTimeout after the primary is gone; decisions pause no longer than that + 5 s. (24.11
    ran job_submit on the backup before its PrimaryOnProg ended: the backup's first decision may
    precede on_at.)"""
    assert res.first_decided_after(res.switch_at + 0.5) is not None, f"no decided submission after the switch: {res.subs}"
    assert [t for t in c.decided_at if t >= on_at - 5], f"ctl2 in control at {on_at}, decisions at {c.decided_at}"
    assert c.decision_gap_s <= (on_at - res.switch_at) + 5, \
        f"decisions paused {c.decision_gap_s:.1f} s around the switch (Slurm's takeover {on_at - res.switch_at:.1f} s)"
    assert (c.lost, c.dup) == (0, 0)
