"""Two controllers (contrib/dev-cluster/controllers.sh): ctl1 (primary) and ctl2 (backup), each in
namespaces of its own with its slurmctld and swapaware service, sharing StateSaveLocation, and two
compute nodes; the history on the cluster's MariaDB (bridge side). Started once for this suite from
an empty state, on ports, subnet and bridge of its own."""
from __future__ import annotations

import pytest

from tests.slurm_stack import Stack, start_stack, state_dir

SUBNET = "10.76.0"
PORTS = {"SWAPAWARE_CTLD_PORT": "27817", "SWAPAWARE_SLURMD_PORT": "27818", "SWAPAWARE_DBD_PORT": "27819",
         "SWAPAWARE_DB_PORT": "27816", "SWAPAWARE_GRPC_PORT": "56661"}
CTLD_TIMEOUT_S = 5


@pytest.fixture(scope="session")
def ha_cluster() -> Stack:
    s = start_stack(state_dir("ha"), PORTS, "--nodes", "2", SWAPAWARE_DEV_CONTROLLERS="2",
                    SWAPAWARE_DEV_SUBNET=SUBNET, SWAPAWARE_DEV_BRIDGE="swabr6",
                    SWAPAWARE_DEV_CTLD_TIMEOUT=str(CTLD_TIMEOUT_S), SWAPAWARE_SLURMD_TIMEOUT="20")
    yield s
    s.stack("down", "--purge")
