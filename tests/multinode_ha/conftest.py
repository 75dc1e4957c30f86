"""Two controllers (contrib/dev-cluster/controllers.sh): ctl1 (primary) and ctl2 (backup), each in
namespaces of its own with its slurmctld and swapaware service, sharing StateSaveLocation, and two
compute nodes; the history on the cluster's MariaDB (bridge side). Started once for this suite from
an empty state, on ports, subnet and bridge of its own."""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from tests.slurm_stack import Stack, start_stack, state_dir, tail_of

SUBNET = "10.76.0"
PORTS = {"SWAPAWARE_CTLD_PORT": "27817", "SWAPAWARE_SLURMD_PORT": "27818", "SWAPAWARE_DBD_PORT": "27819",
         "SWAPAWARE_DB_PORT": "27816", "SWAPAWARE_GRPC_PORT": "56661"}
CTLD_TIMEOUT_S = 5


def _tails(state: Path, lines: int = 60) -> str:
    """The last lines of each controller's and node's Slurm log and of each controller's service
    (the state is purged after the suite:
    a failure in CI keeps these, printed to the suite's output)."""
    out = []
    for log in (sorted(state.glob("nodes/*/run/slurmctld.log")) + sorted(state.glob("nodes/*/slurmd.log"))
                + sorted(state.glob("log/swapaware-ctl*.log"))):
        text = tail_of(log, lines)
        out.append(f"==== {log.relative_to(state)} (last {len(text)} lines)\n" + "\n".join(text))
    return "\n".join(out) + "\n"


@pytest.fixture(scope="session")
def ha_cluster(request) -> Stack:
    s = start_stack(state_dir("ha"), PORTS, "--nodes", "2", SWAPAWARE_DEV_CONTROLLERS="2",
                    SWAPAWARE_DEV_SUBNET=SUBNET, SWAPAWARE_DEV_BRIDGE="swabr6",
                    SWAPAWARE_DEV_CTLD_TIMEOUT=str(CTLD_TIMEOUT_S), SWAPAWARE_SLURMD_TIMEOUT="20")
    yield s
    if request.session.testsfailed:  # the suite's output is all CI keeps: written past pytest's capture
        # (a session fixture's teardown runs captured: a plain write to fd 2 was swallowed)
        capture = request.config.pluginmanager.getplugin("capturemanager")
        with capture.global_and_fixture_disabled():
            os.write(2, _tails(s.state).encode())
        _keep_logs(s.state)
    s.stack("down", "--purge")


def _keep_logs(state: Path) -> None:
    """SWAPAWARE_KEEP_FAILED=DIR (a stress run's choice; unset in CI): every log of the failed
    suite's cluster copied to DIR/ha-<time> before the state is purged."""
    where = os.environ.get("SWAPAWARE_KEEP_FAILED", "")
    if not where:
        return
    dest = Path(where) / f"ha-{time.strftime('%Y%m%d-%H%M%S')}"
    for log in state.rglob("*.log"):
        if log.is_file():
            target = dest / log.relative_to(state)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(log, target)
    os.write(2, f"\n[ha] the cluster's logs kept in {dest}\n".encode())
