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
#       SWAPAWARE_TEST_PARALLEL=N  run N releases' integration suites at a time (default 3: all; 1: one
#                         after another, their output streamed)
#   run-tests.sh --integration-only [PYTEST ARGS...]
#       the integration suites (tests/install: the admin guide's install on a site of its own,
#       tests/integration on one node, tests/multinode on a controller
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
# (tests/adapter/report/test_report_html.py); the integration suites in the release roots do not need it.
extra=()
((only_integration)) || extra=(chromium)
bash "$ROOT/contrib/dev-cluster/cluster.sh" install "${extra[@]+"${extra[@]}"}"
bash "$ROOT/contrib/dev-stack.sh" venv
cd "$ROOT"

if ((only_integration)); then
    # The single-node suite, then the multi-node one (a controller and three nodes); one cluster at
    # a time, each from an empty state.
    rc=0
    # A new site's install from the admin guide alone, in namespaces of its own (tests/install).
    "$VENV/bin/python" -m pytest tests/install "${args[@]+"${args[@]}"}" || rc=$?
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

# The releases' integration suites, SWAPAWARE_TEST_PARALLEL (default 3: all) at a time: each in its own
# network namespace, Debian root and state directories (contrib/matrix/run.sh), so they share
# nothing but the CPUs, which they mostly leave idle (waiting for Slurm's daemons and timers).
# With more than one at a time each suite's output goes to results/matrix/<release>.log and is
# printed whole once that suite ended. The roots are built first, one after another.
host=$(host_release)
parallel=${SWAPAWARE_TEST_PARALLEL:-3}
[[ $parallel =~ ^[1-9][0-9]*$ ]] || mdie "SWAPAWARE_TEST_PARALLEL must be a positive number, got '$parallel'"
suites=()
for rel in "${wanted[@]}"; do
    [[ $rel == none ]] && continue
    release_ok "$rel" || mdie "unknown release $rel (supported: ${RELEASES[*]})"
    t0=$SECONDS
    r=0
    if [[ $rel != "$host" ]]; then
        bash "$ROOT/contrib/matrix/root.sh" build "$rel" || r=$?
    fi
    took[$rel]=$((SECONDS - t0))
    if ((r == 0)); then
        suites+=("$rel")
    else
        result[$rel]="FAILED (root, rc $r)"
        rc=1
    fi
done

suite() {  # RELEASE: its integration suite, in its namespace
    mlog "Slurm $1: integration suite"
    bash "$ROOT/contrib/matrix/run.sh" "$1" bash contrib/run-tests.sh --integration-only "${args[@]+"${args[@]}"}"
}

ended() {  # RELEASE RC STARTED
    took[$1]=$((took[$1] + SECONDS - $3))
    result[$1]=$([[ $2 == 0 ]] && echo passed || echo "FAILED (rc $2)")
    [[ $2 == 0 ]] || rc=1
}

if ((parallel == 1 || ${#suites[@]} <= 1)); then
    for rel in "${suites[@]+"${suites[@]}"}"; do
        t0=$SECONDS
        r=0
        suite "$rel" || r=$?
        ended "$rel" "$r" "$t0"
    done
else
    logs=$ROOT/results/matrix
    mkdir -p "$logs"
    declare -A pid_of=() started=()
    tree() {  # PID: its descendants, deepest first
        local c
        for c in $(pgrep -P "$1" || true); do tree "$c"; echo "$c"; done
    }
    stop_suites() {  # TERM each suite's processes until none is left; run.sh then cleans up its
        local p i left   # namespace and mounts (a TERM to run.sh alone waits for its running
        for i in $(seq 1 30); do   # command, and a suite's shell may start its next pytest)
            left=""
            for p in "${pid_of[@]}"; do left+=" $(tree "$p")"; done
            [[ -n ${left// /} ]] || break
            # shellcheck disable=SC2086
            kill -TERM $left 2>/dev/null || true
            sleep 1
        done
        wait
    }
    trap 'stop_suites; exit 143' TERM INT
    report_ended() {  # print and record every suite that ended since the last call
        local rel r
        for rel in "${!pid_of[@]}"; do
            kill -0 "${pid_of[$rel]}" 2>/dev/null && continue
            r=0
            wait "${pid_of[$rel]}" || r=$?
            unset "pid_of[$rel]"
            ended "$rel" "$r" "${started[$rel]}"
            mlog "Slurm $rel: integration suite ended (${result[$rel]}, ${took[$rel]} s); its output:"
            cat "$logs/$rel.log"
        done
    }
    for rel in "${suites[@]}"; do
        while ((${#pid_of[@]} >= parallel)); do
            wait -n || true
            report_ended
        done
        mlog "Slurm $rel: integration suite started (output: $logs/$rel.log)"
        started[$rel]=$SECONDS
        suite "$rel" >"$logs/$rel.log" 2>&1 &
        pid_of[$rel]=$!
    done
    while ((${#pid_of[@]} > 0)); do
        wait -n || true
        report_ended
    done
    trap - TERM INT
fi

echo
echo "swapaware test matrix (host: Debian $(host_suite), Slurm ${host:-none of the supported})"
printf '  %-22s %-16s %5s s\n' "unit + adapter" "${result[unit]}" "${took[unit]}"
for rel in "${wanted[@]}"; do
    [[ $rel == none ]] && continue
    printf '  %-22s %-16s %5s s\n' "Slurm $rel integration" "${result[$rel]}" "${took[$rel]}"
done
echo "  whole run: $((SECONDS - t_all)) s (integration suites $parallel at a time: SWAPAWARE_TEST_PARALLEL)"
exit $rc
