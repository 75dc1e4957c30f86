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
#                         after another, their output streamed, the unit tests first)
#       SWAPAWARE_TEST_LANES=2     with more than one release at a time, each release's suites in two
#                         lanes side by side (default; 1: one after another in one namespace)
#       With more than one at a time the unit and adapter tests run beside the integration suites.
#   run-tests.sh --integration-only [PYTEST ARGS...]
#       the integration suites (tests/install: the admin guide's install on a site of its own,
#       tests/integration on one node, tests/multinode on a controller and three nodes, then
#       tests/multinode_ha on two controllers and two nodes) against the Slurm installed here (what
#       run.sh calls inside a release's namespace); SWAPAWARE_SUITES="integration multinode": some
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
    # One cluster at a time, each from an empty state: tests/install (a new site's install from the
    # admin guide alone, in namespaces of its own), tests/integration (one node), tests/multinode (a
    # controller and three nodes), tests/multinode_ha (issue 23: ctl1 and ctl2 sharing
    # StateSaveLocation, one MariaDB history). SWAPAWARE_SUITES: some of them, in this order.
    rc=0
    for s in ${SWAPAWARE_SUITES:-install integration multinode multinode_ha}; do
        case $s in
            install | integration | multinode | multinode_ha) ;;
            *) mdie "SWAPAWARE_SUITES: unknown suite '$s' (install, integration, multinode, multinode_ha)" ;;
        esac
        "$VENV/bin/python" -m pytest "tests/$s" "${args[@]+"${args[@]}"}" || rc=$?
    done
    exit $rc
fi

declare -A took=() result=()
t_all=$SECONDS
rc=0
host=$(host_release)
parallel=${SWAPAWARE_TEST_PARALLEL:-3}
[[ $parallel =~ ^[1-9][0-9]*$ ]] || mdie "SWAPAWARE_TEST_PARALLEL must be a positive number, got '$parallel'"
logs=$ROOT/results/matrix
mkdir -p "$logs"

# The unit and adapter tests: with the integration suites in parallel (the default), beside them
# from the start (the suites mostly wait for Slurm's daemons and timers, these use the CPUs; they
# share no port, state directory or namespace: the suites run in namespaces of their own), their
# output in results/matrix/unit.log, printed whole once they ended; else first, streamed.
unit_tests() {
    "$VENV/bin/python" -m pytest tests/unit tests/adapter "${args[@]+"${args[@]}"}"
}
unit_ended() {  # RC [SECONDS]
    took[unit]=${2:-$((SECONDS - t_all))}
    result[unit]=$([[ $1 == 0 ]] && echo passed || echo "FAILED (rc $1)")
    [[ $1 == 0 ]] || rc=1
}
unit_pid=""
if ((parallel > 1)) && [[ " ${wanted[*]} " != " none " ]]; then
    mlog "unit and adapter tests started beside the integration suites (output: $logs/unit.log)"
    rm -f "$logs/unit.took"
    (t0=$SECONDS; r=0; unit_tests || r=$?; echo $((SECONDS - t0)) >"$logs/unit.took"; exit $r) >"$logs/unit.log" 2>&1 &
    unit_pid=$!
else
    r=0
    unit_tests || r=$?
    unit_ended "$r"
fi
unit_wait() {  # the unit and adapter tests' end, their output printed whole
    [[ -n $unit_pid ]] || return 0
    local r=0
    wait "$unit_pid" || r=$?
    unit_pid=""
    unit_ended "$r" "$(cat "$logs/unit.took" 2>/dev/null)"
    mlog "unit and adapter tests ended (${result[unit]}, ${took[unit]} s); their output:"
    cat "$logs/unit.log"
}

# The releases' integration suites, SWAPAWARE_TEST_PARALLEL (default 3: all) at a time: each in its own
# network namespace, Debian root and state directories (contrib/matrix/run.sh), so they share
# nothing but the CPUs, which they mostly leave idle (waiting for Slurm's daemons and timers).
# With more than one at a time each suite's output goes to results/matrix/<release>.log and is
# printed whole once that suite ended. The roots are built first, one after another.
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

run_suites() {  # RELEASE: contrib/run-tests.sh --integration-only in the release's namespace (the
    # caller's SWAPAWARE_MATRIX_* and SWAPAWARE_SUITES choose the lane and the suites)
    bash "$ROOT/contrib/matrix/run.sh" "$1" bash contrib/run-tests.sh --integration-only "${args[@]+"${args[@]}"}"
}

suite() {  # RELEASE: its integration suites, one after another in its namespace
    mlog "Slurm $1: integration suite"
    run_suites "$1"
}

# A release's suites in two lanes side by side (SWAPAWARE_TEST_LANES, default 2; 1: one lane, as
# suite): lane a runs install, integration and multinode, lane ha the two-controller suite, each in
# a network namespace of its own (contrib/matrix/run.sh SWAPAWARE_MATRIX_LANE) on the root, copy,
# venv and wheelhouse that run.sh --prepare made once; their state directories, ports and node
# namespaces differ (tests/slurm_stack.py state_dir, each suite's PORTS). The root is unmounted once
# both ended. Each lane's output in results/matrix/<release>-<lane>.log, printed whole at the end.
suite_lanes() {  # RELEASE
    local rel=$1 ra=0 rh=0 pa ph
    mlog "Slurm $rel: integration suites in two lanes"
    bash "$ROOT/contrib/matrix/run.sh" "$rel" --prepare || return $?
    SWAPAWARE_MATRIX_LANE=a SWAPAWARE_MATRIX_KEEP_ROOT=1 SWAPAWARE_MATRIX_NODES="test mn" \
        SWAPAWARE_SUITES="install integration multinode" run_suites "$rel" >"$logs/$rel-a.log" 2>&1 &
    pa=$!
    SWAPAWARE_MATRIX_LANE=ha SWAPAWARE_MATRIX_KEEP_ROOT=1 SWAPAWARE_MATRIX_NODES=ha SWAPAWARE_SUITES=multinode_ha \
        run_suites "$rel" >"$logs/$rel-ha.log" 2>&1 &
    ph=$!
    wait "$pa" || ra=$?
    wait "$ph" || rh=$?
    bash "$ROOT/contrib/matrix/run.sh" "$rel" --cleanup || true
    printf '\n===== Slurm %s, lane a (install, integration, multinode): rc %s\n' "$rel" "$ra"
    cat "$logs/$rel-a.log"
    printf '\n===== Slurm %s, lane ha (multinode_ha): rc %s\n' "$rel" "$rh"
    cat "$logs/$rel-ha.log"
    ((ra == 0 && rh == 0))
}
lanes=${SWAPAWARE_TEST_LANES:-2}
[[ $lanes == 1 || $lanes == 2 ]] || mdie "SWAPAWARE_TEST_LANES must be 1 or 2, got '$lanes'"

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
    declare -A pid_of=() started=()
    tree() {  # PID: its descendants, deepest first
        local c
        for c in $(pgrep -P "$1" || true); do tree "$c"; echo "$c"; done
    }
    stop_suites() {  # TERM each suite's processes until none is left; run.sh then cleans up its
        local p i left   # namespace and mounts (a TERM to run.sh alone waits for its running
        for i in $(seq 1 30); do   # command, and a suite's shell may start its next pytest)
            left=""
            for p in "${pid_of[@]}" $unit_pid; do left+=" $(tree "$p")"; done
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
        if ((lanes == 2)); then
            suite_lanes "$rel" >"$logs/$rel.log" 2>&1 &
        else
            suite "$rel" >"$logs/$rel.log" 2>&1 &
        fi
        pid_of[$rel]=$!
    done
    while ((${#pid_of[@]} > 0)); do
        wait -n || true
        report_ended
    done
    trap - TERM INT
fi
unit_wait

echo
echo "swapaware test matrix (host: Debian $(host_suite), Slurm ${host:-none of the supported})"
printf '  %-22s %-16s %5s s\n' "unit + adapter" "${result[unit]}" "${took[unit]}"
for rel in "${wanted[@]}"; do
    [[ $rel == none ]] && continue
    printf '  %-22s %-16s %5s s\n' "Slurm $rel integration" "${result[$rel]}" "${took[$rel]}"
done
echo "  whole run: $((SECONDS - t_all)) s (integration suites $parallel at a time: SWAPAWARE_TEST_PARALLEL)"
exit $rc
