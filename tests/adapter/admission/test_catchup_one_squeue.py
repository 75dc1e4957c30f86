"""The queue poll and the admission catch-up read Slurm's jobs with one squeue (issue 33: each
squeue makes slurmctld pack every job it holds): catch-up attached to a QueueMonitor over the real
CliSlurm (only its subprocess replaced) records a table-made decision from the rows the poll read,
and the poll runs squeue once; without a follower the poll reads the pending jobs alone."""
from __future__ import annotations

import threading

from policy_service.admission.catchup import attach
from policy_service.slurm.queue import QueueMonitor
from policy_service.slurm.slurm import CliSlurm
from policy_service.slurm.slurm_comments import queue_argv, sacct_argv, squeue_argv
from policy_service.slurm.slurm_text import SQUEUE_PENDING_FORMAT
from policy_service.core.dialect import dialect_for
from tests.adapter.admission.test_admission_catchup import (SUBMIT, lua_id, made_comment,  # noqa: F401 (fixtures)
                                                            svc, table)
from tests.waiting import wait_for


class QueueCli(CliSlurm):
    """``CliSlurm`` of one node with 4 GPUs whose squeue shows ``rows`` (QUEUE_FIELDS' columns)."""

    def __init__(self):
        super().__init__(dialect=dialect_for((24, 11)))
        self.rows: list[list[str]] = []
        self.calls: list[list[str]] = []

    def _run(self, argv, env_extra=None):
        self.calls.append(list(argv))
        if argv == queue_argv():
            return "".join("|".join(r) + "\n" for r in self.rows)
        if argv[:5] == ["squeue", "-h", "-a", "-t", "PENDING"]:
            assert argv[-1] == SQUEUE_PENDING_FORMAT
            return "".join("|".join([r[0], *r[8:14], r[14]]) + "\n" for r in self.rows if r[6] == "PENDING")
        if argv == squeue_argv():
            return "".join("|".join(r[:8] + r[-1:]) + "\n" for r in self.rows)
        if argv[0] == "sacct":
            assert argv[:-10] == sacct_argv(0)[:-10]
            return ""
        if argv[0] == "sinfo":
            return "node1|gpu:4(S:0),shard:32(S:0)|mixed\n"
        if argv[0] == "sacctmgr":
            return "normal|0\n"
        raise AssertionError(f"unexpected command {argv}")

    def squeues(self) -> list[list[str]]:
        return [c for c in self.calls if c[0] == "squeue"]


def row(job_id: int, state: str, comment: str) -> list[str]:
    return [str(job_id), str(SUBMIT + job_id), "1234", "alice", "proj", "gpu", state, "4:00:00",
            "gres/gpu:1", "N/A", "N/A", "1", "1", "normal", "Resources" if state == "PENDING" else "None", comment]


def test_the_poll_and_the_catch_up_share_one_squeue(svc, table):
    archive, _ref, tpl = table
    cli = QueueCli()
    d_pending, d_running = lua_id(7), lua_id(8)
    cli.rows = [row(51, "PENDING", made_comment(tpl, d_pending)), row(52, "RUNNING", made_comment(tpl, d_running)),
                row(53, "PENDING", "(null)")]
    monitor = QueueMonitor(cli, svc.handler.cfg)
    stop = threading.Event()
    try:
        catchup = attach(svc.handler, cli, monitor, archive, stop, poll_s=60, window_s=3600)
        wait_for(lambda: any(c[0] == "sacct" for c in cli.calls), 10, "the first sweep")  # (its own squeue)
        wait_for(lambda: svc.handler.decisions.pending() == 0 and catchup.recorded["squeue"] == 2, 10,
                 "the sweep's decisions")
        cli.calls.clear()
        d_new = lua_id(9)
        cli.rows.append(row(54, "PENDING", made_comment(tpl, d_new)))
        state = monitor.poll_once()
        svc.handler.flush()
        assert cli.squeues() == [queue_argv()]  # one squeue for the poll and the catch-up
        assert state is not None and state.pending_gpus == 3  # jobs 51, 53 and 54 wait for a GPU each
        assert svc.store.decision(d_new) is not None and catchup.recorded["squeue"] == 3
        assert monitor.take_live() is None  # the catch-up took this poll's jobs
    finally:
        stop.set()


def test_without_a_follower_the_poll_reads_the_pending_jobs_alone(svc):
    cli = QueueCli()
    cli.rows = [row(61, "PENDING", "(null)"), row(62, "RUNNING", "(null)")]
    monitor = QueueMonitor(cli, svc.handler.cfg)
    state = monitor.poll_once()
    assert state is not None and state.pending_gpus == 1
    assert [c[:5] for c in cli.squeues()] == [["squeue", "-h", "-a", "-t", "PENDING"]]
    assert monitor.take_live() is None
