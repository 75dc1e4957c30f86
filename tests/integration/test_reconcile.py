"""Reconciliation against the real accounting: decisions of jobs Slurm holds (pending) or held
(held and cancelled: only the accounting has those) are marked held, and a recorded decision that
no job carries is marked never held."""
from __future__ import annotations

import json
import socket
import uuid

from policy_service.slurm.slurm_text import decision_ids_in
from tests.waiting import wait_for


def _recorded_admit_without_a_job(sock_path: str, name: str) -> str:
    """An Admit from root over the local socket (recorded, as slurmctld's would be) that no job follows."""
    line = json.dumps({"method": "Admit", "request": {"job": {"user": "root", "uid": 0, "jobName": name,
                                                              "tresPerNode": "gres:gpu:1"}}}).encode() + b"\n"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(sock_path)
        s.sendall(line)
        reply = json.loads(s.makefile("rb").readline())
    return reply["response"]["decision"]["decisionId"]


def _decision_ids_named(stack, name: str) -> set[str]:
    with stack.history() as db:
        return {r[0] for r in db.execute("SELECT decision_id FROM decisions WHERE job_name=?", (name,))}


def test_held_and_never_held_decisions_are_told_apart(stack):
    """Held jobs (pending, or cancelled: only the accounting has those) are marked held; a recorded
    Admit no job followed is marked never held and its record deleted. An ``sbatch --test-only``
    (slurmctld runs job_submit for it exactly as for a real submission) records nothing at all:
    cli_filter marks it and job_submit leaves it as typed."""
    tag = f"recon-{uuid.uuid4().hex[:6]}"
    with stack.service_with(SWAPAWARE_SERVICE__RECONCILE_S="2", SWAPAWARE_SERVICE__RECONCILE_SETTLE_S="3"):
        for i in range(12):
            stack.run("sbatch", "--parsable", "--hold", "--gres=gpu:1", f"--job-name={tag}-{i % 2}", "--wrap=true",
                      "--output=/dev/null")
        held = decision_ids_in(stack.run("squeue", "-h", "-t", "PD", "-n", f"{tag}-0,{tag}-1", "-O",
                                         "admin_comment:").stdout)
        assert len(held) == 12
        stack.run("scancel", "-n", f"{tag}-1")  # held, then cancelled: only the accounting has these
        orphan = _recorded_admit_without_a_job(str(stack.state / "run" / "swapaware.sock"), f"{tag}-orphan")
        test_only = stack.run("sbatch", "--test-only", "--gres=gpu:1", f"--job-name={tag}-test", "--wrap=true")
        assert "to start at" in test_only.stderr, test_only.stderr  # answered, no job made
        watched = held | {orphan}

        def status() -> dict[str, str]:
            with stack.history() as db:
                rows = db.execute(f"SELECT decision_id, status FROM decision_status WHERE decision_id IN "
                                  f"({','.join('?' * len(watched))})", sorted(watched)).fetchall()
            return dict(rows)

        wait_for(lambda: len(status()) == 13, 120, lambda: f"13 decisions to be reconciled: {status()}")
        got = status()
        assert {d for d, s in got.items() if s == "held"} == held
        assert {d for d, s in got.items() if s == "never_held"} == {orphan}
        assert _decision_ids_named(stack, f"{tag}-test") == set() == _decision_ids_named(stack, f"{tag}-orphan")
        assert len(_decision_ids_named(stack, f"{tag}-0") | _decision_ids_named(stack, f"{tag}-1")) == 12
        r = stack.swapaware("explain", "--decision", orphan, check=False)
        assert r.returncode != 0 and "never held" in r.stdout + r.stderr, r
        stack.run("scancel", "-n", f"{tag}-0", check=False)
