#!/usr/bin/env bash
# The whole test suite on a fresh Debian 12 or 13 machine (as root): installs what it needs
# (the host's Slurm, munge, MariaDB, Lua 5.1 + lua-socket + lua-cjson, a Python venv), runs the
# unit and adapter tests, then the integration suite against real daemons of every supported
# Slurm release: the host's own Slurm, and the others from Debian roots that
# contrib/matrix/root.sh builds once and caches in /var/cache/swapaware-matrix. Each release's
# cluster runs in its own network namespace (contrib/matrix/run.sh).
#
#   run-tests.sh [--release R]... [PYTEST ARGS...]
#       --release R       only this release's integration suite (22.05, 24.11, 26.05; repeatable);
#                         SWAPAWARE_RELEASES="24.11 26.05" does the same. --release none: no
#                         integration suite.
#   run-tests.sh --integration-only [PYTEST ARGS...]
#       the integration suites (tests/integration on one node, tests/multinode on a controller
#       and three nodes, then tests/multinode_ha on two controllers and two nodes) against the Slurm installed here (what run.sh calls inside a release's
#       namespace)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=matrix/releases.sh
source "$ROOT/contrib/matrix/releases.sh"
VENV=${SWAPAWARE_VENV:-$ROOT/.venv}

only_integration=0
wanted=()
args=()
while (($#)); do
    case $1 in
        --integration-only) only_integration=1 ;;
        --release) wanted+=("${2:?--release needs a value}"); shift ;;
        --release=*) wanted+=("${1#--release=}") ;;
        *) args+=("$1") ;;
    esac
    shift
done
if ((${#wanted[@]} == 0)); then
    read -r -a wanted <<<"${SWAPAWARE_RELEASES:-${RELEASES[*]}}"
fi

# chromium: the unit and adapter tests render the report's HTML page headless
# (tests/adapter/test_report_html.py); the integration suites in the release roots do not need it.
extra=()
((only_integration)) || extra=(chromium)
bash "$ROOT/contrib/dev-cluster/cluster.sh" install "${extra[@]+"${extra[@]}"}"
bash "$ROOT/contrib/dev-stack.sh" venv
cd "$ROOT"

if ((only_integration)); then
    # The single-node suite, then the multi-node one (a controller and three nodes); one cluster at
    # a time, each from an empty state.
    rc=0
    "$VENV/bin/python" -m pytest tests/integration "${args[@]+"${args[@]}"}" || rc=$?
    "$VENV/bin/python" -m pytest tests/multinode "${args[@]+"${args[@]}"}" || rc=$?
    # Two controllers (issue 23): ctl1 and ctl2 sharing StateSaveLocation, one MariaDB history.
    "$VENV/bin/python" -m pytest tests/multinode_ha "${args[@]+"${args[@]}"}" || rc=$?
    exit $rc
fi

declare -A took=() result=()
t_all=$SECONDS
t0=$SECONDS
rc=0
"$VENV/bin/python" -m pytest tests/unit tests/adapter "${args[@]+"${args[@]}"}" || rc=$?
took[unit]=$((SECONDS - t0))
result[unit]=$([[ $rc == 0 ]] && echo passed || echo "FAILED (rc $rc)")

host=$(host_release)
for rel in "${wanted[@]}"; do
    [[ $rel == none ]] && continue
    release_ok "$rel" || mdie "unknown release $rel (supported: ${RELEASES[*]})"
    t0=$SECONDS
    r=0
    if [[ $rel != "$host" ]]; then
        bash "$ROOT/contrib/matrix/root.sh" build "$rel" || r=$?
    fi
    if ((r == 0)); then
        mlog "Slurm $rel: integration suite"
        bash "$ROOT/contrib/matrix/run.sh" "$rel" bash contrib/run-tests.sh --integration-only \
            "${args[@]+"${args[@]}"}" || r=$?
    fi
    took[$rel]=$((SECONDS - t0))
    result[$rel]=$([[ $r == 0 ]] && echo passed || echo "FAILED (rc $r)")
    ((r == 0)) || rc=1
done

echo
echo "swapaware test matrix (host: Debian $(host_suite), Slurm ${host:-none of the supported})"
printf '  %-22s %-16s %5s s\n' "unit + adapter" "${result[unit]}" "${took[unit]}"
for rel in "${wanted[@]}"; do
    [[ $rel == none ]] && continue
    printf '  %-22s %-16s %5s s\n' "Slurm $rel integration" "${result[$rel]}" "${took[$rel]}"
done
echo "  whole run: $((SECONDS - t_all)) s"
exit $rc
