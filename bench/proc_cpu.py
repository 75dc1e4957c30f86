"""CPU time of one process from the kernel's own account: utime + stime of every thread of it,
from /proc/<pid>/stat (what holds still on a shared machine, unlike latency)."""
from __future__ import annotations

import os
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """Seconds of CPU ``pid`` has used so far (0.0 once it is gone)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return 0.0
    fields = text.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime (fields 14 and 15)
