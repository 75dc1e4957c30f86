"""bench/idle_cpu.py: a process's CPU per thread from schedstat, beside what one wakeup costs."""
import os
import re
import subprocess
import sys
import threading

from tests.unit.bench_loader import load_bench

bench = load_bench("idle_cpu")


def test_a_busy_thread_counts_and_an_idle_one_does_not():
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            pass
    t = threading.Thread(target=spin, daemon=True)
    t.start()
    try:
        before = bench.thread_cpu_ns(os.getpid())
        stop.wait(0.3)
        after = bench.thread_cpu_ns(os.getpid())
    finally:
        stop.set()
        t.join()
    assert after[t.native_id][1] - before[t.native_id][1] > 10_000_000  # it ran (> 10 ms of the 300)


def test_it_prints_the_wakeup_cost_and_another_process_by_thread(capsys):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert bench.main(["--pid", str(sleeper.pid), "--seconds", "1", "--period", "0.1"]) == 0
    finally:
        sleeper.kill()
        sleeper.wait()
    out = capsys.readouterr().out
    cost = re.search(r"Event.wait\(0.1\)\): ([0-9.]+) us of CPU per wakeup \((\d+) wakeups", out)
    assert cost and float(cost.group(1)) > 0 and int(cost.group(2)) >= 5, out
    assert re.search(rf"pid {sleeper.pid}: [0-9.]+ us of CPU per second", out), out
