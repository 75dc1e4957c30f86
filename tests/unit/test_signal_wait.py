"""signal_wait.SignalWait: a main loop's signals read from a pipe, the handler taking no lock. The
service's main loop used to wait on a threading.Event its SIGHUP / SIGTERM handlers set: a signal
handled while the main thread held that Event's lock (entering wait()) waited forever for it, and
the service never reloaded or stopped again. Each case runs in a process of its own (signals go to
its main thread)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

HELD = """
import os, signal, threading
from policy_service.signal_wait import SignalWait
signals = SignalWait((signal.SIGHUP, signal.SIGTERM))
lock = threading.Event()._cond
with lock:  # where a handler that set an Event waited forever
    os.kill(os.getpid(), signal.SIGHUP)
    os.kill(os.getpid(), signal.SIGTERM)
got = set()
while len(got) < 2:
    got |= signals.wait(5)
print(sorted(got))
assert signals.wait(0.05) == set()  # each signal once; then a timeout
signals.close()
"""

LATER = """
import os, signal
from policy_service.signal_wait import SignalWait
signals = SignalWait((signal.SIGHUP,))
os.kill(os.getpid(), signal.SIGHUP)  # before the loop waits: kept in the pipe
signals.add((signal.SIGUSR1,))
os.kill(os.getpid(), signal.SIGUSR1)
print(sorted(signals.wait(5)))
signals.close()
print(signal.set_wakeup_fd(-1))  # the previous wakeup fd (none) back
"""


def run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_a_signal_that_comes_while_the_main_thread_holds_a_lock_is_read_not_stuck():
    assert run(HELD) == ["[1,", "15]"]


def test_signals_that_came_before_the_wait_are_read_and_close_restores_the_wakeup_fd():
    assert run(LATER) == ["[1,", "10]", "-1"]
