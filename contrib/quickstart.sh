#!/usr/bin/env bash
# The main job, on a fresh Debian 12 or 13 machine as root: bring up the swapaware dev stack (the
# host's real Slurm, 22.05 or 24.11, + policy service + hooks + node agent on 4 fake GPUs) and submit the same GPU job
# twice. The first run has no history and keeps a whole GPU; once it is observed, the second
# is rewritten to shards. Prints what each step shows.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$ROOT/contrib/dev-stack.sh" up
eval "$(bash "$ROOT/contrib/dev-stack.sh" env)"
STATE=${SWAPAWARE_DEV_DIR:-/var/tmp/swapaware-dev}
VENV=${SWAPAWARE_VENV:-$ROOT/.venv}
JOBDIR=$STATE/jobs
mkdir -p "$JOBDIR"

cat >"$JOBDIR/train.sh" <<EOF
#!/bin/bash
#SBATCH --job-name=quickstart-train
#SBATCH --output=$JOBDIR/slurm-%j.out
# A stand-in for a training job: holds 3 GiB on its GPU (fake NVML) for 2 seconds.
echo "CUDA_VISIBLE_DEVICES=\$CUDA_VISIBLE_DEVICES SLURM_SHARDS_ON_NODE=\${SLURM_SHARDS_ON_NODE:-}"
exec $VENV/bin/python -m slurm_plugin.gpu.nvml fake-alloc --root $STATE/node/fake-nvml --gpu "\${CUDA_VISIBLE_DEVICES%%,*}" \
    --bytes 3221225472 --hold-seconds 2
EOF

wait_job() {
    local id=$1 state
    for _ in $(seq 1 120); do
        state=$(sacct -X -n -P -j "$id" -o state | head -1 | awk '{print $1}')
        case $state in COMPLETED|FAILED|CANCELLED|TIMEOUT|OUT_OF_MEMORY) echo "$state"; return 0 ;; esac
        sleep 0.5
    done
    echo "TIMEOUT-WAITING"
}

wait_observed() {
    local id=$1
    for _ in $(seq 1 60); do
        # (read whole: piped into grep -q under pipefail, a long answer fails when grep exits early)
        [[ $("$VENV/bin/swapaware" explain "$id" 2>/dev/null) == *"job $id on"* ]] && return 0
        sleep 0.5
    done
    return 1
}

for run in 1 2; do
    id=$(sbatch --parsable --gres=gpu:1 "$JOBDIR/train.sh")
    echo
    echo "== run $run: sbatch --gres=gpu:1 train.sh -> job $id"
    scontrol show job "$id" | grep -oE '(TresPerNode|AdminComment)=.*' | sed 's/^/   /'
    echo "   finished: $(wait_job "$id")"
    wait_observed "$id" || echo "   (observation not in the history yet; see $STATE/log/hooks.log)"
    echo "   job output: $(cat "$JOBDIR/slurm-$id.out" 2>/dev/null | head -1)"
done
echo
echo "== sacct -o jobid,jobname,state,admincomment"
sacct -X -o jobid,jobname%18,state,admincomment%150 | tail -n 4
echo
echo "== swapaware explain $id"
"$VENV/bin/swapaware" explain "$id"
echo
echo "Stop everything with: bash $ROOT/contrib/dev-stack.sh down"
