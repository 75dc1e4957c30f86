"""The dev cluster's and dev stack's pid files name their own daemons only. A pid file left by a
daemon that died or was killed may name a pid the kernel has since given to another process (pids
wrap at pid_max within minutes of a test run, and every cluster of a CI run shares one pid space):
contrib/dev-cluster/processes.sh's is_daemon asks that the process have run when its pid file was
written (the daemons write their own, once running), contrib/dev-stack-daemons.sh's pid_alive that
it started when start_daemon wrote beside the pid file (PIDFILE.start: known from the fork on,
where the environment changes at exec). Run for real: a process named like the daemon (a copy of
sleep), its pid file written before or after it started."""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PROCESSES = ROOT / "contrib" / "dev-cluster" / "processes.sh"
DAEMONS = ROOT / "contrib" / "dev-stack-daemons.sh"


@pytest.fixture
def spawn(tmp_path):
    """spawn(name, env) -> a live process whose comm is ``name``, with ``env`` added; ended afterwards."""
    procs: list[subprocess.Popen] = []

    def start(name: str, env: dict[str, str]) -> int:
        exe = tmp_path / "bin" / name
        exe.parent.mkdir(exist_ok=True)
        if not exe.exists():
            shutil.copy(shutil.which("sleep"), exe)
        p = subprocess.Popen([str(exe), "300"], env={**os.environ, **env})
        procs.append(p)
        return p.pid

    yield start
    for p in procs:
        p.kill()
        p.wait()


def bash(script: str, **env: str) -> str:
    return subprocess.run(["bash", "-c", script], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=60, check=True).stdout.strip()


def test_a_pid_file_names_only_a_daemon_that_ran_when_it_was_written(spawn, tmp_path):
    """A pid file the daemon wrote names it; one written before the process its pid now names
    started (a daemon that died, its pid given to another cluster's daemon since) names none."""
    ours = spawn("slurmctld", {})
    run = tmp_path / "run"
    run.mkdir()
    pidfile = run / "slurmctld.pid"
    pidfile.write_text(f"{ours}\n")  # written while it runs, as slurmctld writes its own
    probe = f'set -euo pipefail; source {PROCESSES}; RUN={run}; '
    assert bash(probe + "pid_of slurmctld") == str(ours)
    assert bash(probe + f"is_daemon {ours} munged || echo no") == "no"  # another daemon's name
    long_ago = time.time() - 3600    # the same pid file as a daemon that died an hour ago left it
    os.utime(pidfile, (long_ago, long_ago))
    assert bash(probe + "pid_of slurmctld || echo none") == "none"
    assert bash(probe + f"is_daemon {ours} slurmctld && echo yes") == "yes"  # (no pid file: the name alone)


def test_environ_has_holds_under_pipefail_with_a_large_environment(spawn):
    """kill_stray_steps knows this cluster's slurmstepds by SLURM_CONF in their environment;
    cluster.sh runs with pipefail. Read through ``tr | grep -q`` it failed whenever grep exited at
    its match while tr still wrote (23 of 1,000 reads of a 7 KB environment)."""
    conf = "/var/tmp/swapaware-test-2205/etc/slurm.conf"
    pid = spawn("slurmstepd", {"SLURM_CONF": conf, "ZZ_LARGE": "x" * 6000})
    out = bash(f'set -euo pipefail; source {PROCESSES}; n=0; '
               f'for i in $(seq 1 300); do environ_has {pid} SLURM_CONF={conf} && n=$((n+1)); done; '
               f'environ_has {pid} SLURM_CONF={conf}.other || echo $n')
    assert out == "300"


def start_time(pid: int) -> str:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2:].split()[19]  # field 22


def test_a_stale_service_pid_file_stops_and_blocks_nothing(spawn, tmp_path):
    pidfile = tmp_path / "run" / "swapaware.pid"
    start = Path(f"{pidfile}.start")
    pidfile.parent.mkdir()
    stranger = spawn("slurmctld", {})  # what the kernel gave the dead service's pid to
    pidfile.write_text(f"{stranger}\n")
    start.write_text(f"{int(start_time(stranger)) - 1}\n")  # the dead service's start time
    out = bash(f'source {DAEMONS}; log() {{ echo "$*"; }}; pid_alive {pidfile} && echo alive || echo dead; '
               f'stop_daemon swapaware {pidfile}')
    assert out.splitlines()[0] == "dead"
    assert Path(f"/proc/{stranger}").exists()  # not signalled
    assert not pidfile.exists() and not start.exists()
    ours = spawn("swapaware", {})
    pidfile.write_text(f"{ours}\n")
    start.write_text(start_time(ours) + "\n")  # as start_daemon writes them
    out = bash(f'source {DAEMONS}; log() {{ echo "$*"; }}; pid_alive {pidfile} && echo alive || echo dead; '
               f'stop_daemon swapaware {pidfile}')
    assert out.splitlines() == ["alive", "stopped swapaware"]
    assert not pidfile.exists() and not start.exists()


def test_a_daemon_is_its_own_from_the_fork_on(tmp_path):
    """pid_alive holds at once after start_daemon, before the command has exec'd (what dev-stack's
    wait_service asks first: the daemon's environment, read then, was still the shell's), and a
    second start_daemon starts nothing."""
    pidfile = tmp_path / "run" / "thing.pid"
    out = bash(f'source {DAEMONS}; log() {{ echo "$*"; }}; LOGDIR={tmp_path}/log; CONF=/dev/null; '
               f'start_daemon thing {pidfile} bash -c "sleep 0.5; exec sleep 300"; '
               f'pid_alive {pidfile} && echo alive; '
               f'start_daemon thing {pidfile} sleep 300; stop_daemon thing {pidfile}; pid_alive {pidfile} || echo gone')
    lines = out.splitlines()
    assert lines[1] == "alive" and "already running" in lines[2] and lines[-1] == "gone", lines
    assert not Path(f"{pidfile}.start").exists()
