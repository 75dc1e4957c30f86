#!/usr/bin/env bash
# swapaware dev cluster: a real single-node Slurm (22.05, 24.11 or 26.05: whichever is installed;
# munge, MariaDB,
# slurmdbd, slurmctld, slurmd) with four fake GPUs, started by hand (no
# systemd) under one state directory. Must run as root on Debian 12 or 13 (or in a Debian root).
#
#   cluster.sh install | up | down [--purge] | status | env | restart-ctld | plugin on|off
#
# See README.md next to this file for the environment variables.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
TEMPLATES=$HERE/templates

STATE=$(realpath -m "${SWAPAWARE_DEV_DIR:-/var/tmp/swapaware-dev}")
ETC=$STATE/etc
LOG=$STATE/log
SPOOL=$STATE/spool
RUN=$STATE/run
DEV=$STATE/dev
MYSQL=$STATE/mysql

CLUSTER=swapaware-dev
CTLD_PORT=${SWAPAWARE_CTLD_PORT:-6817}
SLURMD_PORT=${SWAPAWARE_SLURMD_PORT:-6818}
DBD_PORT=${SWAPAWARE_DBD_PORT:-6819}
DB_PORT=${SWAPAWARE_DB_PORT:-6816}
OVERSUBSCRIBE=${SWAPAWARE_OVERSUBSCRIBE:-FORCE:8}
DEF_MEM_PER_CPU=${SWAPAWARE_DEF_MEM_PER_CPU:-256}
MIN_JOB_AGE=${SWAPAWARE_MIN_JOB_AGE:-30}
PLUGIN_TIMEOUT_MS=${SWAPAWARE_PLUGIN_TIMEOUT_MS:-200}
TIMEOUT_S=${SWAPAWARE_DEV_TIMEOUT_S:-60}
SLURMD_TIMEOUT=${SWAPAWARE_SLURMD_TIMEOUT:-60}  # seconds before an unresponsive node is DOWN
GPU_TYPES=${SWAPAWARE_DEV_GPU_TYPES:-a100,a100,h100,h100}
# A mixed fleet: the fake GPUs' memory in GiB (gpu_gib; the node agents' fake NVML is made from
# it), and the memory of one shard on every GPU; each GPU gets its memory in shards (40/48/80 GiB:
# 4/4/8), as swapaware gres-conf writes it.
SHARD_GIB=${SWAPAWARE_DEV_SHARD_GIB:-10}

SLURM_CONF_PATH=$ETC/slurm.conf
MUNGE_SOCKET=$STATE/node/munge/munge.socket.2  # per node: see nodes.sh
MYSQL_SOCKET=$MYSQL/mysqld.sock
export SLURM_CONF=$SLURM_CONF_PATH

# munge + libmunge2: also the tests' private munged (tests/adapter/trust/test_munge.py); openssl: the
# TLS tests' certificates (tests/adapter/trust/test_tls.py); lua-posix: job_submit's admission table
# path stats the table (slurm_plugin/swapaware_table.lua).
PACKAGES=(munge libmunge2 slurm-client slurmctld slurmd slurmdbd mariadb-server mariadb-client
          lua5.1 lua-socket lua-cjson lua-posix util-linux iproute2 openssl)

log() { printf '[dev-cluster] %s\n' "$*" >&2; }
die() { printf '[dev-cluster] ERROR: %s\n' "$*" >&2; exit 1; }

need_root() { [[ $(id -u) -eq 0 ]] || die "must run as root"; }

node_name() { hostname -s 2>/dev/null || uname -n | cut -d. -f1; }

# slurm_release: "22.05", "24.11", ... of the installed slurmctld (empty when not installed).
slurm_release() { slurmctld -V 2>/dev/null | sed -n 's/^slurm[^0-9]*\([0-9]*\.[0-9]*\).*/\1/p'; }

# shellcheck source=nodes.sh
source "$HERE/nodes.sh"
# shellcheck source=controllers.sh
source "$HERE/controllers.sh"
# shellcheck source=config.sh
source "$HERE/config.sh"
# shellcheck source=daemons.sh
source "$HERE/daemons.sh"
# shellcheck source=processes.sh
source "$HERE/processes.sh"

# version_ge A B: A >= B for dotted versions.

# gpu_gib: the fake GPUs' GiB, comma-separated. Mixed by default; on 22.05 all 80 GiB: there, with
# per-GPU counts of 4/4/8/8, the idle node was seen with every GPU allocated to no job after gpu and
# shard jobs ran side by side (docs/slurm-releases.md; swapaware doctor's shard_counts).
gpu_gib() {
    local rel
    rel=$(slurm_release)
    if [[ -n ${SWAPAWARE_DEV_GPU_GIB:-} ]]; then echo "$SWAPAWARE_DEV_GPU_GIB"
    elif [[ -n $rel ]] && ! version_ge "$rel" 23.11; then echo 80,80,80,80
    else echo 40,48,80,80; fi
}

version_ge() { [[ $(printf '%s\n%s\n' "$1" "$2" | sort -V | head -n1) == "$2" ]]; }

# ---------------------------------------------------------------- install
cmd_install() {  # [EXTRA PACKAGE...]: installed beside the cluster's own (the test suite's chromium)
    need_root
    local missing=() p st
    for p in "${PACKAGES[@]}" "$@"; do
        st=$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null || true)
        [[ $st == installed ]] || missing+=("$p")
    done
    if ((${#missing[@]} == 0)); then
        return 0
    fi
    log "installing: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    # We start our own daemons by hand: keep the packages' postinst scripts
    # from starting system ones (munge, mariadb) where no policy-rc.d says so.
    local policy=/usr/sbin/policy-rc.d own_policy=0 rc=0
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy"
        chmod 755 "$policy"
        own_policy=1
    fi
    { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}"; } >&2 || rc=$?
    if ((own_policy)); then rm -f "$policy"; fi
    ((rc == 0)) || die "apt-get install failed (rc $rc)"
}

# ---------------------------------------------------------------- commands
cmd_up() {
    need_root
    local t0=$SECONDS
    cmd_install
    make_dirs
    make_devices
    make_secrets
    render_all

    if ((CHANGED_SLURM)); then
        log "slurm.conf/gres.conf changed: restarting slurmctld and slurmd (if running)"
        stop_all_slurmd
        stop_daemons 20 slurmctld
        stop_ctls
    fi
    nodes_down 0  # nodes of an earlier, larger cluster
    echo "$NODES" >"$ETC/nodes"
    echo "$CONTROLLERS" >"$ETC/controllers"

    start_munge
    nodes_up
    ctls_up
    start_mariadb
    setup_db_user
    setup_history_db
    start_slurmdbd
    setup_associations
    if two_ctlds; then start_ctls; else start_slurmctld; fi
    start_slurmd

    local d
    echo "swapaware dev cluster '$CLUSTER' is up on node $(node_name) (took $((SECONDS - t0))s)"
    if ((${#STARTED[@]})); then
        echo "  started now: ${STARTED[*]}"
    else
        echo "  all daemons were already running"
    fi
    for d in munged mariadbd slurmdbd slurmctld; do
        printf '  %-9s pid %s\n' "$d" "$(pid_of "$d" || echo '?')"
    done
    for d in $(compute_nodes); do
        printf '  slurmd    pid %s on %s (%s)\n' "$(pid_in_node "$d" slurmd "$(slurmd_pidfile "$d")")" "$d" \
            "$(if multi_node; then node_addr "$d"; else echo 127.0.0.1; fi)"
    done
    echo "  config:   $ETC (slurm.conf, gres.conf, slurmdbd.conf, swapaware_plugin.conf)"
    echo "  logs:     $LOG"
    echo "  JobSubmitPlugins: $(grep -q '^JobSubmitPlugins=lua' "$ETC/slurm.conf" && echo lua || echo off)"
    echo "  stop with: $HERE/cluster.sh down   (add --purge to delete $STATE)"
    echo "  use it with:"
    echo "export SLURM_CONF=$SLURM_CONF_PATH"
}

cmd_down() {
    need_root
    local purge=0
    case ${1:-} in
        --purge) purge=1 ;;
        "") ;;
        *) die "usage: cluster.sh down [--purge]" ;;
    esac
    if ((purge)) && { is_up slurmctld || [[ -n $(ctl_pid ctl1)$(ctl_pid ctl2) ]]; }; then
        log "cancelling all jobs"
        squeue -h -o %i 2>/dev/null | xargs -r scancel 2>/dev/null || true
        wait_for "jobs to end" 20 no_jobs || true
    fi
    # slurmctld flushes to slurmdbd, which writes to MariaDB; both need munge.
    stop_all_slurmd
    stop_daemons 20 slurmctld
    stop_ctls
    stop_daemons 20 slurmdbd
    nodes_down 1  # each node's munged, agent and whatever else runs there
    stop_daemons 30 mariadbd munged
    if ((purge)); then
        kill_stray_steps
        log "removing $STATE"
        rm -rf "$STATE"
    fi
    if ((purge)); then
        echo "swapaware dev cluster is down (state dir $STATE removed)"
    else
        echo "swapaware dev cluster is down (state kept in $STATE)"
    fi
}

no_jobs() { [[ -z $(squeue -h -o %i 2>/dev/null) ]]; }

cmd_status() {
    local d pid rc=0 name
    echo "state dir: $STATE"
    for name in $(compute_nodes); do
        if pid=$(pid_in_node "$name" slurmd "$(slurmd_pidfile "$name")") && [[ -n $pid ]]; then
            printf '  slurmd    up   (pid %s) on %s\n' "$pid" "$name"
        else
            printf '  slurmd    down on %s\n' "$name"
            rc=1
        fi
    done
    for d in munged mariadbd slurmdbd slurmctld; do
        if pid=$(pid_of "$d"); then
            printf '  %-9s up   (pid %s)\n' "$d" "$pid"
        elif [[ -e $(pidfile_of "$d") && ! -r $(pidfile_of "$d") ]]; then
            printf '  %-9s ?    (pid file not readable: run as root)\n' "$d"
        else
            printf '  %-9s down\n' "$d"
            rc=1
        fi
    done
    if [[ -f $ETC/slurm.conf ]]; then
        echo "  JobSubmitPlugins: $(grep -q '^JobSubmitPlugins=lua' "$ETC/slurm.conf" && echo lua || echo off)"
    fi
    if is_up slurmctld; then
        scontrol ping || true
        sinfo || true
    fi
    return $rc
}

cmd_env() {
    if [[ -f $ETC/swapaware.env ]]; then
        grep '^export ' "$ETC/swapaware.env"
    else
        echo "export SLURM_CONF=$SLURM_CONF_PATH"
        echo "export SWAPAWARE_DEV_DIR=$STATE"
        echo "export SWAPAWARE_SOCKET=${SWAPAWARE_SOCKET:-$RUN/swapaware.sock}"
    fi
}

cmd_restart_ctld() {
    need_root
    [[ -f $ETC/slurm.conf ]] || die "no $ETC/slurm.conf: run 'cluster.sh up' first"
    restart_ctld
    echo "slurmctld restarted (pid $(pid_of slurmctld || ctl_pid ctl1))"
}

cmd_plugin() {
    need_root
    local mode=${1:-}
    [[ -f $ETC/slurm.conf ]] || die "no $ETC/slurm.conf: run 'cluster.sh up' first"
    case $mode in
        on)
            if [[ -n ${SWAPAWARE_LUA_DIR:-} ]]; then
                [[ -f $SWAPAWARE_LUA_DIR/job_submit.lua ]] ||
                    die "SWAPAWARE_LUA_DIR=$SWAPAWARE_LUA_DIR has no job_submit.lua"
                copy_lua "$SWAPAWARE_LUA_DIR"
            fi
            [[ -f $ETC/job_submit.lua ]] || die "no $ETC/job_submit.lua: set SWAPAWARE_LUA_DIR"
            sed -i 's/^#\?JobSubmitPlugins=.*/JobSubmitPlugins=lua/' "$ETC/slurm.conf"
            ;;
        off)
            sed -i 's/^#\?JobSubmitPlugins=.*/#JobSubmitPlugins=lua (off; set SWAPAWARE_LUA_DIR or run: cluster.sh plugin on)/' \
                "$ETC/slurm.conf"
            ;;
        *) die "usage: cluster.sh plugin on|off" ;;
    esac
    grep -q '^#\?JobSubmitPlugins=' "$ETC/slurm.conf" || die "slurm.conf has no JobSubmitPlugins line"
    restart_ctld
    echo "JobSubmitPlugins $mode (slurmctld pid $(pid_of slurmctld || ctl_pid ctl1))"
}

usage() {
    cat <<EOF
usage: $(basename "$0") COMMAND
  install         install missing Debian packages
  up              install, render config into \$SWAPAWARE_DEV_DIR ($STATE), start
                  munged, mariadbd, slurmdbd, slurmctld, slurmd (idempotent)
  down [--purge]  stop the daemons (--purge: also cancel jobs and delete the state dir)
  status          daemons up/down and sinfo (exit 1 if any is down)
  env             print export lines (eval "\$($(basename "$0") env)")
  restart-ctld    restart slurmctld only
  plugin on|off   set/unset JobSubmitPlugins=lua and restart slurmctld
  nodes           the compute nodes' names
  node-exec NODE COMMAND...
                  COMMAND inside a compute node's namespaces (network, host name, mounts)
  controllers | ctl-pid CTL | in-control | start-ctl CTL | hand-back | cut CTL | uncut CTL
                  with SWAPAWARE_DEV_CONTROLLERS=2 (controllers.sh): the controllers' names, a
                  slurmctld's pid, the one in control, start one, control back to ctl1 (the
                  backup stopped first), cut one off (link and state) and back
SWAPAWARE_DEV_NODES=N with up: N compute nodes, each in namespaces of its own (nodes.sh);
0 (default) runs slurmd beside slurmctld. Other commands use what the last 'up' chose.
EOF
}

# One mutating command at a time per state dir (fd 9; daemons get 9>&-).
take_lock() {
    need_root
    mkdir -p "$STATE"
    exec 9>"$STATE/.lock"
    flock -w "$((TIMEOUT_S * 5))" 9 || die "another cluster.sh holds $STATE/.lock"
}

main() {
    local cmd=${1:-}
    shift || true
    [[ $cmd == up ]] || { nodes_init other; controllers_init other; }
    case $cmd in
        install) cmd_install "$@" ;;
        up) take_lock; nodes_init up; controllers_init up; cmd_up ;;
        down) take_lock; cmd_down "$@" ;;
        status) cmd_status ;;
        env) cmd_env ;;
        restart-ctld) take_lock; cmd_restart_ctld ;;
        plugin) take_lock; cmd_plugin "$@" ;;
        nodes) compute_nodes ;;
        controllers) controller_names ;;
        ctl-pid) ctl_pid "${1:?ctl-pid ctlN}" ;;
        in-control) for n in $(controller_names); do if ctl_in_control "$n"; then echo "$n"; fi; done ;;
        start-ctl) take_lock; start_ctl "${1:?start-ctl ctlN}" ;;
        hand-back) take_lock; cmd_hand_back ;;
        cut) cmd_cut "$@" ;;
        uncut) cmd_uncut "$@" ;;
        gpus) echo "gpu_gib=$(gpu_gib) shard_gib=$SHARD_GIB types=$GPU_TYPES shards=${SWAPAWARE_DEV_GPU_SHARDS:-}" ;;
        node-exec) exec_in_node "${1:?node-exec NODE COMMAND...}" "${@:2}" ;;
        -h | --help | help) usage ;;
        *) usage >&2; exit 2 ;;
    esac
}

main "$@"
