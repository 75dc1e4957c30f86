"""Multi-node fixtures: a controller plus three compute nodes (contrib/dev-stack.sh up --nodes 3),
each node in namespaces of its own with its own slurmd, munged, agent, spool and fake GPUs, on its
own state directory and ports, started once for this suite from an empty history and accounting.
Nodes answer Slurm within SlurmdTimeout=20 s here, so that a node failure is seen in the suite's
time."""
from __future__ import annotations

import pytest

from tests.slurm_stack import Stack, start_stack, state_dir

NODES = ("node1", "node2", "node3")
PORTS = {"SWAPAWARE_CTLD_PORT": "26817", "SWAPAWARE_SLURMD_PORT": "26818", "SWAPAWARE_DBD_PORT": "26819",
         "SWAPAWARE_DB_PORT": "26816", "SWAPAWARE_GRPC_PORT": "56651"}


@pytest.fixture(scope="session")
def cluster() -> Stack:
    s = start_stack(state_dir("mn"), PORTS, "--nodes", str(len(NODES)), SWAPAWARE_SLURMD_TIMEOUT="20")
    yield s
    s.stack("down", "--purge")
