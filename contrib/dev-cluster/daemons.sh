# shellcheck shell=bash
# The dev cluster's daemons, sourced by cluster.sh: munge, MariaDB, slurmdbd (with the database user
# and associations), slurmctld and slurmd started and waited for; STARTED: what this call started.

STARTED=()

munge_ok() { munge -S "$MUNGE_SOCKET" -n </dev/null | unmunge -S "$MUNGE_SOCKET" >/dev/null; }

start_munge() { start_node_munge ""; }

# shellcheck disable=SC2120 # called with arguments through wait_daemon
mysql_root() { mariadb --no-defaults -S "$MYSQL_SOCKET" -u root "$@"; }

start_mariadb() {
    if is_up mariadbd; then return 0; fi
    if [[ ! -d $MYSQL/data/mysql ]]; then
        log "initialising MariaDB datadir $MYSQL/data"
        rm -rf "$MYSQL/data"
        mariadb-install-db --no-defaults --datadir="$MYSQL/data" --user=root \
            --auth-root-authentication-method=socket --skip-test-db \
            --skip-name-resolve --innodb-log-file-size=64M </dev/null >>"$LOG/mariadb-install.log" 2>&1 9>&- ||
            die "mariadb-install-db failed; see $LOG/mariadb-install.log"
    fi
    log "starting mariadbd (127.0.0.1:$DB_PORT, socket $MYSQL_SOCKET)"
    rm -f "$MYSQL_SOCKET"
    # MariaDB >= 11.6 turns innodb_snapshot_isolation on, which slurmdbd's updates trip over.
    local extra=() mver
    mver=$(mariadbd --version 2>/dev/null | sed -n 's/.*Ver \([0-9][0-9.]*\).*/\1/p')
    if [[ -n $mver ]] && version_ge "$mver" 11.6; then extra+=(--innodb-snapshot-isolation=OFF); fi
    setsid mariadbd --no-defaults --user=root \
        --datadir="$MYSQL/data" --socket="$MYSQL_SOCKET" --pid-file="$MYSQL/mysqld.pid" \
        --port="$DB_PORT" --bind-address="$(db_bind_address)" --skip-name-resolve \
        --log-error="$LOG/mariadb.log" --skip-log-bin \
        --innodb-buffer-pool-size=512M --innodb-log-file-size=64M \
        --innodb-lock-wait-timeout=900 --innodb-flush-log-at-trx-commit=2 "${extra[@]}" \
        </dev/null >>"$LOG/mariadb.log" 2>&1 9>&- &
    BG_PID=$!
    wait_daemon mariadbd "$LOG/mariadb.log" mysql_root -e 'SELECT 1' || die "MariaDB did not come up; see $LOG/mariadb.log"
    BG_PID=
    wait_for "mariadbd pid file" 10 is_up mariadbd || die "MariaDB pid file missing: $MYSQL/mysqld.pid"
    STARTED+=(mariadbd)
}

setup_db_user() {
    local pass
    pass=$(cat "$ETC/db.pass")
    # shellcheck disable=SC2119
    mysql_root <<SQL
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$pass';
CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$pass';
ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$pass';
ALTER USER 'slurm'@'localhost' IDENTIFIED BY '$pass';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
FLUSH PRIVILEGES;
SQL
}

dbd_ok() { sacctmgr -n -P show cluster format=cluster; }

start_slurmdbd() {
    if is_up slurmdbd; then
        if ((CHANGED_DBD)); then
            log "slurmdbd.conf changed: restarting slurmdbd"
            stop_daemon slurmdbd
        else
            return 0
        fi
    fi
    log "starting slurmdbd (port $DBD_PORT)"
    slurmdbd </dev/null >>"$LOG/slurmdbd.stdout" 2>&1 9>&- || die "slurmdbd failed; see $LOG/slurmdbd.log"
    wait_daemon slurmdbd "$LOG/slurmdbd.log" dbd_ok || die "slurmdbd not answering; see $LOG/slurmdbd.log"
    STARTED+=(slurmdbd)
}

setup_associations() {
    if ! sacctmgr -n -P show cluster format=cluster | grep -qx "$CLUSTER"; then
        log "sacctmgr: adding cluster $CLUSTER"
        sacctmgr -i add cluster "$CLUSTER" >/dev/null
    fi
    # root, plus SWAPAWARE_DEV_USERS (comma/space separated): jobs of users
    # without an association run (nothing is enforced) but sacct --json shows
    # their "user" as null.
    local u
    local users=${SWAPAWARE_DEV_USERS:-}
    for u in root ${users//,/ }; do
        id "$u" >/dev/null 2>&1 || { log "WARNING: no such user '$u'; not added"; continue; }
        if ! sacctmgr -n -P show assoc where cluster="$CLUSTER" account=root user="$u" format=user | grep -qx "$u"; then
            log "sacctmgr: adding user $u to account root"
            sacctmgr -i add user "$u" account=root cluster="$CLUSTER" >/dev/null
        fi
    done
}

ctld_ok() { scontrol ping | grep -q 'is UP'; }

launch_slurmctld() {
    # LUA_PATH: modules copied next to job_submit.lua are require-able.
    LUA_PATH="$ETC/?.lua;;" slurmctld </dev/null >>"$LOG/slurmctld.stdout" 2>&1 9>&- ||
        die "slurmctld failed; see $LOG/slurmctld.log"
}

start_slurmctld() {
    if is_up slurmctld; then return 0; fi
    log "starting slurmctld (port $CTLD_PORT)"
    launch_slurmctld
    wait_daemon slurmctld "$LOG/slurmctld.log" ctld_ok || die "slurmctld not answering; see $LOG/slurmctld.log"
    STARTED+=(slurmctld)
}

# start_slurmd: every compute node's slurmd (nodes.sh), registered and idle.
start_slurmd() {
    local name
    for name in $(compute_nodes); do start_node_slurmd "$name"; done
}

# ctld_whois: what the pid file names and who listens on the controller's port (for an error).
ctld_whois() {
    local f pid listener
    f=$(pidfile_of slurmctld)
    pid=$(tr -dc '0-9' <"$f" 2>/dev/null || true)
    listener=$(ss -Hltnp "sport = :$CTLD_PORT" 2>/dev/null | tr -s ' ' | tr '\n' ';' || true)
    echo "pid file names ${pid:-nothing} ($(cat "/proc/${pid:-0}/comm" 2>/dev/null || echo 'no such process'), " \
         "started $(started_at "${pid:-0}" 2>/dev/null || echo '?'), file written $(stat -c %Y "$f" 2>/dev/null || echo '?')); " \
         "listening: ${listener:-nothing}"
}

restart_ctld() {
    if two_ctlds; then
        stop_ctls
        start_ctls
    else
        stop_daemon slurmctld 20
        # a slurmctld this script does not know of would keep answering in place of the new one
        ! ctld_ok || die "a slurmctld still answers on port $CTLD_PORT after it was stopped (pid file: $(pidfile_of slurmctld)): not restarted; $(ctld_whois)"
        log "starting slurmctld"
        launch_slurmctld
        wait_daemon slurmctld "$LOG/slurmctld.log" ctld_ok || die "slurmctld not answering; see $LOG/slurmctld.log"
    fi
    # A restarted slurmctld knows its nodes from its state file, but not how their slurmd sees
    # them until each registers again: SlurmdStartTime reads None until then (measured on 22.05;
    # the node shows 'unk' or already 'idle'), and Slurm 22.05 does not save a
    # node's GRES configuration flags with its state (23.02 does, "Save and restore GRES
    # config_flags on slurmctld restart"). So the restart returns once every slurmd has
    # registered; SIGHUP (reconfigure) makes it register at once.
    local name pid
    for name in $(compute_nodes); do
        pid=$(pid_in_node "$name" slurmd "$(slurmd_pidfile "$name")")
        [[ -n $pid ]] || continue
        node_registered_named "$name" 1 && continue
        log "node $name has not registered with the restarted slurmctld yet: SIGHUP to its slurmd"
        kill -HUP "$pid" 2>/dev/null || true
        wait_for "node $name to register with the restarted slurmctld" "$TIMEOUT_S" node_registered_named "$name" 1 ||
            log "WARNING: node $name is '$(node_state_of "$name")' and has not registered after the restart; see $LOG/slurmctld.log"
    done
    # GPUs held by no job after the restart would leave every later GPU job pending for good (22.05's
    # source has a path to it through jobs placed before a node registers, not reached here; the
    # symptom CI met twice is 22.05's requeue bug, which a restart clears: docs/slurm-releases.md):
    # the restart fails here, naming the node and its GresUsed, instead of a later test timing out.
    for name in $(compute_nodes); do
        wait_for "node $name to hold no GPU without a job" "$TIMEOUT_S" no_gpus_held_by_no_job "$name" ||
            die "after the slurmctld restart node $name holds GPUs no job runs on (GresUsed=$(gpus_held_by_no_job "$name")); see $LOG/slurmctld.log and docs/slurm-releases.md"
    done
}
