"""Slurm's own records are the decision log (issue 21, item 2), on the real cluster: the service
publishes its admission table, slurmctld's job_submit.lua decides a burst of jobs from it, the
service is SIGKILLed mid-burst (the plugin goes on deciding from the table while it is down) and
started again; once it has caught up, every decision id in Slurm's AdminComments is in the history
exactly once and the history holds none Slurm does not, and a table-made job that ran has its
observation tied to its decision."""
from __future__ import annotations

import dataclasses
import os
import signal
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from tests.waiting import wait_for

from .conftest import decision_of, job_field
from .test_admission_table import SCRIPT, WHERE, plugin_table

pytestmark = pytest.mark.integration
JOBS = int(os.environ.get("SWAPAWARE_CATCHUP_BURST", "300"))  # jobs in the burst (bench: more)
RUNNING, SUBMITTERS = 6, 8


def slurm_ids(stack, name: str) -> dict[str, str]:
    """decision id -> AdminComment of every job named ``name`` slurmctld or the accounting holds."""
    live = stack.run("squeue", "-h", "-a", "-t", "all", "-n", name, "-O", "admin_comment:").stdout
    acct = stack.run("sacct", "-a", "-X", "-n", "-P", "-D", "-S", "now-1hours", "-E", "now", "-s",
                     "PD,R,RQ,RS,S,CA,CD,DL,F,NF,OOM,PR,TO,BF,RV", "--name", name, "-o", "AdminComment").stdout
    out = {}
    for line in (live + acct).splitlines():
        d = decision_of(line.strip()).get("id")
        if d:
            out[d] = line.strip()
    return out


def alive(pid: int) -> bool:
    """Whether the process is there, as dev-stack.sh's ``kill -0`` sees it (a zombie too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def history_ids(stack, name: str) -> list[str]:
    with stack.history() as db:
        return [r[0] for r in db.execute("SELECT decision_id FROM decisions WHERE job_name=?", (name,))]


def test_a_burst_decided_from_the_table_reaches_the_history_once_across_a_sigkill(stack):
    """The held burst is one class; the few jobs that run and end between polls are another, in
    another account and partition: an observation drops from the table every class whose decision
    read a history key it teaches (admission/publish.py, ``learning``), and the burst's
    class, with no history of its own, reads its user+name, account and partition keys."""
    name = f"catchup-{uuid.uuid4().hex[:6]}"
    runner = f"{name}-run"
    args = ("--gres=gpu:1", f"--job-name={name}", *WHERE)
    run_args = ("--gres=gpu:1", f"--job-name={runner}", "--partition=gpudef")  # account "(none)"
    table = stack.state / "run" / "admission.json"
    env = {"SWAPAWARE_ADMISSION__TABLE_PATH": str(table), "SWAPAWARE_ADMISSION__REFRESH_S": "1"}
    pidfile = stack.state / "run" / "swapaware.pid"
    with stack.service_with(**env), plugin_table(stack, table):
        for how in (args, run_args):
            rpc = decision_of(job_field(stack.held(SCRIPT, *how), "AdminComment"))
            assert rpc.get("id") and "tbl" not in rpc  # each class is decided once over the socket ...

            def by_table(how=how):  # ... then published, and slurmctld decides it alone
                return "tbl" in decision_of(job_field(stack.held(SCRIPT, *how), "AdminComment"))

            wait_for(by_table, 90, "the class in the published table, used by slurmctld", 1.0)
        stack.run("scancel", "-n", runner, check=False)

        def submit(i: int) -> tuple[int, str, str]:
            runs = i % (JOBS // RUNNING) == 0  # a few run and end between polls
            try:  # the same script as the class's: its fingerprint is part of the table's key
                job = stack.sbatch(SCRIPT, *(run_args if runs else ("--hold", *args)), "--output=/dev/null")
                return job, "" if runs else "--hold", ""
            except AssertionError as exc:
                return 0, "", str(exc)

        killed_at = restarted_at = 0.0
        with ThreadPoolExecutor(SUBMITTERS) as pool:
            results = list(pool.map(submit, range(JOBS // 3)))
            pid = int(pidfile.read_text())
            os.kill(pid, signal.SIGKILL)  # mid-burst
            killed_at = time.monotonic()
            results += list(pool.map(submit, range(JOBS // 3, 2 * JOBS // 3)))  # decided with the service down
            wait_for(lambda: not alive(pid), 10, f"the killed service (pid {pid}) to be gone", 0.05)
            dataclasses.replace(stack, env={**stack.env, **env}).stack("service-start")
            restarted_at = time.monotonic()
            results += list(pool.map(submit, range(2 * JOBS // 3, JOBS)))
        burst_end = time.monotonic()
        try:
            failed = [err for _, _, err in results if err]
            assert not failed, failed[:3]
            # Every held job submitted before the restart is decided by the table, through the outage
            # too. After it the new service removes the last process's table at the first observation
            # of a run until it has published its own (it cannot tell which entries that run taught):
            # those jobs may take the round trip.
            held = sum(1 for i, (_, hold, _) in enumerate(results) if hold and i < 2 * JOBS // 3)
            in_slurm = {**slurm_ids(stack, name), **slurm_ids(stack, runner)}
            made = {d for d, c in in_slurm.items() if "tbl" in decision_of(c)}
            burst_made = {d for d, c in slurm_ids(stack, name).items() if "tbl" in decision_of(c)}
            assert len(burst_made) >= held, f"only {len(burst_made)} of {held} held burst jobs submitted before the " \
                                            "restart were decided from the table"

            def recorded_ids() -> list[str]:
                return history_ids(stack, name) + history_ids(stack, runner)

            missing = len(set(in_slurm) - set(recorded_ids()))
            wait_for(lambda: set(recorded_ids()) >= set(in_slurm), 120,
                     lambda: f"{len(set(in_slurm) - set(recorded_ids()))} decisions to be caught up", 0.2)
            caught_s, after_restart = time.monotonic() - burst_end, time.monotonic() - restarted_at
            recorded = recorded_ids()
            assert len(recorded) == len(set(recorded))
            assert set(recorded) == set(in_slurm) | set(slurm_ids(stack, name)) | set(slurm_ids(stack, runner)), \
                "the history holds decisions Slurm does not"
            print(f"\n{len(made)} table-made decisions ({len(in_slurm)} in all), service SIGKILLed and down "
                  f"{restarted_at - killed_at:.1f} s mid-burst; {missing} not in the history when the burst ended, "
                  f"all {caught_s:.1f} s later ({after_restart:.1f} s after the restart)")
            starts = [ln for ln in (stack.state / "log" / "swapaware.log").read_text(errors="replace").splitlines()
                      if "catch-up at start" in ln]
            print(starts[-1] if starts else "no catch-up at start logged")
            with stack.history() as db:
                reasons = [r.code for (blob,) in db.execute(
                    "SELECT decision_pb FROM decisions WHERE job_name IN (?, ?)", (name, runner))
                    for r in pb.Decision.FromString(blob).reasons]
            assert "table_gone" not in reasons and reasons.count("table_decided") == len(made)
            ran = [job_id for job_id, hold, _ in results if not hold]
            assert ran
            by_table = 0
            for job_id in ran:  # the first of them from the table; after its run, its class left the table
                stack.wait_done(job_id, 180)
                comment = stack.sacct_admin_comment(job_id)
                if not decision_of(comment):  # its class out of the table while the service was down: as typed
                    continue
                by_table += "tbl=" in comment
                assert stack.wait_observation(job_id, 60)[0] == decision_of(comment)["id"]
            assert by_table, "no job that ran was decided from the table"
        finally:
            stack.run("scancel", "-n", name, check=False)
            stack.run("scancel", "-n", runner, check=False)
