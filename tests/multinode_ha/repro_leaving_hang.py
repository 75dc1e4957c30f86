"""Slurm's hang of a controller leaving control, reproduced on demand (not part of the suite: pytest
collects test_*.py; run this file by name). docs/slurm-releases.md, "A controller leaving control
can hang": in 22.05.8 and 24.11.5 slurmscriptd_flush() can wait forever when slurmscriptd's answer
comes between the main thread's request and its wait. Here every write of ctl1's main thread returns
3 s late (strace's syscall delay, the main thread alone), which opens that window, and then
`scontrol takeover` tells ctl1 to shut down. Printed: whether ctl1 is still alive 60 s later and
where its threads wait, three `sinfo`s from this side, and which controller the heartbeat names.

The host's release (strace installed here):
    SWAPAWARE_SUITES=multinode_ha bash contrib/matrix/run.sh 22.05 \
        .venv/bin/python -m pytest -s -p no:cacheprovider tests/multinode_ha/repro_leaving_hang.py
A release in its Debian root (no strace there): strace is attached from the host, which this script
asks for through /var/tmp/repro-pid (the pid to attach to) and waits for /var/tmp/repro-go:
    (R=/var/cache/swapaware-matrix/roots/trixie; rm -f $R/var/tmp/repro-*; \
     until [ -s $R/var/tmp/repro-pid ]; do sleep 0.5; done; \
     strace -e trace=write -e signal=none -e inject=write:delay_exit=3000000 -o /tmp/ctl1.strace \
         -p "$(cat $R/var/tmp/repro-pid)" & sleep 2; touch $R/var/tmp/repro-go; wait) &
    SWAPAWARE_SUITES=multinode_ha bash contrib/matrix/run.sh 24.11 env SWAPAWARE_STRACE_OUTSIDE=1 \
        /opt/swapaware/venv/bin/python -m pytest -s -p no:cacheprovider \
        tests/multinode_ha/repro_leaving_hang.py
Measured (2026-12-07): 22.05.8 and 24.11.5 hung (ctl1 alive 60 s on, the heartbeat naming it
again); on 24.11.5 each sinfo failed after 10.0 s with "Socket timed out on send/recv operation".
"""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

from tests.multinode_ha.controllers import cluster_cmd, in_control, restore_primary, role_of
from tests.slurm_stack import Stack, proc_state, tail_of
from tests.waiting import wait_for

HANG_S = 60  # how long after ctl2 took control ctl1 is looked at (a shutdown takes seconds)


def held(pid: str) -> subprocess.Popen | None:
    """ctl1's main thread with each write returning 3 s late (None: strace attached from outside)."""
    if os.environ.get("SWAPAWARE_STRACE_OUTSIDE"):
        Path("/var/tmp/repro-go").unlink(missing_ok=True)
        Path("/var/tmp/repro-pid").write_text(pid)
        wait_for(lambda: Path("/var/tmp/repro-go").exists(), 120, "strace attached from the host", 0.2)
        return None
    assert shutil.which("strace"), "strace is not installed here: see the docstring"
    proc = subprocess.Popen(["strace", "-e", "trace=write", "-e", "signal=none",
                             "-e", "inject=write:delay_exit=3000000", "-o", "/dev/null", "-p", pid],
                            stderr=subprocess.PIPE, text=True)
    assert "attached" in proc.stderr.readline()  # "strace: Process <pid> attached"
    return proc


def test_a_primary_held_after_its_flush_request_hangs(ha_cluster: Stack) -> None:
    stack = ha_cluster
    restore_primary(stack)
    pid = cluster_cmd(stack, "ctl-pid", "ctl1").stdout.strip()
    tracer = held(pid)
    t0 = time.monotonic()
    stack.run("scontrol", "takeover", check=False)
    wait_for(lambda: role_of(stack, "ctl2") == "primary", 90, "ctl2's PrimaryOnProg", 0.5)
    print(f"\n[repro] ctl2 in control (its OnProg ran) +{time.monotonic() - t0:.1f} s")
    wait_for(lambda: time.monotonic() - t0 > HANG_S or proc_state(pid) == "gone", HANG_S + 5, "", 1.0)
    if tracer is not None:
        tracer.terminate()
        tracer.wait(30)
    print(f"[repro] ctl1's slurmctld {pid}, {time.monotonic() - t0:.0f} s after the takeover: "
          f"{proc_state(pid, threads=True)}; the heartbeat names {in_control(stack)!r}")
    for i in range(3):
        t1 = time.monotonic()
        s = stack.run("sinfo", "-h", "-N", check=False, timeout=120)
        print(f"[repro] sinfo {i}: exit {s.returncode} after {time.monotonic() - t1:.1f} s, "
              f"{len(s.stdout.splitlines())} lines, error {s.stderr.strip()[-120:]!r}")
    log = stack.state / "nodes" / "ctl1" / "run" / "slurmctld.log"
    print("[repro] ctl1's log ends:\n" + "\n".join(tail_of(log, 5)))
    if proc_state(pid) != "gone":
        subprocess.run(["kill", "-KILL", pid], check=False)
