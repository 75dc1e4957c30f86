# shellcheck shell=bash
# The dev cluster's configuration, sourced by cluster.sh: its directories, devices and secrets, and
# slurm.conf, gres.conf, slurmdbd.conf and swapaware's files rendered from templates/ (CHANGED_*:
# whether a render changed what the running daemons read), with the helpers that render them
# (render, replace_if_changed, node_hw, check_socket_path).

CHANGED_SLURM=0
CHANGED_DBD=0

make_dirs() {
    mkdir -p "$STATE"
    chmod 755 "$STATE"
    mkdir -p "$ETC" "$LOG" "$SPOOL/ctld" "$RUN" "$DEV" "$MYSQL" "$NODE_DIR/munge" "$NODE_DIR/slurmd" "$NODES_DIR"
    chmod 755 "$ETC" "$LOG" "$SPOOL" "$RUN" "$DEV" "$MYSQL" "$NODE_DIR" "$NODES_DIR"
    mkdir -p "$ETC/munge"
    # The key stays private; munged's socket directory is open to every local user (as /run/munge
    # is): users' `swapaware explain` and Slurm's commands make credentials through it.
    chmod 700 "$ETC/munge"
    chmod 755 "$NODE_DIR/munge"
}

make_devices() {
    local i
    for i in 0 1 2 3; do
        local f=$DEV/nvidia$i
        if [[ -c $f ]]; then continue; fi
        rm -f "$f"
        if ! mknod -m 666 "$f" c 195 "$i" 2>/dev/null; then
            log "WARNING: mknod $f failed; using a plain file (jobs will get no CUDA_VISIBLE_DEVICES)"
            : >"$f"
        fi
    done
}

make_secrets() {
    if [[ ! -s $ETC/munge/munge.key ]]; then
        if command -v mungekey >/dev/null; then
            mungekey -c -k "$ETC/munge/munge.key"
        else
            dd if=/dev/urandom of="$ETC/munge/munge.key" bs=1024 count=1 status=none
        fi
    fi
    chmod 600 "$ETC/munge/munge.key"
    if [[ ! -s $ETC/db.pass ]]; then
        (umask 077; head -c 18 /dev/urandom | base64 | tr -d '/+=\n' >"$ETC/db.pass")
    fi
    chmod 600 "$ETC/db.pass"
}

# hook_line KEY VAR: "KEY=<path>" from the environment variable VAR (an absolute path to an
# executable), or a commented-out line saying how to set it.
hook_line() {
    local key=$1 var=$2 path=${!2:-}
    if [[ -z $path ]]; then
        echo "#$key= (unset; set $var)"
        return 0
    fi
    [[ $path == /* && -x $path ]] || die "$var must be an absolute path to an executable: $path"
    echo "$key=$path"
}

# table_lines: swapaware_plugin.conf's admission table keys. The table path is on unless
# SWAPAWARE_DEV_TABLE=0 (then table= is empty: off; the plugin's default is on): table= is SWAPAWARE_TABLE (the service's [admission] table_path, which dev-stack.sh
# passes; default $RUN/admission.json), its owner root (the dev service runs as root), and
# slurm_release= the installed slurmctld's release (a table of another dialect is never used).
table_lines() {
    if [[ ${SWAPAWARE_DEV_TABLE:-1} != 1 ]]; then
        echo "table="
        return 0
    fi
    local table=${SWAPAWARE_TABLE:-$RUN/admission.json}
    [[ $table == /* ]] || die "SWAPAWARE_TABLE must be an absolute path: $table"
    printf 'table=%s\ntable_uids=0\nslurm_release=%s\n' "$table" "$(slurm_release)"
}

render_all() {
    local node socket lua_on=0 f
    node=$(node_name)
    socket=${SWAPAWARE_SOCKET:-$RUN/swapaware.sock}
    [[ $socket == /* ]] || die "SWAPAWARE_SOCKET must be an absolute path: $socket"
    check_socket_path "$MUNGE_SOCKET"
    check_socket_path "$MYSQL_SOCKET"
    check_socket_path "$socket"

    export R_CLUSTER=$CLUSTER R_NODE=$node R_STATE=$STATE R_ETC=$ETC R_CTLD_ADDR=$(ctld_addr)
    export R_SLURMD_TIMEOUT=$SLURMD_TIMEOUT R_PARTITION_NODES=$(partition_nodes)
    R_CTLD_HOST_LINES=$(ctld_host_lines)
    R_CTLD_LOGFILE=$(ctld_logfile_conf)
    R_DBD_HOST=$(dbd_host)
    R_CTLD_TIMEOUT=$(if two_ctlds; then echo "$CTLD_TIMEOUT"; else echo 30; fi)
    R_PRIMARY_ON_LINE=$(hook_line SlurmctldPrimaryOnProg SWAPAWARE_PRIMARY_ON)
    R_PRIMARY_OFF_LINE=$(hook_line SlurmctldPrimaryOffProg SWAPAWARE_PRIMARY_OFF)
    export R_CTLD_HOST_LINES R_CTLD_LOGFILE R_DBD_HOST R_CTLD_TIMEOUT R_PRIMARY_ON_LINE R_PRIMARY_OFF_LINE
    export R_CTLD_PORT=$CTLD_PORT R_SLURMD_PORT=$SLURMD_PORT R_DBD_PORT=$DBD_PORT R_DB_PORT=$DB_PORT
    export R_MUNGE_SOCKET=$MUNGE_SOCKET R_OVERSUBSCRIBE=$OVERSUBSCRIBE
    export R_DEF_MEM_PER_CPU=$DEF_MEM_PER_CPU R_MIN_JOB_AGE=$MIN_JOB_AGE
    export R_SOCKET=$socket R_PLUGIN_TIMEOUT_MS=$PLUGIN_TIMEOUT_MS
    R_TABLE_LINES=$(table_lines)
    export R_TABLE_LINES
    R_NODE_HW=$(node_hw)
    R_DB_PASS=$(cat "$ETC/db.pass")
    export R_NODE_HW R_DB_PASS

    # Hooks
    R_PROLOG_LINE=$(hook_line Prolog SWAPAWARE_PROLOG)
    R_EPILOG_LINE=$(hook_line Epilog SWAPAWARE_EPILOG)
    R_TASKPROLOG_LINE=$(hook_line TaskProlog SWAPAWARE_TASK_PROLOG)
    export R_PROLOG_LINE R_EPILOG_LINE R_TASKPROLOG_LINE

    # job_submit.lua is read from the directory of slurm.conf.
    if [[ -n ${SWAPAWARE_LUA_DIR:-} && ${SWAPAWARE_JOB_SUBMIT:-1} != 0 ]]; then
        [[ -f $SWAPAWARE_LUA_DIR/job_submit.lua ]] ||
            die "SWAPAWARE_LUA_DIR=$SWAPAWARE_LUA_DIR has no job_submit.lua"
        copy_lua "$SWAPAWARE_LUA_DIR"
        lua_on=1
    fi
    if ((lua_on)); then
        export R_JOB_SUBMIT_LINE="JobSubmitPlugins=lua"
    else
        export R_JOB_SUBMIT_LINE="#JobSubmitPlugins=lua (off; set SWAPAWARE_LUA_DIR or run: cluster.sh plugin on)"
    fi
    # Clients (srun inside jobs) read cli_filter.lua beside slurm.conf: GPU steps inside shard jobs.
    if [[ -f $ETC/cli_filter.lua ]]; then
        export R_CLI_FILTER_LINE="CliFilterPlugins=lua"
    else
        export R_CLI_FILTER_LINE="#CliFilterPlugins=lua (no cli_filter.lua beside slurm.conf)"
    fi

    # Typed GPUs (two types), so that typed requests (--gres=gpu:h100:1) can be tried, of
    # different memory (GPU_GIB), each with its own shard count.
    local lines="" i types gibs shards=()
    read -r -a types <<<"${GPU_TYPES//,/ }"
    ((${#types[@]} == 4)) || die "SWAPAWARE_DEV_GPU_TYPES needs 4 types, got '$GPU_TYPES'"
    local sizes
    sizes=$(gpu_gib)
    read -r -a gibs <<<"${sizes//,/ }"
    ((${#gibs[@]} == 4)) || die "SWAPAWARE_DEV_GPU_GIB needs 4 sizes, got '$sizes'"
    if [[ -n ${SWAPAWARE_DEV_GPU_SHARDS:-} ]]; then  # counts as given (bench/fleet_sizing.py: equal slots)
        read -r -a shards <<<"${SWAPAWARE_DEV_GPU_SHARDS//,/ }"
        ((${#shards[@]} == 4)) || die "SWAPAWARE_DEV_GPU_SHARDS needs 4 counts, got '$SWAPAWARE_DEV_GPU_SHARDS'"
    else
        for i in 0 1 2 3; do shards+=($((gibs[i] / SHARD_GIB))); done
    fi
    # The node's Gres= lists its shards by type, as gres.conf's shard lines do (Type=, the GPU's):
    # with `shard:<total>` untyped while gres.conf types them (a shard takes its GPU's type through
    # the same File=), a 24.11 slurmctld taking control (takeover, hand-back) sets every node INVAL
    # and DRAIN, "gres/shard type (a100) reported but not configured", and with jobs running the
    # drain stays; typed in Gres= with untyped shard lines, slurmd 24.11 does not start
    # (docs/slurm-releases.md, "Two controllers").
    declare -A per_type=() shards_of=()
    for i in 0 1 2 3; do
        lines+="Name=gpu Type=${types[$i]} File=$DEV/nvidia$i"$'\n'
        per_type[${types[$i]}]=$((${per_type[${types[$i]}]:-0} + 1))
        shards_of[${types[$i]}]=$((${shards_of[${types[$i]}]:-0} + shards[i]))
    done
    local node_gres="" shard_gres="" t
    for t in $(printf '%s\n' "${!per_type[@]}" | sort); do
        node_gres+="gpu:$t:${per_type[$t]},"
        if ((shards_of[$t] > 0)); then shard_gres+="shard:$t:${shards_of[$t]},"; fi
    done
    node_gres+=$shard_gres
    export R_NODE_GRES=${node_gres%,}
    R_NODE_LINES=$(node_conf_lines "$R_NODE_HW" "$R_NODE_GRES")
    export R_NODE_LINES
    for i in 0 1 2 3; do
        lines+="Name=shard Type=${types[$i]} Count=${shards[i]} File=$DEV/nvidia$i"$'\n'
    done
    export R_GRES_LINES=${lines%$'\n'}

    # Release dialect of the configuration (contrib/slurm/slurm.conf.snippet says why for each).
    local rel
    rel=$(slurm_release)
    export R_RELEASE=${rel:-unknown}
    if [[ -n $rel ]] && version_ge "$rel" 23.11; then
        # Shard jobs go to the least-loaded GPU (23.11+); shards of one job stay on one GPU.
        export R_SELECT_PARAMS=CR_Core_Memory,LL_SHARED_GRES
    else
        export R_SELECT_PARAMS=CR_Core_Memory
    fi
    # slurmd initialises a cgroup plugin at start even with proctrack/linuxproc and task/none.
    # No cgroup is used here (chroots, containers): 23.02+ can say so; 22.05 autodetects the
    # version from /sys/fs/cgroup and dies where none is mounted ("No filesystem mounted on
    # /sys/fs/cgroup", as in a Debian root), so there it is named outright.
    local cgroup_plugin=""
    if [[ -n $rel ]] && version_ge "$rel" 23.02; then
        cgroup_plugin=disabled
    elif [[ $(stat -fc %T /sys/fs/cgroup 2>/dev/null) != @(tmpfs|cgroup2fs) ]]; then
        cgroup_plugin=cgroup/v1
    fi
    if [[ -n $cgroup_plugin ]]; then
        printf '# Generated by contrib/dev-cluster/cluster.sh\nCgroupPlugin=%s\n' "$cgroup_plugin" >"$ETC/cgroup.conf.new"
        if replace_if_changed "$ETC/cgroup.conf" "$ETC/cgroup.conf.new"; then CHANGED_SLURM=1; fi
        chmod 644 "$ETC/cgroup.conf"
    fi
    if render "$TEMPLATES/slurm.conf.in" "$ETC/slurm.conf"; then CHANGED_SLURM=1; fi
    if render "$TEMPLATES/gres.conf.in" "$ETC/gres.conf"; then CHANGED_SLURM=1; fi
    if render "$TEMPLATES/slurmdbd.conf.in" "$ETC/slurmdbd.conf"; then CHANGED_DBD=1; fi
    render "$TEMPLATES/swapaware_plugin.conf.in" "$ETC/swapaware_plugin.conf" || true
    render "$TEMPLATES/swapaware.env.in" "$ETC/swapaware.env" || true
    [[ -f $ETC/plugstack.conf ]] || echo "# empty: no SPANK plugins in the dev cluster" >"$ETC/plugstack.conf"
    chmod 644 "$ETC/slurm.conf" "$ETC/gres.conf" "$ETC/swapaware_plugin.conf" "$ETC/swapaware.env" "$ETC/plugstack.conf"
    chmod 600 "$ETC/slurmdbd.conf" # slurmdbd refuses a readable one
    for f in "$ETC"/*.lua; do if [[ -e $f ]]; then chmod 644 "$f"; fi; done
}

copy_lua() {
    local src=$1 f
    for f in "$src"/*.lua; do
        [[ -e $f ]] || continue
        install -m 644 "$f" "$ETC/$(basename "$f")"
    done
}

check_socket_path() {
    # sun_path is 108 bytes including the NUL.
    ((${#1} <= 100)) || die "socket path too long (${#1} > 100 chars): $1; use a shorter SWAPAWARE_DEV_DIR"
}

# render TEMPLATE DEST: replaces @NAME@ with $R_NAME; writes DEST only if it
# changed. Returns 0 when DEST changed, 1 when unchanged.
render() {
    local tmpl=$1 dest=$2 tmp
    tmp=$(mktemp "$dest.XXXXXX")
    perl -pe 's/\@([A-Z_]+)\@/exists $ENV{"R_$1"} ? $ENV{"R_$1"} : die "template $ARGV: undefined \@$1\@\n"/ge' \
        "$tmpl" >"$tmp"
    replace_if_changed "$dest" "$tmp"
}

# replace_if_changed DEST NEW: NEW becomes DEST unless DEST already holds exactly that (then NEW
# is removed). Returns 0 when DEST changed, 1 when unchanged.
replace_if_changed() {
    local dest=$1 new=$2
    if [[ -f $dest ]] && cmp -s "$new" "$dest"; then
        rm -f "$new"
        return 1
    fi
    mv -f "$new" "$dest"
}

node_hw() {
    # First line of `slurmd -C`, minus NodeName and UpTime: the real hardware,
    # so we never declare more than the node has (else it gets drained).
    local line
    line=$(slurmd -C 2>/dev/null | head -n1)
    [[ $line == NodeName=* ]] || die "slurmd -C gave no NodeName line: $line"
    line=${line#NodeName=* }
    echo "$line"
}
