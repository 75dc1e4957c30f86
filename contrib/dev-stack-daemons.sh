# shellcheck shell=bash
# The dev stack's daemons, sourced by dev-stack.sh: the policy service (one, or one per controller)
# and a node agent per compute node, each started under setsid with a pid file and a private log,
# waited for (the doctor's probe) and stopped (SIGTERM, then SIGKILL).

# shellcheck source=proc-stat.sh
source "$(dirname "${BASH_SOURCE[0]}")/proc-stat.sh"

# pid_alive PIDFILE: the pid file names a live process that start_daemon started: the same pid
# with the start time start_daemon wrote beside it (PIDFILE.start). A pid file left behind by a
# daemon that died or was killed may name a pid the kernel has since given to another process
# (pids wrap at pid_max, 32768 here, within minutes of a test run; six clusters' daemons share one
# pid space): taken for ours, that process was sent SIGTERM/SIGKILL by stop_daemon, and
# start_daemon said "already running" and started nothing. (A pid file without .start, from a
# stack started before it was written: any live process, as then.)
pid_alive() {
    local pid start
    [[ -f $1 ]] && pid=$(tr -dc '0-9' <"$1") && [[ -n $pid ]] || return 1
    if [[ ! -f $1.start ]]; then kill -0 "$pid" 2>/dev/null; return; fi
    start=$(start_ticks "$pid") && [[ $start == "$(<"$1.start")" ]]
}

# The logs hold users' job names and decisions: each 0640 in a 0750 directory (an older one narrowed).
open_log() {
    mkdir -p "$LOGDIR"
    chmod 0750 "$LOGDIR"
    (umask 027 && : >>"$1")
    chmod 0640 "$1"
}

start_daemon() {  # name pidfile command...
    local name=$1 pidfile=$2
    shift 2
    if pid_alive "$pidfile"; then
        log "$name already running (pid $(cat "$pidfile"))"
        return 0
    fi
    mkdir -p "$(dirname "$pidfile")"
    open_log "$LOGDIR/$name.log"
    SWAPAWARE_CONFIG=$CONF setsid "$@" >>"$LOGDIR/$name.log" 2>&1 </dev/null &
    start_ticks $! >"$pidfile.start" || true  # (empty: it has ended already)
    echo $! >"$pidfile"
    log "started $name (pid $!), log $LOGDIR/$name.log"
}

stop_daemon() {
    local name=$1 pidfile=$2 i
    pid_alive "$pidfile" || { rm -f "$pidfile" "$pidfile.start"; return 0; }
    kill -TERM "$(cat "$pidfile")" 2>/dev/null || true
    for i in $(seq 1 50); do
        pid_alive "$pidfile" || break
        sleep 0.1
    done
    if pid_alive "$pidfile"; then
        kill -KILL "$(cat "$pidfile")" 2>/dev/null || true
        # SIGKILL is delivered, not done: wait until the process is gone (its port free) before
        # saying it stopped, so that a start right after finds the port free
        for i in $(seq 1 50); do
            pid_alive "$pidfile" || break
            sleep 0.1
        done
    fi
    rm -f "$pidfile" "$pidfile.start"
    log "stopped $name"
}

wait_service() {
    local i n
    if ((CONTROLLERS == 2)); then
        for n in $(controllers); do wait_probe "$(ctl_addr "$n"):$GRPC_PORT" "$(ctl_run "$n")/swapaware.pid" "$(ctl_conf "$n")" "$LOGDIR/swapaware-$n.log"; done
        return 0
    fi
    for i in $(seq 1 100); do
        # the doctor's probe: over TLS with the config's CA where it has one
        if [[ -S $SOCK ]] && "$VENV/bin/python" - "$(ctld_addr):$GRPC_PORT" "$CONF" <<'EOF' 2>/dev/null; then
import sys
from pathlib import Path
from policy_service.admin import probe_service
from policy_service.config import load_config
sys.exit(0 if probe_service(sys.argv[1], 1.0, load_config(Path(sys.argv[2])).tls) else 1)
EOF
            return 0
        fi
        pid_alive "$RUN/swapaware.pid" || { log_tail "$LOGDIR/swapaware.log"; die "policy service exited; see $LOGDIR/swapaware.log"; }
        sleep 0.2
    done
    log_tail "$LOGDIR/swapaware.log"
    die "policy service not healthy after 20 s; see $LOGDIR/swapaware.log"
}

# log_tail FILE: the end of a daemon's log on stderr, where the caller's output keeps it (a test's
# teardown purges the state directory, and with it the log that said why the daemon ended).
log_tail() {
    [[ -r $1 ]] || { log "no log at $1"; return 0; }
    log "last lines of $1:"
    tail -n 40 "$1" | sed 's/^/    /' >&2
}

# wait_probe ADDRESS PIDFILE CONF LOG: a controller's service answers the doctor's probe.
wait_probe() {
    local i
    for i in $(seq 1 100); do
        if "$VENV/bin/python" -c '
import sys
from pathlib import Path
from policy_service.admin import probe_service
from policy_service.config import load_config
sys.exit(0 if probe_service(sys.argv[1], 1.0, load_config(Path(sys.argv[2])).tls) else 1)' "$1" "$3" 2>/dev/null; then
            return 0
        fi
        pid_alive "$2" || { log_tail "$4"; die "policy service $1 exited; see $4"; }
        sleep 0.2
    done
    log_tail "$4"
    die "policy service $1 not healthy after 20 s; see $4"
}

service_start() {
    local n
    if ((CONTROLLERS == 2)); then
        for n in $(controllers); do
            start_daemon "swapaware-$n" "$(ctl_run "$n")/swapaware.pid" "$CLUSTER" node-exec "$n" \
                nice -n -5 "$VENV/bin/swapaware" serve --config "$(ctl_conf "$n")"
        done
        wait_service
        return 0
    fi
    # Nice -5, as contrib/systemd/swapaware.service: slurmctld waits for Admit holding its job lock.
    start_daemon swapaware "$RUN/swapaware.pid" nice -n -5 "$VENV/bin/swapaware" serve --config "$CONF"
    wait_service
}

start_agents() {
    local n d
    for n in $(nodes); do
        d=$(node_dir "$n")
        mkdir -p "$d"
        "$VENV/bin/python" -c "
from pathlib import Path
from slurm_plugin.gpu.nvml_fake import create_fake_gpus
create_fake_gpus(Path('$d/fake-nvml'), 4, [g * 1024**3 for g in ($GPU_GIB,)])"
        start_daemon "agent-$n" "$d/agent.pid" "$CLUSTER" node-exec "$n" "$VENV/bin/swapaware-agent" \
            --config "$CONF" --foreground
    done
}

stop_agents() {
    local n
    for n in $("$CLUSTER" nodes 2>/dev/null); do stop_daemon "agent-$n" "$(node_dir "$n")/agent.pid"; done
}

services_stop() {
    local n
    for n in ctl1 ctl2; do stop_daemon "swapaware-$n" "$(ctl_run "$n")/swapaware.pid"; done
    stop_daemon swapaware "$RUN/swapaware.pid"
}
