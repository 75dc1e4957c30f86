"""The job runs and events ``HistoryStore`` records: a run's start, its finish (the observation,
folded into each key's statistics), the events already applied (a replayed event is applied
once), and the runs, open runs and co-runners read back."""
from __future__ import annotations

import json
from typing import Callable, Iterable, Mapping

from policy_service.core.types import ClassStats, KeyLevel
from policy_service.history.schema import (LEGACY_PREFIX, OBSERVATION_COLS, RUN_COLS, UNRESOLVED_PREFIX, ObservationRow,
                                           RunRow, observation_row, run_row, stats_from_json, stats_to_json,
                                           unresolved_key)


# A run with no finish whose decision's facts give a time limit stops counting as a co-runner this
# long after that limit (Slurm's OverTimeLimit and a slow epilog fit in it): ``co_runners``.
OPEN_RUN_LIMIT_GRACE_S = 3600.0


class RunsAndEvents:
    """``HistoryStore``'s runs, observations and events (uses its _tx and _read)."""

    # A run is one job instance on one node (a multi-node job has one per node); its key is the
    # instance's (history_schema). Events arrive in any order and more than once.
    def event_seen(self, event_id: str) -> bool:
        return event_id in self.events_seen([event_id])

    def events_seen(self, event_ids: Iterable[str]) -> set[str]:
        """Which of these event ids were already applied."""
        ids = sorted({e for e in event_ids if e})
        seen: set[str] = set()
        for i in range(0, len(ids), 500):
            part = ids[i:i + 500]
            seen.update(r[0] for r in self._read(
                f"SELECT event_id FROM events WHERE event_id IN ({','.join('?' * len(part))})", part))
        return seen

    def record_start(self, *, event_id: str, job_id: int, decision_id: str, node: str, gpus: Iterable[int],
                     started_at: float, received_at: float, instance: str = "", submit_time: int = 0) -> bool:
        """Record a job instance's start on a node; False when this event was already applied.
        ``instance``: its key ("": unresolved, known by job id, node and start second only)."""
        instance = instance or unresolved_key(job_id, node, started_at)
        with self._tx() as c:
            if not _claim_event(c, event_id, "start", received_at):
                return False
            c.execute("INSERT INTO runs (instance, node, job_id, submit_time, decision_id, gpu_indices, started_at) "
                      "VALUES (?,?,?,?,?,?,?) ON CONFLICT(instance, node) DO UPDATE SET "
                      "decision_id=CASE WHEN excluded.decision_id!='' THEN excluded.decision_id ELSE runs.decision_id "
                      "END, gpu_indices=excluded.gpu_indices, started_at=excluded.started_at, "
                      "submit_time=MAX(runs.submit_time, excluded.submit_time)",
                      (instance, node, job_id, submit_time, decision_id, json.dumps(sorted(gpus)), started_at))
        return True

    def run(self, job_id: int) -> RunRow | None:
        """The newest run recorded under this job id, of any instance (for people and tests; events
        go by instance: ``run_of``)."""
        return self._one_run("job_id=?", (job_id,))

    def run_of(self, instance: str, node: str | None = None) -> RunRow | None:
        """The run of a job instance (on ``node``; None: its newest on any node)."""
        if node is None:
            return self._one_run("instance=?", (instance,))
        return self._one_run("instance=? AND node=?", (instance, node))

    def _one_run(self, where: str, args: tuple) -> RunRow | None:
        rows = self._read(f"SELECT {RUN_COLS} FROM runs WHERE {where} "
                          "ORDER BY started_at IS NULL, started_at DESC LIMIT 1", args)
        return run_row(rows[0]) if rows else None

    def open_runs_of(self, job_id: int, node: str) -> list[RunRow]:
        """Runs of this job id on this node that have no finish yet, newest first (not legacy ones)."""
        rows = self._read(f"SELECT {RUN_COLS} FROM runs WHERE job_id=? AND node=? AND finished_at IS NULL "
                          "AND started_at IS NOT NULL AND instance NOT LIKE ? ORDER BY started_at DESC",
                          (job_id, node, LEGACY_PREFIX + "%"))
        return [run_row(r) for r in rows]

    def overlapping_runs(self, node: str, gpus: Iterable[int], start: float, end: float, exclude_instance: str,
                         open_since: float | None = None) -> list[RunRow]:
        """Runs of other instances on the same node and any of the same GPUs whose interval overlaps
        [start, end]. A run with no finish counts as running on, unless it started before
        ``open_since`` (its JobFinished may never come: the node died, the epilog never ran)."""
        wanted = set(gpus)
        since = float("-inf") if open_since is None else open_since
        # two ranges of the index (node, finished_at, started_at): runs that finished after the
        # start, and runs with no finish that started since ``since``; a scan of the node's runs by
        # start alone read every run it ever held that started before ``end`` (17 ms an event at
        # 100,000 runs on the node: bench/co_runners.py)
        # (+started_at: not a range of runs_node (node, started_at), which a planner without
        # statistics prefers for the first, and which reads the node's whole past)
        rows = self._read(f"SELECT {RUN_COLS} FROM runs WHERE node=? AND finished_at > ? AND +started_at < ? "
                          "AND instance!=? UNION ALL "
                          f"SELECT {RUN_COLS} FROM runs WHERE node=? AND finished_at IS NULL AND started_at >= ? "
                          "AND started_at < ? AND instance!=?",
                          (node, start, end, exclude_instance, node, since, end, exclude_instance))
        runs = sorted(map(run_row, rows), key=lambda r: r.started_at)  # (by start, as one scan gave them)
        return [r for r in runs if wanted & set(r.gpu_indices)]

    def co_runners(self, node: str, gpus: Iterable[int], start: float, end: float, instance: str,
                   open_run_max_s: float) -> list[RunRow]:
        """Other runs on these GPUs during [start, end] (``overlapping_runs``). A run whose finish
        never came counts as running for ``open_run_max_s`` after its start (service.open_run_max_s),
        or its time limit (from its decision's facts) plus ``OPEN_RUN_LIMIT_GRACE_S`` when that is
        sooner. The service's events and the report read co-runners here."""
        out = []
        for r in self.overlapping_runs(node, gpus, start, end, instance, open_since=start - open_run_max_s):
            if r.finished_at is None and r.decision_id:
                facts_row = self.decision(r.decision_id)
                limit_min = facts_row.facts.time_limit_min if facts_row is not None else 0
                if limit_min and (r.started_at or 0.0) + min(open_run_max_s, limit_min * 60.0 +
                                                             OPEN_RUN_LIMIT_GRACE_S) <= start:
                    continue
            out.append(r)
        return out

    def record_finish(self, obs: ObservationRow, keys: Mapping[KeyLevel, str],
                      fold: Callable[[KeyLevel, ClassStats], ClassStats]) -> bool:
        """Store an observation and fold it into each key's statistics (``fold(level, stats)``), in one transaction
        (no lost update between concurrent finishes of one class); False on replay. Closes the
        instance's run on that node, and an unresolved run of the same job id there that started
        after the instance was submitted (the same job, started while Slurm could not be asked)."""
        instance = obs.instance or unresolved_key(obs.job_id, obs.node, obs.started_at)
        with self._tx() as c:
            if not _claim_event(c, obs.event_id, "finish", obs.received_at):
                return False
            c.execute(f"INSERT INTO observations ({OBSERVATION_COLS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                      (obs.event_id, obs.job_id, obs.decision_id, obs.node, json.dumps(list(obs.gpu_indices)),
                       obs.started_at, obs.finished_at, obs.runtime_s, obs.exit_code, obs.peak_bytes, int(obs.oom),
                       obs.co_runners, int(obs.shared), obs.telemetry_source, obs.received_at, instance,
                       obs.submit_time))
            c.execute("INSERT INTO runs (instance, node, job_id, submit_time, decision_id, gpu_indices, started_at, "
                      "finished_at) VALUES (?,?,?,?,?,?,?,?) ON CONFLICT(instance, node) DO UPDATE SET "
                      "finished_at=excluded.finished_at, submit_time=MAX(runs.submit_time, excluded.submit_time), "
                      "decision_id=CASE WHEN runs.decision_id='' THEN excluded.decision_id ELSE runs.decision_id END",
                      (instance, obs.node, obs.job_id, obs.submit_time, obs.decision_id,
                       json.dumps(list(obs.gpu_indices)), obs.started_at, obs.finished_at))
            if obs.submit_time > 0:
                c.execute("UPDATE runs SET finished_at=? WHERE job_id=? AND node=? AND finished_at IS NULL "
                          "AND instance LIKE ? AND instance!=? AND started_at >= ?",
                          (obs.finished_at, obs.job_id, obs.node, UNRESOLVED_PREFIX + "%", instance, obs.submit_time))
            for level, key in keys.items():
                row = c.execute("SELECT stats_json FROM class_stats WHERE level=? AND key=?",
                                (level.value, key)).fetchone()
                new = fold(level, stats_from_json(row[0]) if row else ClassStats())
                c.execute("INSERT OR REPLACE INTO class_stats VALUES (?,?,?,?)",
                          (level.value, key, stats_to_json(new), obs.received_at))
        return True

    def recent_shared_observations(self, limit: int) -> list[ObservationRow]:
        """The newest ``limit`` observations of runs that ended well beside co-runners, oldest
        first (what the interference learner reads at start: interference/learner.py)."""
        rows = self._read(f"SELECT {OBSERVATION_COLS} FROM observations WHERE co_runners > 0 AND exit_code = 0 "
                          "AND runtime_s > 0 AND decision_id != '' ORDER BY finished_at DESC LIMIT ?", (int(limit),))
        return [observation_row(r) for r in reversed(rows)]

    def observations(self, *, job_id: int | None = None, decision_id: str | None = None,
                     instance: str | None = None) -> list[ObservationRow]:
        sql = f"SELECT {OBSERVATION_COLS} FROM observations"
        args: tuple = ()
        if job_id is not None:
            sql, args = sql + " WHERE job_id=?", (job_id,)
        elif decision_id is not None:
            sql, args = sql + " WHERE decision_id=?", (decision_id,)
        elif instance is not None:
            sql, args = sql + " WHERE instance=?", (instance,)
        return [observation_row(r) for r in self._read(sql + " ORDER BY finished_at", args)]


def _claim_event(c, event_id: str, kind: str, now: float) -> bool:
    if not event_id:
        return True
    cur = c.execute("INSERT OR IGNORE INTO events VALUES (?,?,?)", (event_id, kind, now))
    return cur.rowcount == 1
