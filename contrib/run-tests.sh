#!/usr/bin/env bash
# The whole test suite on a fresh Debian 12 machine (as root): installs what it needs
# (Slurm 22.05, munge, MariaDB, Lua 5.1 + lua-socket + lua-cjson, a Python venv), then runs
# unit, adapter and integration tests. The integration tests start their own real Slurm
# (state in /var/tmp/swapaware-test, ports 16816-16819 and 56551) and stop it at the end.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$ROOT/contrib/dev-cluster/cluster.sh" install
bash "$ROOT/contrib/dev-stack.sh" venv
VENV=${SWAPAWARE_VENV:-$ROOT/.venv}
cd "$ROOT"
exec "$VENV/bin/python" -m pytest tests "$@"
