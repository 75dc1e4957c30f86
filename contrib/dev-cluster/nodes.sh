# shellcheck shell=bash
# Compute nodes of the dev cluster, sourced by cluster.sh.
#
# SWAPAWARE_DEV_NODES=0 (default): one node, the controller's own host (slurmd beside slurmctld).
# SWAPAWARE_DEV_NODES=N (N >= 1): N compute nodes node1..nodeN, each a machine of its own as far
# as Slurm and swapaware can tell: its own network namespace (address $SUBNET.(10+i) on a bridge
# whose $SUBNET.1 is the controller), its own host name (UTS namespace) and its own mount namespace,
# in which $STATE/nodes/<name> is mounted over $STATE/node. Everything a node keeps for itself
# lives under $STATE/node as the node sees it: its munged (socket, pid, seed; started with the
# node's address as its origin, so a MUNGE credential names the node it came from), slurmd's spool,
# pid and log, and swapaware's agent socket, spool and fake GPUs. On the controller (and in
# single-node mode) $STATE/node is a plain directory. Each node is held by one process
# (`sleep infinity` named swapaware-node-<cluster>-<name>) whose pid is in $STATE/nodes/<name>.pid;
# `node-exec` enters its namespaces. The controller's side (bridge) lives in the namespace
# cluster.sh runs in: in the tests that is the release's own (contrib/matrix/run.sh).

NODES=0
SUBNET=${SWAPAWARE_DEV_SUBNET:-10.77.0}
BRIDGE=${SWAPAWARE_DEV_BRIDGE:-swabr0}
NODE_DIR=$STATE/node
NODES_DIR=$STATE/nodes

# nodes_init up|other: `up` takes SWAPAWARE_DEV_NODES (default 0); other commands keep what the
# last `up` chose (written to $STATE/etc/nodes) unless SWAPAWARE_DEV_NODES says otherwise.
nodes_init() {
    if [[ $1 == up ]]; then
        NODES=${SWAPAWARE_DEV_NODES:-0}
    else
        NODES=${SWAPAWARE_DEV_NODES:-$(cat "$STATE/etc/nodes" 2>/dev/null || echo 0)}
    fi
    [[ $NODES =~ ^[0-9]+$ ]] && ((NODES <= 16)) || die "SWAPAWARE_DEV_NODES must be 0..16, got '$NODES'"
    [[ $SUBNET =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "SWAPAWARE_DEV_SUBNET must be three octets (10.77.0), got '$SUBNET'"
}

multi_node() { ((NODES > 0)); }
ctld_addr() { if multi_node; then echo "$SUBNET.1"; else echo 127.0.0.1; fi; }
node_addr() { case $1 in ctl*) ctl_addr "$1" ;; *) echo "$SUBNET.$((10 + ${1#node}))" ;; esac; }  # node3 -> $SUBNET.13
# The bridge side's end of a host's link: swv3 for node3, swc1 for ctl1 (controllers.sh).
node_veth() { case $1 in ctl*) echo "swc${1#ctl}" ;; *) echo "swv${1#node}" ;; esac; }
# The compute nodes' names (single-node: the host's own name).
compute_nodes() {
    local i
    if multi_node; then
        for ((i = 1; i <= NODES; i++)); do echo "node$i"; done
    else
        node_name
    fi
}
holder_tag() { echo "swapaware-node-$CLUSTER-$1"; }
holder_pidfile() { echo "$NODES_DIR/$1.pid"; }

# holder_pid NAME: the pid of the node's namespace holder when it is alive.
holder_pid() {
    local f pid
    f=$(holder_pidfile "$1")
    [[ -r $f ]] || return 1
    pid=$(tr -dc '0-9' <"$f")
    [[ -n $pid ]] && tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q "^$(holder_tag "$1") " || return 1
    echo "$pid"
}

# in_node NAME COMMAND...: COMMAND inside the node's namespaces, with the holder's root and working
# directory (a chroot stays a chroot).
in_node() {
    local name=$1 pid
    shift
    if ! multi_node || [[ -z $name ]]; then "$@"; return; fi
    pid=$(holder_pid "$name") || die "node $name is not up"
    nsenter -t "$pid" -n -u -m -r -w -- "$@"
}

# exec_in_node NAME COMMAND...: as in_node, replacing this shell (its pid becomes COMMAND's).
exec_in_node() {
    local name=$1 pid
    shift
    if ! multi_node; then exec "$@"; fi
    pid=$(holder_pid "$name") || die "node $name is not up"
    exec nsenter -t "$pid" -n -u -m -r -w -- "$@"
}

node_hostname_is() { [[ $(nsenter -t "$1" -u hostname 2>/dev/null) == "$2" ]]; }

bridge_up() {
    if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
        ip link add "$BRIDGE" type bridge
        ip addr add "$SUBNET.1/24" dev "$BRIDGE"
    fi
    ip link set "$BRIDGE" up
}

start_node_ns() {
    local name=$1 addr pid veth
    addr=$(node_addr "$name")
    veth=$(node_veth "$name")
    mkdir -p "$NODES_DIR/$name/munge" "$NODES_DIR/$name/slurmd"
    chmod 755 "$NODES_DIR/$name/munge"  # munged's socket: open to local users, as /run/munge is
    if pid=$(holder_pid "$name"); then return 0; fi
    log "node $name: namespaces, address $addr"
    # --propagation private: the node's mount of $NODE_DIR is its own. A controller (controllers.sh)
    # also has its own $RUN.
    local run_bind=""
    [[ $name == ctl* ]] && run_bind=$NODES_DIR/$name/run
    unshare --net --uts --mount --propagation private -- bash -c \
        'hostname "$1" && mount --bind "$2" "$3" && { [ -z "$5" ] || mount --bind "$5" "$6"; } && ip link set lo up && exec -a "$4" sleep infinity' \
        _ "$name" "$NODES_DIR/$name" "$NODE_DIR" "$(holder_tag "$name")" "$run_bind" "$RUN" </dev/null >/dev/null 2>&1 9>&- &
    echo $! >"$(holder_pidfile "$name")"
    wait_for "node $name's namespaces" 10 holder_pid "$name" || die "node $name: namespace holder did not start"
    pid=$(holder_pid "$name")
    wait_for "node $name's host name" 10 node_hostname_is "$pid" "$name" || die "node $name: no host name"
    ip link del "$veth" 2>/dev/null || true
    ip link add "$veth" type veth peer name eth0 netns "$pid"
    ip link set "$veth" master "$BRIDGE" up
    nsenter -t "$pid" -n ip addr add "$addr/24" dev eth0
    nsenter -t "$pid" -n ip link set eth0 up
    # No default route: the controller is on the node's own subnet, and a name lookup that has no
    # server to reach must fail at once (through a route to nowhere it would wait out its timeout).
}

# pids_in_netns PID: every process in the network namespace of PID (PID included).
pids_in_netns() {
    local want p
    want=$(readlink "/proc/$1/ns/net" 2>/dev/null) || return 0
    for p in /proc/[0-9]*; do
        [[ $(readlink "$p/ns/net" 2>/dev/null) == "$want" ]] && echo "${p#/proc/}"
    done
    return 0
}

# stop_node_ns NAME: SIGTERM, then SIGKILL, to everything in the node's network namespace (its
# munged, slurmd, jobs, agent), the holder last; removes the host side of its link.
stop_node_ns() {
    local name=$1 pid pids i
    pid=$(holder_pid "$name") || { rm -f "$(holder_pidfile "$name")"; return 0; }
    pids=$(pids_in_netns "$pid" | grep -vx "$pid" || true)
    if [[ -n $pids ]]; then
        # shellcheck disable=SC2086
        kill -TERM $pids 2>/dev/null || true
        for i in $(seq 1 50); do
            [[ -z $(pids_in_netns "$pid" | grep -vx "$pid") ]] && break
            sleep 0.1
        done
        pids=$(pids_in_netns "$pid" | grep -vx "$pid" || true)
        # shellcheck disable=SC2086
        [[ -z $pids ]] || kill -KILL $pids 2>/dev/null || true
    fi
    kill -KILL "$pid" 2>/dev/null || true
    rm -f "$(holder_pidfile "$name")"
    ip link del "$(node_veth "$name")" 2>/dev/null || true
    log "node $name: stopped"
}

node_munge_ok() { in_node "$1" munge -S "$MUNGE_SOCKET" -n </dev/null | unmunge -S "$MUNGE_SOCKET" >/dev/null; }

# munged for the controller (NAME empty) or for a compute node, always at $MUNGE_SOCKET as the
# node sees it; a compute node's credentials carry the node's address as their origin.
start_node_munge() {
    # Every credential names the address of the host that made it (its origin): the controller's
    # SlurmctldHost address, or the node's NodeAddr. The service checks that origin.
    local name=$1 origin=(--origin="$(ctld_addr)") logf=$LOG/munged.log
    if multi_node && [[ -n $name ]]; then
        origin=(--origin="$(node_addr "$name")")
        logf=$LOG/munged-$name.log
        if [[ -n $(pid_in_node "$name" munged "$NODES_DIR/$name/munge/munged.pid") ]]; then return 0; fi
    elif is_up munged; then
        return 0
    fi
    log "starting munged${name:+ on $name}"
    in_node "${name:-}" munged --force "${origin[@]}" \
        --key-file="$ETC/munge/munge.key" \
        --socket="$MUNGE_SOCKET" \
        --pid-file="$NODE_DIR/munge/munged.pid" \
        --log-file="$logf" \
        --seed-file="$NODE_DIR/munge/munged.seed" </dev/null >>"$logf" 2>&1 9>&- ||
        die "munged${name:+ on $name} failed to start; see $logf"
    if [[ -n $name ]] && multi_node; then
        wait_for "munged on $name" "$TIMEOUT_S" node_munge_ok "$name" || die "munge on $name not answering; see $logf"
    else
        wait_daemon munged "$logf" munge_ok || die "munge not answering; see $logf"
        STARTED+=(munged)
    fi
}

# pid_in_node NAME COMM PIDFILE: the pid in PIDFILE when it is a live COMM (is_daemon; prints
# nothing otherwise).
pid_in_node() {
    local pid
    [[ -r $3 ]] || return 0
    pid=$(tr -dc '0-9' <"$3")
    [[ -n $pid ]] && is_daemon "$pid" "$2" "$3" && echo "$pid"
    return 0
}

slurmd_pidfile() { if multi_node; then echo "$NODES_DIR/$1/slurmd.pid"; else echo "$NODE_DIR/slurmd.pid"; fi; }

node_state_of() { sinfo -h -N -n "$1" -o %t 2>/dev/null | head -n1; }

node_ready_named() {
    case $(node_state_of "$1") in
        idle | mix | mixed | alloc | allocated | comp | completing) return 0 ;;
        *) return 1 ;;
    esac
}

# node_registered_named NAME [EPOCH]: the node answers (not unk, no '*'), and its slurmd started at
# or after EPOCH (so a slurmd we just launched registered).
node_registered_named() {
    local st since=${2:-0} started
    st=$(node_state_of "$1")
    [[ -n $st && $st != unk* && $st != *'*' ]] || return 1
    ((since == 0)) && return 0
    started=$(scontrol show node "$1" | sed -n 's/.*SlurmdStartTime=\([^ ]*\).*/\1/p')
    [[ -n $started && $started != None ]] || return 1
    (($(date -d "$started" +%s) >= since))
}

# gres_used_holds_gpus GRESUSED: a node's GresUsed (scontrol show node -d) counts a GPU held
# ('gpu:2(IDX:0-1)', 'gpu:a100:1(IDX:0),gpu:h100:0(IDX:N/A)'; shards are not GPUs).
GPU_HELD_RE=',gpu(:[^:,(]+)?:[1-9]'
gres_used_holds_gpus() { [[ ,$1 =~ $GPU_HELD_RE ]]; }

# gpus_held_by_no_job NAME: prints the node's GresUsed when it counts GPUs held while no job runs
# there (22.05's GRES bugs leave that: docs/slurm-releases.md); fails otherwise.
gpus_held_by_no_job() {
    local jobs used
    jobs=$(squeue -h -w "$1" -t RUNNING,COMPLETING,CONFIGURING,SUSPENDED -o %i 2>/dev/null) || return 1
    [[ -z $jobs ]] || return 1
    used=$(scontrol show node -d "$1" 2>/dev/null | grep -o 'GresUsed=[^ ]*') || return 1
    used=${used#GresUsed=}
    gres_used_holds_gpus "$used" || return 1
    echo "$used"
}

no_gpus_held_by_no_job() { ! gpus_held_by_no_job "$1" >/dev/null; }

# start_node_slurmd NAME: slurmd of one compute node, registered and idle.
start_node_slurmd() {
    local name=$1 since=0 logf pidf
    logf=$(slurmd_logfile "$name")
    pidf=$(slurmd_pidfile "$name")
    if [[ -z $(pid_in_node "$name" slurmd "$pidf") ]]; then
        log "starting slurmd on $name (port $SLURMD_PORT)"
        since=$(($(date +%s) - 1))
        in_node "$name" slurmd -N "$name" </dev/null >>"$LOG/slurmd.stdout" 2>&1 9>&- ||
            die "slurmd on $name failed; see $logf"
        STARTED+=("slurmd@$name")
    fi
    wait_for "node $name to register" "$TIMEOUT_S" node_registered_named "$name" "$since" || {
        tail -n 15 "$logf" >&2 2>/dev/null || true
        die "node $name did not register; see $logf and $LOG/slurmctld.log"
    }
    if ! node_ready_named "$name"; then
        log "node $name is '$(node_state_of "$name")' ($(sinfo -h -N -n "$name" -o %E 2>/dev/null | head -n1)): resuming it"
        scontrol update nodename="$name" state=resume 2>/dev/null ||
            scontrol update nodename="$name" state=idle 2>/dev/null || true
        wait_for "node $name idle" "$TIMEOUT_S" node_ready_named "$name" ||
            die "node $name is '$(node_state_of "$name")'; see $logf and $LOG/slurmctld.log"
    fi
}

slurmd_logfile() { if multi_node; then echo "$NODES_DIR/$1/slurmd.log"; else echo "$NODE_DIR/slurmd.log"; fi; }

stop_all_slurmd() {
    local name pid
    local -a pids=()
    for name in $(compute_nodes); do
        pid=$(pid_in_node "$name" slurmd "$(slurmd_pidfile "$name")")
        [[ -n $pid ]] && pids+=("$pid")
    done
    stop_pids slurmd ${pids[@]+"${pids[@]}"}
}

# The slurm.conf lines of the nodes and the partition.
node_conf_lines() {
    local hw=$1 gres=$2 name
    if ! multi_node; then
        echo "NodeName=$(node_name) NodeAddr=127.0.0.1 $hw Gres=$gres State=UNKNOWN"
        return
    fi
    for name in $(compute_nodes); do
        echo "NodeName=$name NodeAddr=$(node_addr "$name") $hw Gres=$gres State=UNKNOWN"
    done
}

partition_nodes() { if multi_node; then echo "node[1-$NODES]"; else node_name; fi; }

# Bring up every compute node: namespaces and munged first (slurmctld must reach them).
nodes_up() {
    local name
    multi_node || return 0
    bridge_up
    for name in $(compute_nodes); do
        start_node_ns "$name"
        start_node_munge "$name"
    done
}

# Stop compute nodes that are no longer wanted or all of them (ALL=1), and the bridge when none is left.
nodes_down() {
    local all=${1:-0} f name keep
    for f in "$NODES_DIR"/*.pid; do
        [[ -e $f ]] || continue
        name=$(basename "$f" .pid)
        keep=0
        if ((!all)) && multi_node && [[ $name =~ ^node([0-9]+)$ ]] && ((BASH_REMATCH[1] <= NODES)); then keep=1; fi
        if ((!all)) && two_ctlds && [[ $name == ctl[12] ]]; then keep=1; fi
        ((keep)) || stop_node_ns "$name"
    done
    if ((all)) || ! multi_node; then
        ip link del "$BRIDGE" 2>/dev/null || true
    fi
}
