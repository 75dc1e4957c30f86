# shellcheck shell=bash
# The dev cluster's processes, sourced by cluster.sh: the daemons' pid files and whether each is
# up, waiting for a daemon or a condition, stopping pids and daemons (SIGTERM, then SIGKILL), and
# the stray slurmstepds that `down --purge` kills.

# shellcheck source=../proc-stat.sh
source "$(dirname "${BASH_SOURCE[0]}")/../proc-stat.sh"

pidfile_of() {
    case $1 in
        munged) echo "$NODE_DIR/munge/munged.pid" ;;
        mariadbd) echo "$MYSQL/mysqld.pid" ;;
        slurmdbd | slurmctld) echo "$RUN/$1.pid" ;;
        slurmd) echo "$NODE_DIR/slurmd.pid" ;;
        *) die "unknown daemon $1" ;;
    esac
}

# is_daemon PID NAME [PIDFILE]: PID is a live NAME. Its comm is NAME, or NAME-<role> once the
# daemon re-ran itself: after `scontrol reconfigure` Slurm 26.05's slurmctld is a new process named
# "slurmctld-wlm" (measured); taking that for no slurmctld left the old one running and every later
# restart (cluster.sh plugin off/on) a silent no-op. comm, unlike exe, is readable by non-root too.
#
# With PIDFILE, the process must also have been running when the pid file was last written (it
# started at most 30 s after the file's mtime, room for a wall clock set forward since; the
# daemons write their own pid files once running).
# A pid file left by a daemon that died or was killed (kill -9 in the HA tests) may name a pid the
# kernel has since given to another cluster's daemon of the same name (pids wrap at pid_max, 32768
# here, within minutes of a test run; the lanes' and releases' clusters share one pid space): taken
# for ours, it was stopped by stop_daemons, or counted as up where ours was not. (The first version
# asked for this cluster's SLURM_CONF in the process's environment; CI run 12 then took a lane's own
# slurmctld for none of its own, for good, and the cause was not found: the start time depends on
# nothing the process or its caller sets.)
is_daemon() {
    local comm started mtime
    comm=$(cat "/proc/$1/comm" 2>/dev/null) || return 1
    [[ $comm == "$2" || $comm == "$2"-* ]] || return 1
    [[ -n ${3:-} ]] || return 0
    started=$(started_at "$1") && mtime=$(stat -c %Y "$3" 2>/dev/null) || return 1
    ((started <= mtime + 30))
}

# started_at PID: when the process started, in whole seconds of the wall clock (field 22 of
# /proc/PID/stat, clock ticks after boot, plus the boot time /proc/stat gives).
started_at() {
    local ticks btime
    ticks=$(start_ticks "$1") || return 1
    btime=$(sed -n 's/^btime //p' /proc/stat)
    echo $((btime + ticks / $(getconf CLK_TCK)))
}

# environ_has PID NAME=VALUE: the process's environment holds exactly that entry. Read whole, not
# piped into `grep -q`: under pipefail grep's exit at the first match fails the pipeline whenever
# tr is still writing (measured: 23 of 1,000 reads of a 7 KB environment).
environ_has() {
    local env
    env=$(tr '\0' '\n' <"/proc/$1/environ" 2>/dev/null) || return 1
    [[ $'\n'$env$'\n' == *$'\n'"$2"$'\n'* ]]
}

# pid_of NAME: prints the pid when its pid file names a live NAME (is_daemon), returns 1 otherwise.
pid_of() {
    local f pid
    f=$(pidfile_of "$1")
    [[ -r $f ]] || return 1
    pid=$(tr -dc '0-9' <"$f")
    [[ -n $pid ]] && is_daemon "$pid" "$1" "$f" || return 1
    echo "$pid"
}

is_up() { pid_of "$1" >/dev/null; }

# wait_daemon NAME LOGFILE COMMAND...: polls COMMAND until it succeeds; fails
# fast (with the log's tail) when the daemon died, or after $TIMEOUT_S.
wait_daemon() {
    local name=$1 logfile=$2 start
    shift 2
    start=$SECONDS
    until "$@" >/dev/null 2>&1; do
        if ((SECONDS - start >= 2)) && ! is_up "$name" &&
            ! { [[ -n ${BG_PID:-} ]] && kill -0 "$BG_PID" 2>/dev/null; }; then
            log "$name is not running (died at start?); last lines of $logfile:"
            tail -n 15 "$logfile" >&2 2>/dev/null || true
            return 1
        fi
        if ((SECONDS - start >= TIMEOUT_S)); then
            log "timed out after ${TIMEOUT_S}s waiting for $name; last lines of $logfile:"
            tail -n 15 "$logfile" >&2 2>/dev/null || true
            return 1
        fi
        sleep 0.2
    done
}

# wait_for DESCRIPTION TIMEOUT_S COMMAND...: polls COMMAND every 0.2 s.
wait_for() {
    local what=$1 limit=$2 start
    shift 2
    start=$SECONDS
    until "$@" >/dev/null 2>&1; do
        if ((SECONDS - start >= limit)); then
            log "timed out after ${limit}s waiting for $what"
            return 1
        fi
        sleep 0.2
    done
}

# stop_pids WHAT PID...: SIGTERM to the PIDs (of WHAT, for the log), wait up to 20 s for all
# to exit, then SIGKILL the rest. No PIDs: nothing to do.
stop_pids() {
    local what=$1
    shift
    (($#)) || return 0
    log "stopping $what (pid $*)"
    kill -TERM "$@" 2>/dev/null || true
    wait_for "$what to stop" 20 no_pid_alive "$@" || kill -KILL "$@" 2>/dev/null || true
}

no_pid_alive() {
    local p
    for p in "$@"; do kill -0 "$p" 2>/dev/null && return 1; done
    return 0
}

# stop_daemons TIMEOUT_S NAME...: SIGTERM to all of them at once, wait up to
# TIMEOUT_S for all to exit, then SIGKILL the rest.
stop_daemons() {
    local limit=$1 name pid start alive
    shift
    local -a pids=()
    for name in "$@"; do
        if pid=$(pid_of "$name"); then
            log "stopping $name (pid $pid)"
            kill -TERM "$pid" 2>/dev/null || true
            pids+=("$pid")
        fi
    done
    start=$SECONDS
    while ((${#pids[@]})); do
        alive=()
        for pid in "${pids[@]}"; do
            if kill -0 "$pid" 2>/dev/null; then alive+=("$pid"); fi
        done
        pids=("${alive[@]+"${alive[@]}"}")
        ((${#pids[@]})) || break
        if ((SECONDS - start >= limit)); then
            log "not stopped after ${limit}s: SIGKILL ${pids[*]}"
            kill -KILL "${pids[@]}" 2>/dev/null || true
            sleep 0.5
            break
        fi
        sleep 0.1
    done
    for name in "$@"; do rm -f "$(pidfile_of "$name")"; done
}

stop_daemon() { stop_daemons "${2:-20}" "$1"; }

kill_children() { # PID: SIGKILL its descendants (no procps needed)
    local parent=$1 q ppid
    for q in /proc/[0-9]*; do
        ppid=$(awk '{print $4}' "$q/stat" 2>/dev/null || true)
        if [[ $ppid == "$parent" ]]; then
            kill_children "${q#/proc/}"
            kill -KILL "${q#/proc/}" 2>/dev/null || true
        fi
    done
}

# slurmstepd processes of this cluster (their environment names our
# SLURM_CONF) survive slurmd; with --purge they would outlive their spool dir.
kill_stray_steps() {
    local p
    for p in /proc/[0-9]*; do
        [[ $(cat "$p/comm" 2>/dev/null) == slurmstepd ]] || continue
        if environ_has "${p#/proc/}" "SLURM_CONF=$SLURM_CONF_PATH"; then
            log "killing stray slurmstepd ${p#/proc/} and its children"
            kill_children "${p#/proc/}"
            kill -KILL "${p#/proc/}" 2>/dev/null || true
        fi
    done
}
