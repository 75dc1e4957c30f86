#!/usr/bin/env bash
# Capture what each Slurm release really prints, as golden files for the parsers' unit tests
# (tests/golden/<release>/). Runs every release's daemons (contrib/matrix/run.sh), submits a fixed
# set of jobs and keeps: the job_desc GRES fields job_submit.lua sees, `scontrol show job -o/-d`,
# `squeue -O` of pending jobs, `sinfo -N`, and `sacct --json` with the release's pinned parser.
#
#   golden.sh [RELEASE...]      default: every supported release
#   golden.sh --inner OUTDIR    (run.sh calls this inside a release's namespace)
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
# shellcheck source=releases.sh
source "$HERE/releases.sh"

inner() {
    local out=$1 venv=${SWAPAWARE_VENV:-$REPO/.venv}
    export SWAPAWARE_DEV_DIR=/var/tmp/swapaware-golden
    local etc=$SWAPAWARE_DEV_DIR/etc lua=$SWAPAWARE_DEV_DIR/lua
    bash "$REPO/contrib/dev-cluster/cluster.sh" down --purge >/dev/null 2>&1 || true
    rm -rf "$out" && mkdir -p "$out" "$lua"
    # A job_submit.lua that records the GRES fields of each job_desc (and changes nothing).
    cat >"$lua/job_submit.lua" <<LUA
local cjson = require("cjson")
local F = { "tres_per_node", "tres_per_job", "tres_per_task", "tres_per_socket", "name", "comment",
            "cpus_per_tres", "mem_per_tres", "ntasks_per_tres", "tres_bind", "tres_freq", "shared",
            "min_cpus", "cpus_per_task", "pn_min_memory", "num_tasks", "sockets_per_node" }
function slurm_job_submit(jd, part_list, uid)
  local rec = { batch = jd.script ~= nil }
  for _, k in ipairs(F) do rec[k] = jd[k] end
  local f = io.open("$out/job_desc.jsonl", "a")
  f:write(cjson.encode(rec) .. "\n")
  f:close()
  return slurm.SUCCESS
end
function slurm_job_modify(jd, jr, pl, uid) return slurm.SUCCESS end
return slurm.SUCCESS
LUA
    SWAPAWARE_LUA_DIR=$lua bash "$REPO/contrib/dev-cluster/cluster.sh" up >/dev/null
    export SLURM_CONF=$etc/slurm.conf
    local sacct_arg
    # the release as the service reads it (scontrol --version, slurmctld -V, ...)
    sacct_arg=$("$venv/bin/python" -c "
from policy_service.slurm.slurm import cluster_release
print(cluster_release('', 30.0).dialect.sacct_json_arg)")
    slurmctld -V >"$out/version.txt"
    cd /tmp
    local spec name
    # name=spec: one held batch job each (the comment names the case in job_desc.jsonl)
    for spec in "gres_gpu:--gres=gpu:1" "gres_typed:--gres=gpu:h100:1" "gpus:--gpus=1" \
        "gpus_per_node:--gpus-per-node=1" "gpus_per_task:--gpus-per-task=1 -n1" \
        "gpus_per_task_cpus:--gpus-per-task=1 -n1 --cpus-per-task=2" "gres_zero:--gres=gpu:0" \
        "gres_shard:--gres=shard:2" "gres_gpu2:--gres=gpu:2" \
        "cpus_per_gpu:--gres=gpu:1 --cpus-per-gpu=2" "gpus_cpus_per_gpu:--gpus=1 --cpus-per-gpu=2" \
        "mem_per_gpu:--gres=gpu:1 --mem-per-gpu=1G" "ntasks_per_gpu:--gpus=1 --ntasks-per-gpu=2" \
        "gpu_freq:--gres=gpu:1 --gpu-freq=high" "gpu_bind:--gres=gpu:1 --gpu-bind=closest" \
        "gpu_bind_map:--gres=gpu:1 --gpu-bind=map_gpu:0" "gpus_per_socket:--gpus-per-socket=1 --sockets-per-node=1" \
        "exclusive:--exclusive --gres=gpu:1" "exclusive_user:--exclusive=user --gres=gpu:1" \
        "oversubscribe:--oversubscribe --gres=gpu:1" "test_only:--test-only --gres=gpu:1"; do
        name=${spec%%:*}
        # shellcheck disable=SC2086
        if ! sbatch --parsable --hold --job-name="$name" --comment="$name" ${spec#*:} --wrap true \
            >/dev/null 2>"$out/.err"; then
            echo "$name (${spec#*:}): $(tr '\n' ' ' <"$out/.err")" >>"$out/rejected.txt"
        fi
    done
    rm -f "$out/.err"
    squeue -h -a -t PENDING -O "$("$venv/bin/python" -c \
        'from policy_service.slurm.slurm_text import SQUEUE_PENDING_FORMAT as F; print(F)')" \
        | sort -n >"$out/squeue_pending.txt"
    local id
    id=$(squeue -h -n gres_gpu -o %i)
    scontrol show job -o "$id" >"$out/scontrol_show_job_o_held_gpu.txt"
    scancel -u root
    # Running jobs: a whole GPU and a shard job, for scontrol show job -d.
    local gpu shard
    gpu=$(sbatch --parsable --gres=gpu:1 --job-name=run_gpu --wrap 'sleep 60')
    shard=$(sbatch --parsable --gres=shard:2 --job-name=run_shard --wrap 'sleep 60')
    for id in "$gpu" "$shard"; do
        for _ in $(seq 1 100); do
            [[ $(squeue -h -j "$id" -o %T) == RUNNING ]] && break
            sleep 0.2
        done
    done
    scontrol show job -d -o "$gpu" >"$out/scontrol_show_job_d_gpu.txt"
    scontrol show job -d -o "$shard" >"$out/scontrol_show_job_d_shard.txt"
    sinfo -h -N -o '%N|%G|%T' >"$out/sinfo_nodes.txt"
    scontrol update JobId="$shard" AdminComment="swapaware:v1 id=golden action=share shards=2"
    scancel "$gpu" "$shard"
    for _ in $(seq 1 150); do
        [[ -z $(squeue -h -j "$gpu,$shard" -o %i 2>/dev/null) ]] && break
        sleep 0.2
    done
    # sacct's view once slurmdbd has the end records
    for _ in $(seq 1 150); do
        sacct -X -n -P -j "$gpu,$shard" -o state | grep -q PENDING || break
        sleep 0.2
    done
    # shellcheck disable=SC2086
    sacct $sacct_arg -X -j "$gpu,$shard" >"$out/sacct.json"
    echo "$sacct_arg" >"$out/sacct_arg.txt"
    bash "$REPO/contrib/dev-cluster/cluster.sh" down --purge >/dev/null 2>&1 || true
}

if [[ ${1:-} == --inner ]]; then
    inner "${2:?outdir}"
    exit 0
fi
(($#)) || set -- "${RELEASES[@]}"
host=$(host_release)
for rel in "$@"; do
    release_ok "$rel" || mdie "unknown release $rel"
    [[ $rel == "$host" ]] || bash "$HERE/root.sh" build "$rel"
    bash "$HERE/run.sh" "$rel" bash contrib/matrix/golden.sh --inner /var/tmp/swapaware-golden-out
    src=/var/tmp/swapaware-golden-out
    [[ $rel == "$host" ]] || src=$(root_dir "$rel")$src
    dest=$REPO/tests/golden/$rel
    # what this script writes is replaced; other files there (e.g. a captured sacct export) stay
    mkdir -p "$dest"
    rm -f "$dest/rejected.txt"
    cp "$src"/* "$dest"/
    # Names and hosts of this machine are not part of the facts: keep the files stable.
    sed -i "s/$(hostname -s)/node1/g" "$dest"/*
    mlog "golden files of Slurm $rel in $dest"
done
