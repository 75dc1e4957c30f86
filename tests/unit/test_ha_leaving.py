"""The HA suite's watch of a controller leaving control (tests/multinode_ha/controllers.Leaving), on
real processes: one that exits is let be; one whose main thread waits on a futex forever (as
slurmctld's does in Slurm's lost wakeup in slurmscriptd_flush) is killed once LEAVE_S passed; one
alive but waiting elsewhere is left, and the outcome says where it waits."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.multinode_ha import controllers
from tests.multinode_ha.controllers import Leaving
from tests.waiting import wait_for

FUTEX_FOREVER = "import threading; print('up', flush=True); threading.Event().wait()"  # a condition nobody signals
SLEEPING = "import time; print('up', flush=True); time.sleep(600)"  # alive, waiting in a timer
EXITING = "import time; print('up', flush=True); time.sleep(0.5)"


def started(code: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "up"
    return proc


@pytest.fixture(autouse=True)
def short_leave(monkeypatch):
    monkeypatch.setattr(controllers, "LEAVE_S", 1.0)


def watched(proc: subprocess.Popen) -> Leaving:
    leaving = Leaving(str(proc.pid), "ctl1", "scontrol takeover")
    leaving.start()
    leaving.join(30)
    assert not leaving.is_alive()
    return leaving


def test_a_controller_that_exits_is_let_be() -> None:
    proc = started(EXITING)
    leaving = Leaving(str(proc.pid), "ctl1", "scontrol takeover")
    leaving.start()
    proc.wait(10)  # reaped here, as the cluster's init reaps an exited slurmctld
    leaving.join(30)
    assert leaving.outcome == "exited"


def test_a_controller_whose_main_thread_waits_on_a_futex_forever_is_killed() -> None:
    proc = started(FUTEX_FOREVER)
    try:
        wait_for(lambda: "futex" in controllers._main_thread_waits(str(proc.pid)), 10, "its main thread waiting",
                 0.05)
        leaving = watched(proc)
        assert "killed" in leaving.outcome, leaving.outcome
        assert proc.wait(10) == -9
    finally:
        proc.kill()


def test_a_controller_alive_elsewhere_is_left_with_where_it_waits() -> None:
    proc = started(SLEEPING)
    try:
        leaving = watched(proc)
        assert leaving.outcome.endswith(": left") and "futex" not in leaving.outcome, leaving.outcome
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait(10)


def test_nothing_to_watch_where_the_controller_was_not_running() -> None:
    leaving = Leaving("", "ctl1", "scontrol takeover")
    leaving.start()
    leaving.join(5)
    assert leaving.outcome == "not running"
