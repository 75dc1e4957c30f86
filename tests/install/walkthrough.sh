#!/usr/bin/env bash
# The admin guide (docs/admin-guide.md), followed as a new site's admin would, on a Slurm that the
# site set up itself (not the dev stack): the blocks the guide marks `<!-- install: NAME -->` are
# taken from the guide's text and run as written; only the site's own choices are filled in (its
# slurm.conf head, the guide's "Edit at least" keys), each named below.
#
#   walkthrough.sh WORK WHEELHOUSE
#
# WORK holds src/ (the release's files, as a tarball would unpack them); what was seen goes to
# WORK/out. WHEELHOUSE: the guide's build-host wheelhouse (built before, where PyPI is reachable).
# tests/install/test_install_from_docs.py starts this as PID 1 of its own PID, mount, network
# and UTS namespaces: every daemon it starts ends with it, and what it mounts is seen nowhere else.
# The site: one host, controller ctl01 and GPU node gpu01 (10.77.0.1), SlurmUser=slurm, munge,
# two fake GPUs of 80 GiB (this machine has none: the node agent, gres-conf and the TaskProlog read
# a fake NVML), MariaDB and slurmdbd (accounting: the snippet's AccountingStorageTRES needs it).
set -euo pipefail
WORK=$1
WH=$2
SRC=$WORK/src
OUT=$WORK/out
GUIDE=$SRC/docs/admin-guide.md
VENV=/opt/swapaware/venv
JOBS=/var/spool/jobs
mkdir -p "$OUT"
export PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root

step() { printf '== %s\n' "$*" >&2; }
# version_ge A B: version A is B or later (as contrib/dev-cluster/cluster.sh's)
version_ge() { [[ $(printf '%s\n%s\n' "$1" "$2" | sort -V | head -n1) == "$2" ]]; }
fail() { printf 'FAILED: %s\n' "$*" | tee "$OUT/failed" >&2; exit 1; }
# until SECONDS CMD...: CMD until it succeeds, at most SECONDS; fails the walk-through after that
until_ok() {
    local limit=$1 t0=$SECONDS
    shift
    until "$@" >/dev/null 2>&1; do
        ((SECONDS - t0 < limit)) || return 1
        sleep 0.2
    done
}

# The guide's block NAME: the fenced block after its `<!-- install: NAME -->` line.
guide_block() {
    awk -v want="<!-- install: $1 -->" '
        $0 == want { armed = 1; next }
        armed && /^```/ { if (inside) exit; inside = 1; next }
        inside { print }' "$GUIDE"
}
# run_block NAME [SED-EXPR]: the block, with the site's value put in (SED-EXPR), run by bash -e
run_block() {
    local text
    text=$(guide_block "$1")
    [[ -n $text ]] || fail "the admin guide has no block marked <!-- install: $1 -->"
    [[ -z ${2:-} ]] || text=$(sed -e "$2" <<<"$text")
    printf '%s\n' "$text" >"$OUT/block-$1.sh"
    step "guide: $1"
    (cd "$SRC" && bash -euo pipefail "$OUT/block-$1.sh") >>"$OUT/block-$1.log" 2>&1 ||
        fail "the guide's block $1 failed: $(tail -5 "$OUT/block-$1.log")"
}

step "the machine: private copies of what an install writes"
for d in /etc/slurm /etc/munge /etc/swapaware /opt/swapaware /run /var/spool /var/log /var/lib/munge \
         /var/lib/swapaware; do
    if [[ ! -d $d ]]; then
        mkdir -p "$d"
        echo "$d" >>"$WORK/made-dirs"   # removed by the test afterwards
    fi
    mount -t tmpfs -o mode=0755 tmpfs "$d"
done
mkdir -p /var/log/apt
hostname ctl01
printf '127.0.0.1 localhost\n10.77.0.1 ctl01 gpu01\n' >"$WORK/hosts"
mount --bind "$WORK/hosts" /etc/hosts
ip link set lo up
ip link add v0 type veth peer name v1
ip addr add 10.77.0.1/24 dev v0
ip link set v0 up
ip link set v1 up

step "site: munge"
chown munge:munge /etc/munge /var/lib/munge
chmod 0700 /etc/munge /var/lib/munge
install -d -o munge -g munge -m 0700 /var/log/munge
install -d -o munge -g munge -m 0755 /run/munge
dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
chown munge:munge /etc/munge/munge.key
chmod 0400 /etc/munge/munge.key
runuser -u munge -- /usr/sbin/munged
until_ok 10 test -S /run/munge/munge.socket.2 || fail "munged did not start"

step "site: two fake GPUs (no GPU on this machine)"
mkdir -p /run/fake-gpu
for i in 0 1; do mknod -m 666 "/run/fake-gpu/nvidia$i" c 195 "$i" 2>/dev/null || : >"/run/fake-gpu/nvidia$i"; done

run_block venv "s|/path/to/wheelhouse|$WH|"
"$VENV/bin/python" -I -c "
from pathlib import Path
from slurm_plugin.gpu.nvml_fake import create_fake_gpus
create_fake_gpus(Path('/run/fake-nvml'), 2, 85899345920)"
# the jobs (any user) allocate on the fake GPUs: their lock and process files go here
find /run/fake-nvml -type d -exec chmod 1777 {} +
find /run/fake-nvml -type f -exec chmod 0666 {} +

run_block config
step "site: the guide's 'Edit at least' keys"
sed -i -e 's|^grpc_address = .*|grpc_address = "0.0.0.0:455"|' \
    -e 's|^service_address = .*|service_address = "ctl01:455"|' \
    -e 's|^nvml_backend = .*|nvml_backend = "fake"|' \
    -e 's|^fake_nvml_dir = .*|fake_nvml_dir = "/run/fake-nvml"|' /etc/swapaware/swapaware.toml
cp /etc/swapaware/swapaware.toml "$OUT/swapaware.toml"

step "site: slurm.conf (its head, then contrib/slurm/slurm.conf.snippet) and gres.conf (swapaware gres-conf)"
"$VENV/bin/swapaware" gres-conf --device-prefix /run/fake-gpu/nvidia >/etc/slurm/gres.conf 2>"$OUT/gres-conf.err" ||
    fail "swapaware gres-conf: $(cat "$OUT/gres-conf.err")"
gres=$(sed -n 's/^# slurm.conf node line: //p' /etc/slurm/gres.conf)
[[ -n $gres ]] || fail "swapaware gres-conf printed no node line: $(cat /etc/slurm/gres.conf)"
# This machine has no cgroup file system: proctrack/cgroup cannot run here (doctor says so).
proctrack=proctrack/cgroup
[[ -e /sys/fs/cgroup/cgroup.controllers ]] || proctrack=proctrack/linuxproc
install -d -o slurm -g slurm /var/spool/slurmctld /var/log/slurm /run/slurm
if [[ $proctrack == proctrack/linuxproc ]]; then
    # slurmd starts a cgroup plugin even without proctrack/cgroup and dies where none is mounted;
    # from 23.02 cgroup.conf can turn it off (22.05 is fine on this machine's empty /sys/fs/cgroup)
    rel=$(slurmd -V | sed -n 's/^slurm[-a-z]* \([0-9]*\.[0-9]*\).*/\1/p')
    version_ge "$rel" 23.02 && echo "CgroupPlugin=disabled" >/etc/slurm/cgroup.conf
fi
install -d /var/spool/slurmd
{
    cat <<EOF
ClusterName=site
SlurmctldHost=ctl01
SlurmUser=slurm
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurm/slurmctld.pid
SlurmdPidFile=/run/slurm/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
TaskPlugin=task/none
MpiDefault=none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=ctl01
MailProg=/bin/true
ReturnToService=2
SchedulerParameters=sched_interval=2
EOF
    grep -v -e '^NodeName=' -e '^PartitionName=' "$SRC/contrib/slurm/slurm.conf.snippet" |
        sed "s|^ProctrackType=.*|ProctrackType=$proctrack|"
    echo "NodeName=gpu01 NodeAddr=10.77.0.1 CPUs=$(nproc) RealMemory=1000 $gres State=UNKNOWN"
    echo "PartitionName=gpu Nodes=gpu01 Default=YES MaxTime=INFINITE State=UP"
} >/etc/slurm/slurm.conf
cp /etc/slurm/slurm.conf /etc/slurm/gres.conf "$OUT/"

run_block service-without-systemd
until_ok 60 test -S /run/swapaware/policy.sock || fail "the service did not start: $(tail -20 /var/log/swapaware.log)"
run_block job-submit
run_block cli-filter
run_block hooks
run_block task-prolog
run_block agent-without-systemd
until_ok 30 test -S /run/swapaware/agent.sock || fail "the agent did not start: $(tail -20 /var/log/swapaware-agent.log)"

step "site: MariaDB and slurmdbd"
install -d /var/spool/mysql /run/mysqld
mariadb-install-db --no-defaults --datadir=/var/spool/mysql --user=root --auth-root-authentication-method=socket \
    --skip-test-db --skip-name-resolve >/var/log/mariadb-install.log 2>&1 || fail "mariadb-install-db: $(tail -5 /var/log/mariadb-install.log)"
extra=()
mver=$(mariadbd --version | sed -n 's/.*Ver \([0-9]*\.[0-9]*\).*/\1/p')
# MariaDB >= 11.6 turns innodb_snapshot_isolation on, which slurmdbd's updates trip over
version_ge "$mver" 11.6 && extra+=(--innodb-snapshot-isolation=OFF)
# slurmdbd reaches it over TCP on loopback, as on the dev cluster (the client library's default socket
# path differs between releases)
mariadbd --no-defaults --user=root --datadir=/var/spool/mysql --socket=/run/mysqld/mysqld.sock \
    --bind-address=127.0.0.1 --port=3306 --skip-name-resolve \
    --pid-file=/run/mysqld/mysqld.pid --log-error=/var/log/mariadb.log --skip-log-bin "${extra[@]}" </dev/null &
db() { mariadb --no-defaults -S /run/mysqld/mysqld.sock -u root "$@"; }
until_ok 60 db -e 'SELECT 1' || fail "MariaDB did not start: $(tail -5 /var/log/mariadb.log)"
dbpass=$(head -c 12 /dev/urandom | od -An -tx1 | tr -d ' \n')
db -e "CREATE DATABASE slurm_acct_db; CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$dbpass'; GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';"
cat >/etc/slurm/slurmdbd.conf <<EOF
AuthType=auth/munge
DbdHost=ctl01
SlurmUser=slurm
LogFile=/var/log/slurm/slurmdbd.log
PidFile=/run/slurm/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=3306
StorageUser=slurm
StoragePass=$dbpass
StorageLoc=slurm_acct_db
EOF
chown slurm:slurm /etc/slurm/slurmdbd.conf
chmod 0600 /etc/slurm/slurmdbd.conf
slurmdbd || fail "slurmdbd: $(tail -20 /var/log/slurm/slurmdbd.log)"
until_ok 60 sacctmgr -n show cluster || fail "slurmdbd does not answer: $(tail -20 /var/log/slurm/slurmdbd.log)"
sacctmgr -i add cluster site >/dev/null

step "site: slurmctld and slurmd"
slurmctld || fail "slurmctld: $(tail -20 /var/log/slurm/slurmctld.log)"
until_ok 60 scontrol ping || fail "slurmctld does not answer: $(tail -20 /var/log/slurm/slurmctld.log)"
slurmd -N gpu01 || fail "slurmd: $(tail -20 /var/log/slurm/slurmd.log)"
node_idle() { [[ $(sinfo -h -n gpu01 -o %T) == idle ]]; }
until_ok 60 node_idle || fail "gpu01 is not idle: $(sinfo -h -n gpu01 -o '%T %E'); $(tail -20 /var/log/slurm/slurmd.log)"

step "guide 9: swapaware doctor, as root and as the service's user"
rc=0; "$VENV/bin/swapaware" doctor >"$OUT/doctor-root.txt" 2>&1 || rc=$?
echo "$rc" >"$OUT/doctor-root.rc"
rc=0; runuser -u slurm -- "$VENV/bin/swapaware" doctor >"$OUT/doctor-slurm.txt" 2>&1 || rc=$?
echo "$rc" >"$OUT/doctor-slurm.rc"

step "a user submits a GPU job, as without swapaware"
install -d -m 1777 "$JOBS"
cat >"$JOBS/train.sh" <<EOF
#!/bin/sh
echo "CUDA_VISIBLE_DEVICES=\$CUDA_VISIBLE_DEVICES"
exec $VENV/bin/python -I -m slurm_plugin.gpu.nvml fake-alloc --root /run/fake-nvml --gpu "\${CUDA_VISIBLE_DEVICES%%,*}" --bytes 3221225472 --hold-seconds 2
EOF
chmod 755 "$JOBS/train.sh"
submit() {  # NAME SBATCH-ARGS...: as nobody, in $JOBS; its stdout and stderr kept apart
    local name=$1
    shift
    (cd "$JOBS" && runuser -u nobody -- sbatch "$@" train.sh) >"$OUT/sbatch-$name.out" 2>"$OUT/sbatch-$name.err" ||
        fail "sbatch $*: $(cat "$OUT/sbatch-$name.err")"
    sed -n 's/^Submitted batch job \([0-9]*\)$/\1/p' "$OUT/sbatch-$name.out"
}
a=$(submit first --gres=gpu:1)
[[ -n $a ]] || fail "no job id from sbatch: $(cat "$OUT/sbatch-first.out")"
echo "$a" >"$OUT/job-first.id"
job_done() { scontrol -o show job "$1" | grep -qE 'JobState=(COMPLETED|FAILED|CANCELLED|TIMEOUT|OUT_OF_MEMORY|NODE_FAIL)'; }
until_ok 90 job_done "$a" || fail "job $a did not end: $(scontrol -o show job "$a")"
scontrol -o show job "$a" >"$OUT/job-first.txt"
observed() { [[ $("$VENV/bin/swapaware" explain "$1" 2>/dev/null) == *"job $1 on"* ]]; }  # (whole: see quickstart.sh)
until_ok 60 observed "$a" || fail "job $a's run was not observed: $("$VENV/bin/swapaware" explain "$a" 2>&1 | tail -5)"
"$VENV/bin/swapaware" explain "$a" >"$OUT/explain-first.txt" 2>&1

step "the next job of the class, once the table holds it again"
table=/run/swapaware/admission.json
# The observation took the class out of the table before it was recorded (docs/admission-table.md,
# "Staleness"), and explain has shown it recorded: a table that holds the class now holds a
# decision made from that run, whether its build came before this line or comes after.
republished() { grep -q '"entries":[1-9]' "$table" 2>/dev/null; }
until_ok 60 republished || fail "the admission table was not published again after the observation ($(head -c 300 "$table"))"
sleep_ms=$(sed -n 's/^table_check_ms=//p' /etc/slurm/swapaware_plugin.conf)
# the plugin stats the table every table_check_ms (1000 by default): the same wait a user's next job sees
sleep "$(((${sleep_ms:-1000} + 999) / 1000))"
head -c 400 "$table" >"$OUT/table-head.txt"
b=$(submit second --gres=gpu:1 --hold)
echo "$b" >"$OUT/job-second.id"
scontrol -o show job "$b" >"$OUT/job-second.txt"
"$VENV/bin/swapaware" explain "$b" >"$OUT/explain-second.txt" 2>&1 || true
runuser -u slurm -- "$VENV/bin/swapaware" doctor >"$OUT/doctor-after.txt" 2>&1 || true
scancel "$b"
until_ok 20 job_done "$b" || true
cp "$JOBS/slurm-$a.out" "$OUT/job-first.out" 2>/dev/null || true
for f in /var/log/swapaware.log /var/log/swapaware-agent.log /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log; do
    cp "$f" "$OUT/" 2>/dev/null || true
done
step "done"
echo ok >"$OUT/done"
