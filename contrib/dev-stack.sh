#!/usr/bin/env bash
# swapaware dev stack: the real Slurm of contrib/dev-cluster/ wired to swapaware (job_submit.lua,
# prolog/epilog, policy service, a node agent per compute node on fake GPUs).
#
#   dev-stack.sh up [--nodes N] | down [--purge] | status | service-stop | service-start | env | venv | tls
#
# --nodes N: a controller plus N compute nodes, each in namespaces of its own (network, host name,
# mounts: contrib/dev-cluster/nodes.sh) with its own slurmd, munged, agent, spool and fake GPUs;
# without it, one node beside the controller.
#
# Environment: SWAPAWARE_DEV_DIR (state, default /var/tmp/swapaware-dev), SWAPAWARE_VENV
# (default <repo>/.venv), SWAPAWARE_GRPC_PORT (default 50551) and the port variables of
# contrib/dev-cluster/cluster.sh. SWAPAWARE_DEV_TLS=0 turns TLS off (plaintext gRPC; default 1: a
# private CA and the service's certificate in $STATE/tls, made with the openssl CLI).
# The admission table is on, as with the product's defaults (SWAPAWARE_DEV_TABLE=0 turns it off:
# every job takes the Admit round trip): the service publishes it at $STATE/run/admission.json ([admission] table_path; with
# SWAPAWARE_DEV_CONTROLLERS=2 at $STATE/spool/admission.json, which both controllers see) and the
# plugin's swapaware_plugin.conf names it (cluster.sh, SWAPAWARE_TABLE). Runs as root on Debian 12 or 13 (or in a release's root, contrib/matrix/). Running `up` twice is harmless.
#
# This file holds the settings, the config it writes and the commands; it sources
# dev-stack-tls.sh (the private CA and [tls]) and dev-stack-daemons.sh (the service and the node
# agents started, waited for and stopped).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CLUSTER=$ROOT/contrib/dev-cluster/cluster.sh
STATE=${SWAPAWARE_DEV_DIR:-/var/tmp/swapaware-dev}
STATE=${STATE%/}
export SWAPAWARE_DEV_DIR=$STATE
VENV=${SWAPAWARE_VENV:-$ROOT/.venv}
GRPC_PORT=${SWAPAWARE_GRPC_PORT:-50551}
CONF=$STATE/etc/swapaware.toml
DEV_TLS=${SWAPAWARE_DEV_TLS:-1}
[[ $DEV_TLS == [01] ]] || { printf '[dev-stack] ERROR: SWAPAWARE_DEV_TLS must be 0 or 1, got %s\n' "$DEV_TLS" >&2; exit 1; }
TLSDIR=$STATE/tls
DEV_TABLE=${SWAPAWARE_DEV_TABLE:-1}
[[ $DEV_TABLE == [01] ]] || { printf '[dev-stack] ERROR: SWAPAWARE_DEV_TABLE must be 0 or 1, got %s\n' "$DEV_TABLE" >&2; exit 1; }
# The fake GPUs as cluster.sh makes them (gres.conf and the agents' fake NVML agree): GiB per GPU,
# GiB per shard.
read -r GPU_GIB SHARD_GIB _ < <("$CLUSTER" gpus | sed 's/[a-z_]*=//g')
GPU_GIB_MAX=$(tr ',' '\n' <<<"$GPU_GIB" | sort -n | tail -n1)
RUN=$STATE/run
LOGDIR=$STATE/log
SOCK=$RUN/swapaware.sock
# What belongs to a compute node, as the node sees it ($STATE/node: each node has its own).
NODE=$STATE/node
AGENT_SOCK=$NODE/agent.sock
FAKE=$NODE/fake-nvml
# The service reads job records with scontrol/sacct: point them at this cluster.
export SLURM_CONF=$STATE/etc/slurm.conf

log() { printf '[dev-stack] %s\n' "$*" >&2; }
die() { printf '[dev-stack] ERROR: %s\n' "$*" >&2; exit 1; }

# shellcheck source=dev-stack-tls.sh
source "$ROOT/contrib/dev-stack-tls.sh"
# shellcheck source=dev-stack-daemons.sh
source "$ROOT/contrib/dev-stack-daemons.sh"

ensure_python() {
    local py=${PYTHON:-python3}
    command -v "$py" >/dev/null || die "python3 not found"
    if ! "$py" -c 'import ensurepip, venv' 2>/dev/null; then
        log "installing python3-venv"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -q python3-venv python3-pip >/dev/null
    fi
    local stamp_src stamp
    stamp_src=$(cat "$ROOT/pyproject.toml" "$ROOT/setup.py" "$ROOT"/protos/swapaware/v1/*.proto | sha256sum | cut -c1-16)
    stamp=$VENV/.swapaware-stamp
    if [[ -x $VENV/bin/swapaware && -f $stamp && $(cat "$stamp") == "$stamp_src" ]]; then
        return 0
    fi
    log "building the virtual environment in $VENV (pip install -e '.[test]')"
    [[ -x $VENV/bin/python ]] || "$py" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
    (cd "$ROOT" && "$VENV/bin/python" -m pip install -q -e '.[test]')
    echo "$stamp_src" >"$stamp"
}

admission_section() {
    if [[ $DEV_TABLE == 1 ]]; then
        cat <<EOF
[admission]
# SWAPAWARE_DEV_TABLE=1: the service publishes the admission table here and the plugin decides
# from it (swapaware_plugin.conf table=, written by cluster.sh from SWAPAWARE_TABLE).
table_path = "$(table_path)"
EOF
    else
        printf '[admission]\n# SWAPAWARE_DEV_TABLE=0: no table (every job takes the Admit round trip)\ntable_path = ""\n'
    fi
}

# Two controllers (SWAPAWARE_DEV_CONTROLLERS=2, contrib/dev-cluster/controllers.sh): a service on
# each, in the controller's namespaces ($RUN there is its own: socket, role file, journal), both on
# the cluster's MariaDB; hooks, agents and the CLI know both addresses.
controllers() { if ((CONTROLLERS == 2)); then echo ctl1; echo ctl2; fi; }
ctl_addr() { echo "${SWAPAWARE_DEV_SUBNET:-10.77.0}.$((1 + ${1#ctl}))"; }
ctl_conf() { echo "$STATE/etc/swapaware-$1.toml"; }
ctl_run() { echo "$STATE/nodes/$1/run"; }
# The admission table (SWAPAWARE_DEV_TABLE=1): in $RUN with one controller; with two, where both
# controllers' plugins see it and either service can write it (only the writer does, docs/ha.md):
# beside the shared StateSaveLocation ($STATE/spool/ctld), not in $RUN (each controller's own).
table_path() { if ((CONTROLLERS == 2)); then echo "$STATE/spool/admission.json"; else echo "$RUN/admission.json"; fi; }

ha_sections() {
    if ((CONTROLLERS != 2)); then
        printf '# [history] sqlite and [ha] off: SWAPAWARE_DEV_CONTROLLERS=2 runs two controllers\n'
        return 0
    fi
    cat <<EOF
[history]
backend = "mariadb"
host = "$(ctld_addr)"
port = ${SWAPAWARE_DB_PORT:-6816}
database = "swapaware"
user = "swapaware"
password_file = "$STATE/etc/swapaware-db.pass"
connect_timeout_s = 2.0

[ha]
enabled = true
holder = ""
lease_ttl_s = ${SWAPAWARE_DEV_LEASE_TTL_S:-5.0}
renew_s = 1.0
controllers = ["$(ctl_addr ctl1):$GRPC_PORT", "$(ctl_addr ctl2):$GRPC_PORT"]
role_file = "$RUN/role"
EOF
}

write_config() {
    mkdir -p "$STATE/etc" "$STATE/bin" "$RUN" "$LOGDIR" "$STATE/lib"
    local addr
    addr=$(ctld_addr)
    if [[ $DEV_TLS == 1 ]]; then ensure_tls; fi
    cat >"$CONF" <<EOF
# written by contrib/dev-stack.sh
[gpu]
# The largest fake GPU and its shards: one shard is $SHARD_GIB GiB on every GPU (cluster.sh gpus).
memory_bytes = $((GPU_GIB_MAX * 1073741824))
shards_per_gpu = $((GPU_GIB_MAX / SHARD_GIB))

[policy]
# A one-node demo cluster with 4 GPUs rarely has a queue: share as soon as a job's memory is
# known (the production default, 0.05, keeps jobs whole while no GPU work waits).
share_min_queue = 0.0
queue_poll_s = 2.0

[estimator]
# A class shares from its second run (after one observed run), so that a test or a demo sees the
# move to shards at once; the production default, 3, keeps a class whole for its first 3 runs
# (docs/model.md, operating curve).
min_samples = 1

[service]
grpc_address = "$addr:$GRPC_PORT"
socket_path = "$SOCK"
db_path = "$(if ((CONTROLLERS == 2)); then echo "$RUN"; else echo "$STATE/lib"; fi)/history.sqlite3"
slurm_backend = "cli"

[auth]
# Events carry a MUNGE credential of the node's munged (its origin: the node's address); the
# service takes them only from root or SlurmUser on a node of the cluster. (Sites without MUNGE
# on the service host use service.token_file / hooks.token_file instead: docs/admin-guide.md.)
munge = "on"
munge_socket = "$NODE/munge/munge.socket.2"

[hooks]
service_address = "$(if ((CONTROLLERS == 2)); then ctl_addr ctl1; else echo "$addr"; fi):$GRPC_PORT"
deadline_s = 2.0
spool_dir = "$NODE/spool"
agent_socket = "$AGENT_SOCK"

[agent]
socket_path = "$AGENT_SOCK"
sample_period_s = 0.2
nvml_backend = "fake"
fake_nvml_dir = "$FAKE"
# Spooled events are delivered by the agent within a few seconds of the service's return.
replay_interval_s = 1.0
replay_max_backoff_s = 4.0

$(tls_section)

$(admission_section)

$(ha_sections)
EOF
    local n
    for n in $(controllers); do  # each controller's service: its own address and lease holder name
        sed -e "s|^grpc_address = .*|grpc_address = \"$(ctl_addr "$n"):$GRPC_PORT\"|" \
            -e "s|^holder = .*|holder = \"$n\"|" "$CONF" >"$(ctl_conf "$n")"
    done
    local hook
    open_log "$LOGDIR/hooks.log"
    for hook in prolog epilog; do
        cat >"$STATE/bin/$hook" <<EOF
#!/bin/sh
# slurmd runs this as root. swapaware-$hook always exits 0; so does this wrapper, even when
# the hook cannot start at all (a non-zero exit would drain the node). Its log is 0640 whatever
# slurmd's umask.
export SWAPAWARE_CONFIG=$CONF
umask 027
$VENV/bin/swapaware-$hook >>$LOGDIR/hooks.log 2>&1
exit 0
EOF
        chmod 0755 "$STATE/bin/$hook"
    done
    # SlurmctldPrimaryOnProg / OffProg: run by slurmctld (as SlurmUser) on its controller host.
    for hook in on off; do
        printf '#!/bin/sh\nexec %s/bin/swapaware ha primary-%s --config %s/etc/swapaware-"$(hostname)".toml >>%s/primary.log 2>&1\n' \
            "$VENV" "$hook" "$STATE" "$RUN" >"$STATE/bin/primary-$hook"
        chmod 0755 "$STATE/bin/primary-$hook"
    done
    # TaskProlog: runs as the job's user; prints the memory cap of shard jobs ("export" lines).
    # --config: this cluster's file (its fake GPUs: the cap's fractions are of the job's own GPU).
    printf '#!/bin/sh\nexec %s/bin/python -I -m slurm_plugin.task_prolog --config %s\n' "$VENV" "$CONF" \
        >"$STATE/bin/task-prolog"
    chmod 0755 "$STATE/bin/task-prolog"
}

# The compute nodes (as cluster.sh knows them) and where the controller listens for them.
nodes() { "$CLUSTER" nodes; }
multi_node() { [[ ${NODES:-0} != 0 ]]; }
ctld_addr() { if multi_node; then echo "${SWAPAWARE_DEV_SUBNET:-10.77.0}.1"; else echo 127.0.0.1; fi; }
# The directory a node keeps for itself, seen from the controller.
node_dir() { if multi_node; then echo "$STATE/nodes/$1"; else echo "$NODE"; fi; }

cmd_up() {
    [[ $(id -u) -eq 0 ]] || die "must run as root (it starts Slurm's daemons)"
    "$CLUSTER" install
    ensure_python
    export SWAPAWARE_DEV_NODES=${NODES:-0}
    write_config
    stop_agents  # of an earlier cluster with other nodes
    SWAPAWARE_LUA_DIR=$ROOT/slurm_plugin SWAPAWARE_PROLOG=$STATE/bin/prolog SWAPAWARE_EPILOG=$STATE/bin/epilog \
        SWAPAWARE_TASK_PROLOG=$STATE/bin/task-prolog SWAPAWARE_DEV_CONTROLLERS=$CONTROLLERS \
        SWAPAWARE_PRIMARY_ON=$(if ((CONTROLLERS == 2)); then echo "$STATE/bin/primary-on"; fi) \
        SWAPAWARE_PRIMARY_OFF=$(if ((CONTROLLERS == 2)); then echo "$STATE/bin/primary-off"; fi) \
        SWAPAWARE_SOCKET=$SOCK SWAPAWARE_DEV_TABLE=$DEV_TABLE SWAPAWARE_TABLE="$(table_path)" "$CLUSTER" up
    # Agents before any job can start (nothing is submitted before `up` returns); the service
    # after the cluster: it reads Slurm's release and its first queue snapshot before it answers.
    start_agents
    service_start
    cat <<EOF

swapaware dev stack is up.
  $(cmd_env | tr '\n' ' ')
  compute nodes:  $(nodes | tr '\n' ' ')
  policy service: gRPC $(ctld_addr):$GRPC_PORT ($(if [[ $DEV_TLS == 1 ]]; then echo "TLS, CA $TLSDIR/ca.pem"; else echo plaintext; fi)), socket $SOCK, log $LOGDIR/swapaware.log
  node agents:    $AGENT_SOCK on each node (fake NVML in $FAKE), logs $LOGDIR/agent-<node>.log
  hooks log:      $LOGDIR/hooks.log
  explain a job:  SWAPAWARE_CONFIG=$CONF $VENV/bin/swapaware explain <jobid>
  on a node:      bash $CLUSTER node-exec <node> COMMAND...
  stop:           bash $ROOT/contrib/dev-stack.sh down
EOF
}

cmd_down() {
    stop_agents
    services_stop
    "$CLUSTER" down "$@"
}

cmd_status() {
    local n
    if pid_alive "$RUN/swapaware.pid"; then echo "swapaware: up (pid $(cat "$RUN/swapaware.pid"))"; else echo "swapaware: down"; fi
    for n in $(nodes); do
        if pid_alive "$(node_dir "$n")/agent.pid"; then echo "agent on $n: up (pid $(cat "$(node_dir "$n")/agent.pid"))"
        else echo "agent on $n: down"; fi
    done
    "$CLUSTER" status || true
}

cmd_env() {
    "$CLUSTER" env
    echo "export SWAPAWARE_CONFIG=$CONF"
}

# The node count: `up --nodes N`; other commands use what the last `up` chose.
NODES=$(cat "$STATE/etc/nodes" 2>/dev/null || echo 0)
CONTROLLERS=$(cat "$STATE/etc/controllers" 2>/dev/null || echo 1)
case ${1:-} in
    up)
        NODES=0
        if [[ ${2:-} == --nodes ]]; then NODES=${3:?--nodes needs a count}; elif [[ ${2:-} == --nodes=* ]]; then NODES=${2#--nodes=}; fi
        [[ $NODES =~ ^[0-9]+$ ]] || die "--nodes needs a count, got '$NODES'"
        CONTROLLERS=${SWAPAWARE_DEV_CONTROLLERS:-1}
        cmd_up ;;
    down) shift; cmd_down "$@" ;;
    status) cmd_status ;;
    env) cmd_env ;;
    venv) ensure_python ;;
    tls) ensure_tls; echo "$TLSDIR" ;;
    service-stop) services_stop ;;
    service-start) service_start ;;
    *) echo "usage: $0 up [--nodes N] | down [--purge] | status | env | venv | tls | service-stop | service-start" >&2; exit 2 ;;
esac
