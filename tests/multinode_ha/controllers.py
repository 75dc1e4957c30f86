"""The two controllers of the HA suite (contrib/dev-cluster/controllers.sh): which one is in
control, each one's role as its PrimaryOnProg/OffProg wrote it, the services' writer lease, bringing
ctl1 back in control with every node answering it, a controller leaving control (and Slurm's hang
there), and what a wait that ran out is explained by (sinfo's error, a munge round trip, each
slurmctld from /proc, the logs' last lines)."""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

from tests.slurm_stack import CLUSTER, Stack, proc_state, tail_of
from tests.waiting import wait_for


def cluster_cmd(stack: Stack, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return stack.run("bash", str(CLUSTER), *args, check=check, timeout=120)


def in_control(stack: Stack) -> str:
    return cluster_cmd(stack, "in-control", check=False).stdout.strip()


def ctl_running(stack: Stack, ctl: str) -> bool:
    return bool(cluster_cmd(stack, "ctl-pid", ctl, check=False).stdout.strip())


def role_of(stack: Stack, ctl: str) -> str:
    """What the last PrimaryOnProg/OffProg on ``ctl`` wrote ("primary", "backup"; "" before any)."""
    try:
        return (stack.state / "nodes" / ctl / "run" / "role").read_text().split()[0]
    except (OSError, IndexError):
        return ""


def ha_status(stack: Stack) -> str:
    return stack.swapaware("ha", "status", check=False).stdout


def backup_on_at(stack: Stack) -> float:
    """When SlurmctldPrimaryOnProg last ran on ctl2 (its role file: "primary <time>")."""
    role, at = (stack.state / "nodes" / "ctl2" / "run" / "role").read_text().split()[:2]
    assert role == "primary", role
    return float(at)


# A controller leaving control (the primary at `scontrol takeover`, told REQUEST_SHUTDOWN by the
# backup; the backup when the primary takes control back) ends its term with slurmscriptd_flush().
# In Slurm 22.05.8 and 24.11.5 (Debian 12's and 13's) that call can wait forever: the main thread
# writes its request to slurmscriptd, then takes the answer's mutex and waits on its condition with
# no predicate, so an answer signalled in between is lost (SchedMD ticket 21875; fixed in 24.11.6
# and 25.05). Reproduced by holding the main thread's writes (docs/slurm-releases.md, "A controller
# leaving control can hang"). The process stays alive, its heartbeat thread still writing, and on
# 24.11 its listening socket open: every Slurm command connects to it first, times out after
# MessageTimeout and never tries the other controller. It is killed here, as an admin would.
LEAVE_S = 45.0  # a controller leaving control saves its state and exits in seconds (restore_primary: the same)


def _started(pid: str) -> str:
    """The process's start time (/proc/<pid>/stat field 22); "" when there is no such process, or
    only its exit status is left (a zombie its parent has not reaped)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return "" if fields[0] == "Z" else fields[19]
    except (OSError, IndexError):
        return ""


def _main_thread_waits(pid: str) -> str:
    """Where ``pid``'s main thread waits in the kernel (/proc/<pid>/task/<pid>/wchan)."""
    try:
        return Path(f"/proc/{pid}/task/{pid}/wchan").read_text()
    except OSError:
        return "gone"


class Leaving(threading.Thread):
    """Watches ``ctl``'s slurmctld (``pid``), which is to exit now, from when it is made: one still there
    LEAVE_S later with its main thread waiting on a futex is Slurm's lost wakeup above, killed (and
    said); one there waiting elsewhere is left for the test to fail on, with ``outcome`` saying so."""

    def __init__(self, pid: str, ctl: str, what: str) -> None:
        super().__init__(daemon=True, name=f"leaving-{ctl}")
        self.pid, self.ctl, self.what = pid, ctl, what
        self.began = _started(self.pid) if self.pid else ""
        self.outcome = ""

    def run(self) -> None:
        if not self.pid:
            self.outcome = "not running"
            return
        gone = lambda: _started(self.pid) != self.began  # noqa: E731 (a pid taken again is another process)
        try:
            wait_for(gone, LEAVE_S, "", 0.2)
            self.outcome = "exited"
            return
        except AssertionError:
            pass
        waits = _main_thread_waits(self.pid)
        if "futex" not in waits:
            self.outcome = f"alive {LEAVE_S:.0f} s after {self.what}, its main thread waiting in {waits!r}: left"
            print(f"\n[ha] {self.ctl}'s slurmctld (pid {self.pid}) {self.outcome}")
            return
        os.kill(int(self.pid), signal.SIGKILL)
        wait_for(gone, 15, f"{self.ctl}'s slurmctld gone", 0.2)
        self.outcome = (f"alive {LEAVE_S:.0f} s after {self.what}, its main thread waiting on a futex (Slurm's lost "
                        f"wakeup in slurmscriptd_flush): killed")
        print(f"\n[ha] {self.ctl}'s slurmctld (pid {self.pid}) {self.outcome}")


def takeover(stack: Stack) -> Leaving:
    """`scontrol takeover`: ctl2 takes control and ctl1's slurmctld shuts down and exits, watched
    (Leaving) from here on while the caller goes on (join() it to wait for ctl1's end)."""
    leaving = Leaving(cluster_cmd(stack, "ctl-pid", "ctl1", check=False).stdout.strip(), "ctl1", "scontrol takeover")
    stack.run("scontrol", "takeover")
    leaving.start()
    return leaving


def restore_primary(stack: Stack) -> None:
    """ctl1 running and in control again (22.05's `scontrol takeover` stops the primary), and every
    node registered with it and answering (wait_nodes_back)."""
    if not ctl_running(stack, "ctl1"):
        cluster_cmd(stack, "start-ctl", "ctl1")
    wait_for(lambda: in_control(stack) == "ctl1", 60, lambda: f"ctl1 in control (now: {in_control(stack)!r})", 0.5)
    # A primary back from a cut tells the backup to give up (its PrimaryOffProg): until then both act
    # as primary, and a job one of them made may be unknown to the other. 22.05's backup was seen to
    # hang there ("REQUEST_CONTROL reply but backup not completely done relinquishing control") and
    # exit without its OffProg: then it is started again, as the backup. That is the lost wakeup
    # above: the backup leaving control runs the same slurmscriptd_flush() before its OffProg.
    # (hung: alive 29 s after REQUEST_CONTROL, still primary, answering nothing: killed by its pid)
    try:
        wait_for(lambda: role_of(stack, "ctl2") != "primary" or not ctl_running(stack, "ctl2"), 45,
                 "ctl2's PrimaryOffProg or its exit", 0.5)
    except AssertionError:
        pid = cluster_cmd(stack, "ctl-pid", "ctl2", check=False).stdout.strip()
        print(f"\n[ha] ctl2's slurmctld (pid {pid}) hung giving control back: killed")
        if pid:
            stack.run("kill", "-KILL", pid, check=False)
        wait_for(lambda: not ctl_running(stack, "ctl2"), 15, "ctl2's slurmctld gone", 0.2)
    if not ctl_running(stack, "ctl2"):
        cluster_cmd(stack, "start-ctl", "ctl2")
        wait_for(lambda: role_of(stack, "ctl2") == "backup", 30, "ctl2 standing by", 0.5)
    wait_writer(stack, "ctl1")
    wait_nodes_back(stack)


def wait_nodes_back(stack: Stack) -> None:
    """Every node registered with the controller in control (SlurmdStartTime, None until then: a
    restarted 22.05 slurmctld knows a node's shards only from its registration) and answering it.
    A primary cut off the network set the nodes DOWN (not responding) and takes them back at its
    next ping of them: 61 s after the uncut on 24.11 (measured; the next test's own 60 s wait for
    its nodes once ran out there). Within three SlurmdTimeouts."""
    def back() -> bool:
        states = stack.run("sinfo", "-h", "-N", "-o", "%T", check=False).stdout.split()
        nodes = stack.run("scontrol", "show", "node", "-o", check=False).stdout.splitlines()
        return (bool(states) and not any(st.endswith("*") or st.startswith(("down", "unk")) for st in states)
                and bool(nodes) and not any("SlurmdStartTime=None" in n for n in nodes))

    wait_for(back, 180, lambda: "every node registered and responding: " + stack.run("sinfo", "-N", check=False).stdout
             + stack.run("scontrol", "show", "node", "-o", check=False).stdout[-1500:] + unanswered(stack), 1.0)


def unanswered(stack: Stack, lines: int = 12) -> str:
    """Why Slurm's commands may read nothing: sinfo's exit and error, each controller's slurmctld
    (pid, role, state and where it waits, from /proc) and its log's last lines. A failure message
    is what CI keeps of a run: the suite's log tails printed after it may be cut."""
    try:
        r = stack.run("sinfo", "-h", "-N", check=False)
        out = [f"\n-- sinfo exited {r.returncode}: {r.stderr.strip()[-400:]!r}"]
    except Exception as exc:  # noqa: BLE001 - a report of a failure never fails itself
        out = [f"\n-- sinfo: {exc!r}"]
    sock = stack.state / "node" / "munge" / "munge.socket.2"
    try:  # a credential made and read on this side: what every command and controller RPC needs
        r = stack.run("sh", "-c", f"munge -S '{sock}' -n | unmunge -S '{sock}'", check=False, timeout=15)
        out.append(f"-- munge round trip here: exit {r.returncode} {r.stderr.strip()[-200:]!r}")
    except Exception as exc:  # noqa: BLE001
        out.append(f"-- munge round trip here: {exc!r}")
    for log in sorted(stack.state.glob("log/munged*.log")):
        out.append(f"-- {log.name}: " + " | ".join(tail_of(log, 3)))
    for ctl in ("ctl1", "ctl2"):
        try:
            pid = cluster_cmd(stack, "ctl-pid", ctl, check=False).stdout.strip()
        except Exception:  # noqa: BLE001
            pid = ""
        state = proc_state(pid, threads=True) if pid else "no slurmctld"
        log = stack.state / "nodes" / ctl / "run" / "slurmctld.log"
        out.append(f"-- {ctl}: slurmctld pid {pid or '-'} ({state}), role {role_of(stack, ctl) or '-'}; "
                   f"{log.name}:\n" + "\n".join(tail_of(log, lines)))
    return "\n".join(out)


def wait_writer(stack: Stack, ctl: str, timeout_s: float = 30) -> None:
    """``ctl``'s service holds the writer lease (``swapaware ha status``); when it does not in
    time, the message says what each service last decided of its role and why."""
    wait_for(lambda: f"writer lease: {ctl}" in ha_status(stack), timeout_s,
             lambda: f"{ctl} the writer: {ha_status(stack)}" + writers_report(stack), 0.5)


def writers_report(stack: Stack, lines: int = 8) -> str:
    """Each controller's role file, the shared heartbeat slurmctld writes, and the last lines its
    service logged of its role (what a lease that did not move is explained by)."""
    out = []
    try:
        hb = (stack.state / "spool" / "ctld" / "heartbeat").read_bytes()
        out.append(f"\n-- heartbeat: {hb.hex()} (written {time.time() - int.from_bytes(hb[:8], 'big'):.0f} s ago)"
                   if len(hb) == 16 else f"\n-- heartbeat: {len(hb)} bytes")
    except OSError as exc:
        out.append(f"\n-- heartbeat: {exc}")
    for ctl in ("ctl1", "ctl2"):
        try:
            role = (stack.state / "nodes" / ctl / "run" / "role").read_text().strip()
        except OSError as exc:
            role = str(exc)
        log = stack.state / "log" / f"swapaware-{ctl}.log"
        logged = tail_of(log, lines, lambda ln: "swapaware.ha" in ln or " ERROR " in ln)
        out.append(f"-- {ctl}: role file {role!r}; its service's role, as logged:\n" + "\n".join(logged))
        out.append(service_stacks(stack, ctl, log))
    out.append(history_sessions(stack))
    return "\n".join(out)


def history_sessions(stack: Stack) -> str:
    """The history server's sessions of the swapaware user (SHOW FULL PROCESSLIST: each one's host,
    command, seconds in it, state and statement): who holds or waits for the lease row."""
    from tests.multinode_ha.bursts import history_query

    try:
        rows = [" | ".join(str(v) for v in row[2:8]) for row in history_query(stack, "SHOW FULL PROCESSLIST")]
        return "-- the history's sessions (host | db | command | s | state | statement):\n" + "\n".join(rows)
    except Exception as exc:  # noqa: BLE001 - a report of a failure never fails itself
        return f"-- the history's sessions: {exc!r}"


def service_stacks(stack: Stack, ctl: str, log: Path) -> str:
    """Where each thread of ``ctl``'s service waits now: SIGUSR1 (`swapaware serve` registers
    faulthandler on it) writes every thread's stack to its log, read back from there."""
    try:
        pid = int((stack.state / "nodes" / ctl / "run" / "swapaware.pid").read_text().strip())
        before = log.stat().st_size

        def since() -> str:
            with log.open("rb") as f:
                f.seek(before)
                return f.read().decode(errors="replace")

        os.kill(pid, signal.SIGUSR1)
        wait_for(lambda: '  File "' in since(), 5, "the stacks in its log", 0.1)
        dump = since().splitlines()
        stacks = [ln for ln in dump if ln.startswith(("Thread 0x", "Current thread", "  File "))][:120]
        return f"-- {ctl}'s service (pid {pid}), its threads' stacks:\n" + "\n".join(stacks)
    except Exception as exc:  # noqa: BLE001 - a report of a failure never fails itself
        return f"-- {ctl}'s service's stacks: {exc!r}"
