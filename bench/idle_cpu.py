"""Where an idle process's CPU goes, thread by thread, and what one thread wakeup costs on this
machine (issue 33, the service's share of the controller's CPU).

For ``--pid`` (e.g. ``pgrep -f 'swapaware serve'``): each thread's CPU over ``--seconds`` from
/proc/<pid>/task/<tid>/schedstat (nanoseconds the kernel ran it; /proc's stat counts 10 ms ticks,
too coarse for threads that wake for microseconds), named by its ``comm``. Side by side, in this
process over the same window: a thread that only waits on ``Event.wait(--period)``, whose CPU per
wakeup is what the machine charges a thread for waking at all (on a VM that halts idle vCPUs it can
be far above the thread's own work). An idle service's CPU is then about its wakeups per second
times that figure.

    .venv/bin/python bench/idle_cpu.py --pid "$(pgrep -f 'swapaware serve' | head -1)" --seconds 60
"""
from __future__ import annotations

import argparse
import os
import threading
import time


def thread_cpu_ns(pid: int) -> dict[int, tuple[str, int]]:
    """tid -> (comm, nanoseconds run) of each thread of ``pid``."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                ran = int(f.read().split()[0])
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                comm = f.read().strip()
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread ended meanwhile
        out[int(tid)] = (comm, ran)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pid", type=int, help="the process to measure (default: this one's waiter alone)")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--period", type=float, default=0.5, help="the waiter's Event.wait timeout")
    args = ap.parse_args(argv)
    stop, wakeups = threading.Event(), [0]

    def waiter() -> None:
        while not stop.wait(args.period):
            wakeups[0] += 1
    t = threading.Thread(target=waiter, name="waiter", daemon=True)
    t.start()
    time.sleep(args.period * 2)
    mine = os.getpid()
    before, base = (thread_cpu_ns(args.pid) if args.pid else {}), thread_cpu_ns(mine)[t.native_id][1]
    woke = wakeups[0]
    time.sleep(args.seconds)
    after, spent = (thread_cpu_ns(args.pid) if args.pid else {}), thread_cpu_ns(mine)[t.native_id][1] - base
    stop.set()
    per_wakeup = spent / max(1, wakeups[0] - woke) / 1e3
    print(f"a thread that only waits (Event.wait({args.period:g})): {per_wakeup:.1f} us of CPU per wakeup "
          f"({wakeups[0] - woke} wakeups in {args.seconds:g} s)")
    if args.pid:
        rows = sorted(((after[k][1] - before.get(k, (None, after[k][1]))[1], k, after[k][0]) for k in after),
                      reverse=True)
        total = sum(r[0] for r in rows)
        print(f"pid {args.pid}: {total / 1e3 / args.seconds:.1f} us of CPU per second over {args.seconds:g} s, "
              f"about {total / 1e3 / args.seconds / per_wakeup:.1f} such wakeups' worth a second")
        for ran, tid, comm in rows:
            if ran > 0:
                print(f"  {ran / 1e3 / args.seconds:8.1f} us/s  {comm} ({tid})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
