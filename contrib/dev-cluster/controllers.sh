# shellcheck shell=bash
# Two controllers (SWAPAWARE_DEV_CONTROLLERS=2, multi-node mode only), sourced by cluster.sh.
#
# Layout: slurmctld runs on two hosts of its own, ctl1 (primary, $SUBNET.2) and ctl2 (backup,
# $SUBNET.3), each in network, UTS and mount namespaces like a compute node (nodes.sh: held by
# `sleep infinity`, entered with node-exec), with its own munged ($STATE/node as it sees it) and its
# own $STATE/run (slurmctld's pid file and log, the swapaware service's socket, role file and
# journal): $STATE/nodes/ctlN and $STATE/nodes/ctlN/run on the bridge side. They share
# StateSaveLocation ($STATE/spool/ctld) and slurm.conf. MariaDB, slurmdbd and the clients (tests,
# sbatch) stay on the bridge side ($SUBNET.1); MariaDB listens on the bridge there, so that a
# controller cut off the network (`cut ctlN`: its link down and its StateSaveLocation hidden by an
# empty tmpfs in its mount namespace, as an NFS state directory goes with the network) loses the
# history too. Slurm 22.05 measured: a backup does not take over while the primary still writes the
# shared `heartbeat` file, so a cut hides the state directory too.

CONTROLLERS=1
CTLD_TIMEOUT=${SWAPAWARE_DEV_CTLD_TIMEOUT:-5}

controllers_init() {
    if [[ $1 == up ]]; then
        CONTROLLERS=${SWAPAWARE_DEV_CONTROLLERS:-1}
    else
        CONTROLLERS=${SWAPAWARE_DEV_CONTROLLERS:-$(cat "$STATE/etc/controllers" 2>/dev/null || echo 1)}
    fi
    [[ $CONTROLLERS == [12] ]] || die "SWAPAWARE_DEV_CONTROLLERS must be 1 or 2, got '$CONTROLLERS'"
    if [[ $1 == up ]] && ((CONTROLLERS == 2)) && ! multi_node; then die "SWAPAWARE_DEV_CONTROLLERS=2 needs compute nodes (SWAPAWARE_DEV_NODES >= 1)"; fi
}

two_ctlds() { ((CONTROLLERS == 2)); }
controller_names() { if two_ctlds; then echo ctl1; echo ctl2; fi; }
ctl_addr() { echo "$SUBNET.$((1 + ${1#ctl}))"; }  # ctl2 -> $SUBNET.3
ctl_pidfile() { echo "$NODES_DIR/$1/run/slurmctld.pid"; }
ctl_logfile() { echo "$NODES_DIR/$1/run/slurmctld.log"; }

# The slurm.conf lines that name the controllers.
ctld_host_lines() {
    local n
    if ! two_ctlds; then
        echo "SlurmctldHost=$(node_name)($(ctld_addr))"
        return
    fi
    for n in $(controller_names); do echo "SlurmctldHost=$n($(ctl_addr "$n"))"; done
}

# slurmctld's log: per controller in its own $STATE/run (the bridge side sees $STATE/nodes/ctlN/run).
ctld_logfile_conf() { if two_ctlds; then echo "$RUN/slurmctld.log"; else echo "$LOG/slurmctld.log"; fi; }

ctl_pid() { pid_in_node "$1" slurmctld "$(ctl_pidfile "$1")"; }

# ctl_in_control NAME: the shared heartbeat names this controller (22.05: 16 bytes, big-endian time
# and the index of its SlurmctldHost line) and is fresh. Where the heartbeat reads otherwise (other
# releases), the last SlurmctldPrimaryOnProg/OffProg run says so (the role file of a live slurmctld).
ctl_in_control() {
    local hb=$STATE/spool/ctld/heartbeat hex idx role
    hex=$(od -An -tx1 -v "$hb" 2>/dev/null | tr -d ' \n')
    if ((${#hex} == 32)); then
        idx=$((16#${hex:16:16}))
        ((idx == ${1#ctl} - 1)) && (($(date +%s) - 16#${hex:0:16} <= 3 * CTLD_TIMEOUT))
        return
    fi
    [[ -n $(ctl_pid "$1") ]] || return 1
    read -r role _ <"$NODES_DIR/$1/run/role" 2>/dev/null || return 1
    [[ $role == primary ]]
}

ctl_answers() { scontrol ping 2>/dev/null | grep -q "at $1 is UP"; }

# log_since FILE OFFSET: what FILE got past byte OFFSET (its size before).
log_since() { tail -c "+$(($2 + 1))" "$1" 2>/dev/null; }
file_size() { stat -c %s "$1" 2>/dev/null || echo 0; }
ctl_answers_or_fatal() { ctl_answers "$1" || [[ $(log_since "$2" "$3") == *'fatal:'* ]]; }
ctl_gone() { [[ -z $(ctl_pid "$1") ]]; }
other_ctl() { if [[ $1 == ctl1 ]]; then echo ctl2; else echo ctl1; fi; }
# ctl_stood_down NAME OFFSET: NAME's slurmctld gave control back (standing by again since OFFSET)
# or is not running.
ctl_stood_down() {
    ctl_gone "$1" || [[ $(log_since "$(ctl_logfile "$1")" "$2") == *'running in background mode'* ]]
}

# A primary started while the backup is in control asks it for control (REQUEST_CONTROL). A 26.05
# backup answers only after 28-29 s ("REQUEST_CONTROL reply but backup not completely done
# relinquishing control": its shutdown waits for that RPC to end) and saves its state after it
# answered, while the primary reads that state. Each file it saves is renamed to .old, then .new
# to the name: missing for an instant, and since 25.05 a missing core state file is fatal ("fatal:
# No node state file (...) to recover"; 4 of 59 hand-backs, docs/slurm-releases.md). For that fatal
# only, start_ctl starts slurmctld again, as a unit with Restart=on-failure would, at most
# CTL_START_TRIES times, once the other controller stands by again (its save done): then it
# answers REQUEST_CONTROL at once and saves nothing. `hand-back` avoids the race altogether.
CTL_START_TRIES=3
STATE_FATAL='fatal: No .* file (.*) to recover'

start_ctl() {
    local name=$1 logf other try from other_from fatal
    logf=$(ctl_logfile "$name")
    other=$(other_ctl "$name")
    [[ -z $(ctl_pid "$name") ]] || return 0
    mkdir -p "$NODES_DIR/$name/run"
    for ((try = 1; ; try++)); do
        from=$(file_size "$logf")
        other_from=$(file_size "$(ctl_logfile "$other")")
        log "starting slurmctld on $name ($(ctl_addr "$name"):$CTLD_PORT)"
        in_node "$name" env LUA_PATH="$ETC/?.lua;;" slurmctld </dev/null >>"$LOG/slurmctld.stdout" 2>&1 9>&- ||
            die "slurmctld on $name failed; see $logf"
        if ! wait_for "slurmctld on $name" "$TIMEOUT_S" ctl_answers_or_fatal "$name" "$logf" "$from"; then
            tail -n 15 "$logf" >&2 2>/dev/null || true
            die "slurmctld on $name not answering; see $logf"
        fi
        ctl_answers "$name" && break
        fatal=$(log_since "$logf" "$from" | grep -e "$STATE_FATAL" | head -n1 || true)
        if [[ -z $fatal ]] || ((try >= CTL_START_TRIES)); then
            log_since "$logf" "$from" | tail -n 15 >&2
            die "slurmctld on $name exited (try $try of $CTL_START_TRIES); see $logf"
        fi
        log "slurmctld on $name exited reading state that $other was saving (try $try of $CTL_START_TRIES): ${fatal#*] }"
        wait_for "slurmctld on $name gone" 30 ctl_gone "$name" || die "slurmctld on $name did not exit"
        wait_for "$other standing by" "$TIMEOUT_S" ctl_stood_down "$other" "$other_from" ||
            die "$other neither stands by nor exited; see $(ctl_logfile "$other")"
        log "$other stands by (its state saved): starting slurmctld on $name again"
    done
    STARTED+=("slurmctld@$name")
}

# hand-back: control back to ctl1 without Slurm's own hand-back (a primary started while the
# backup is in control, above): the backup's slurmctld is stopped first (SIGTERM: it saves all
# state, then exits), ctl1 started (its REQUEST_CONTROL finds no backup: it reads the saved state
# at once), then ctl2 again, standing by. No state file is read while another controller writes it.
cmd_hand_back() {
    local pid
    two_ctlds || die "hand-back needs two controllers"
    if [[ -z $(ctl_pid ctl1) ]]; then
        pid=$(ctl_pid ctl2)
        if [[ -n $pid ]]; then
            log "hand-back: stopping slurmctld on ctl2 (pid $pid); it saves its state and exits"
            kill -TERM "$pid" 2>/dev/null || true
            # never SIGKILL a controller that may be writing the shared state
            wait_for "slurmctld on ctl2 to exit" "$TIMEOUT_S" no_pid_alive "$pid" ||
                die "slurmctld on ctl2 (pid $pid) still running; see $(ctl_logfile ctl2)"
        fi
        start_ctl ctl1
    fi
    wait_for "ctl1 in control" "$TIMEOUT_S" ctl_in_control ctl1 || die "ctl1 is not in control; see $(ctl_logfile ctl1)"
    start_ctl ctl2
}

stop_ctls() {
    local name pid
    local -a pids=()
    for name in ctl1 ctl2; do
        pid=$(ctl_pid "$name")
        [[ -n $pid ]] && pids+=("$pid")
    done
    stop_pids slurmctld ${pids[@]+"${pids[@]}"}
}

# Both controllers' namespaces and munged (before slurmctld: the nodes must reach them).
ctls_up() {
    local n
    for n in $(controller_names); do
        mkdir -p "$NODES_DIR/$n/run"
        chmod 755 "$NODES_DIR/$n/run"
        start_node_ns "$n"
        start_node_munge "$n"
    done
}

# The primary first (it runs SlurmctldPrimaryOnProg at start), then the backup (OffProg, standing by).
start_ctls() {
    start_ctl ctl1
    wait_for "ctl1 in control" "$TIMEOUT_S" ctl_in_control ctl1 || die "ctl1 is not in control; see $(ctl_logfile ctl1)"
    start_ctl ctl2
}

# cut NAME: the controller loses the network and its StateSaveLocation (still running); uncut undoes it.
cmd_cut() {
    local name=${1:?cut ctlN} pid
    pid=$(holder_pid "$name") || die "$name is not up"
    ip link set "$(node_veth "$name")" down
    nsenter -t "$pid" -m -r mount -t tmpfs -o size=1m swapaware-cut "$STATE/spool/ctld"
    log "$name: cut off (link down, state directory hidden)"
}

cmd_uncut() {
    local name=${1:?uncut ctlN} pid
    pid=$(holder_pid "$name") || die "$name is not up"
    while nsenter -t "$pid" -m -r findmnt -n "$STATE/spool/ctld" | grep -q swapaware-cut; do
        nsenter -t "$pid" -m -r umount "$STATE/spool/ctld"
    done
    ip link set "$(node_veth "$name")" up
    log "$name: back on the network"
}

# The swapaware history database and its user (password in $ETC/swapaware-db.pass, root only).
setup_history_db() {
    two_ctlds || return 0
    if [[ ! -s $ETC/swapaware-db.pass ]]; then
        (umask 077; head -c 18 /dev/urandom | base64 | tr -d '/+=\n' >"$ETC/swapaware-db.pass")
    fi
    chmod 600 "$ETC/swapaware-db.pass"
    local pass
    pass=$(cat "$ETC/swapaware-db.pass")
    # shellcheck disable=SC2119
    mysql_root <<SQL
CREATE DATABASE IF NOT EXISTS swapaware CHARACTER SET utf8mb4;
CREATE USER IF NOT EXISTS 'swapaware'@'%' IDENTIFIED BY '$pass';
ALTER USER 'swapaware'@'%' IDENTIFIED BY '$pass';
GRANT ALL ON swapaware.* TO 'swapaware'@'%';
FLUSH PRIVILEGES;
SQL
}

# Where MariaDB listens: loopback, or every address of the bridge side with two controllers.
db_bind_address() { if two_ctlds; then echo 0.0.0.0; else echo 127.0.0.1; fi; }
dbd_host() { if two_ctlds; then ctld_addr; else echo localhost; fi; }
