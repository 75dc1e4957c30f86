"""CPU time of one process (or one of its threads) from the kernel's own account: utime + stime,
from /proc/<pid>/stat (all its threads) or /proc/<pid>/task/<tid>/stat (one): what holds still on a
shared machine, unlike latency."""
from __future__ import annotations

import os
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def stat_times_s(stat: Path) -> tuple[float, float]:
    """(user, system) seconds of CPU of the process or thread whose stat file is ``stat``
    (FileNotFoundError once gone)."""
    fields = stat.read_text().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return int(fields[11]) / TICK, int(fields[12]) / TICK  # utime, stime (fields 14 and 15)


def stat_cpu_s(stat: Path) -> float:
    """Seconds of CPU of the process or thread whose stat file is ``stat`` (FileNotFoundError once gone)."""
    return sum(stat_times_s(stat))


def pid_times_s(pid: int) -> tuple[float, float]:
    """(user, system) seconds of CPU ``pid`` (all its threads) has used so far; (0, 0) once it is gone."""
    try:
        return stat_times_s(Path(f"/proc/{pid}/stat"))
    except FileNotFoundError:
        return 0.0, 0.0


def user_cpu_s(pid: int) -> float:
    """Seconds of CPU ``pid`` has used in user space (utime alone); 0.0 once it is gone."""
    return pid_times_s(pid)[0]


def cpu_s(pid: int) -> float:
    """Seconds of CPU ``pid`` (all its threads) has used so far; 0.0 once it is gone."""
    return sum(pid_times_s(pid))
