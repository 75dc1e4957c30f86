#!/bin/bash
# What swapaware costs the controller on one Slurm release (issue 33, item 7), on the real dev
# cluster, in three runs of interleaved modes (off: plugin off, service stopped; on: every GPU job
# a round trip; table: decided from the admission table):
#   1. bench/lua_phases.py: a table hit's time inside slurmctld (--whole: swapaware.submit timed
#      alone), then where it goes (each phase timed), from 1 and 8 submitters (LUA_ONLY=1: this alone);
#   2. bench/submit_burst.py, 4 submitters: CPU per submission of slurmctld and of the service (their
#      own pids), Lua us per job (on: the round trip, a miss; table: a hit), the decisions Slurm
#      holds against the history (lost, extra);
#   3. the same from 1 submitter: the sequential sbatch median.
# Run it in a release's root and namespace:
#   bash contrib/matrix/run.sh 26.05 bash bench/release_costs.sh
# BURST_JOBS (default 4500) and SEQ_JOBS (540): submissions of runs 2 and 3, over 3 modes x 3 rounds.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${SWAPAWARE_VENV:-.venv}/bin/python
rel=${SWAPAWARE_RELEASE:-host}
bash contrib/dev-cluster/cluster.sh install >/dev/null || { echo "cluster.sh install failed" >&2; exit 1; }
log=$(mktemp)
trap 'rm -f "$log"; bash contrib/dev-stack.sh down >/dev/null 2>&1' EXIT
bash contrib/dev-stack.sh up >"$log" 2>&1 || { tail -30 "$log" >&2; exit 1; }
echo "=== Slurm $rel: bench/lua_phases.py --whole (a table hit, swapaware.submit timed alone)"
$PY bench/lua_phases.py --jobs 300 --rounds 3 --submitters 1,8 --whole
echo "=== Slurm $rel: bench/lua_phases.py (where it goes: each phase timed, the timers' own calls in 'rest')"
$PY bench/lua_phases.py --jobs 300 --rounds 3 --submitters 1,8
[[ ${LUA_ONLY:-0} == 1 ]] && exit 0
echo "=== Slurm $rel: bench/submit_burst.py, 4 submitters"
$PY bench/submit_burst.py --jobs "${BURST_JOBS:-4500}" --rounds 3 --submitters 4 --modes off,on,table --no-squeue
echo "=== Slurm $rel: bench/submit_burst.py, 1 submitter (sequential)"
$PY bench/submit_burst.py --jobs "${SEQ_JOBS:-540}" --rounds 3 --submitters 1 --modes off,on,table --no-squeue
