--[[
cli_filter.lua for CliFilterPlugins=lua: lets job steps inside a job that swapaware rewrote ask
for GPUs the way the user wrote them.

Why: swapaware may rewrite a batch job's `--gres=gpu:1` (or --gpus=1, ...) into `shard:k` of one
GPU. The job then holds shards, not a gpu, and Slurm refuses a step that asks for a gpu inside it
("Invalid generic resource (gres) specification" on 23.02+, "Step requested GRES (gpu:(null)) not
found in the job" on 22.05), so `srun --gres=gpu:1 ./train` in the batch script would fail.

What: when `srun` runs inside a job (SLURM_JOB_ID set) whose allocation on this node is shards
(SLURM_SHARDS_ON_NODE set) and the step asks for GPUs (--gres=gpu..., --gpus, --gpus-per-node,
--gpus-per-task, --gpus-per-socket) or for nothing at all (a plain `srun cmd`, which Slurm refuses
in a job holding typed shards), the step asks instead for all the job's shards on the node: the
same GPU the job holds. Other GRES in --gres stay. A step asking for more GPUs than the job holds is left for Slurm to refuse,
as without swapaware. Nothing else is touched: salloc, steps of jobs that hold gpus, steps that
name other GRES only or --gres=none. And `sbatch --test-only` / `srun --test-only` carry
"swapaware:test-only" in their comment, so that job_submit leaves the will-run query as typed
and records nothing (no job is made of it).

Install: beside slurm.conf on every host where users run srun (login and compute nodes), with
`CliFilterPlugins=lua` in slurm.conf. A site with its own cli_filter.lua calls
`swapaware_cli.mend_step(options)` from its slurm_cli_pre_submit (see swapaware_cli.lua).
]]

local function script_dir()
  local src = debug.getinfo(1, "S").source
  return string.match(src, "^@(.*)/[^/]*$") or "/etc/slurm"
end

package.path = script_dir() .. "/?.lua;" .. package.path
local swapaware_cli = require("swapaware_cli")

function slurm_cli_setup_defaults(options, early_pass)
  return slurm.SUCCESS
end

function slurm_cli_pre_submit(options, pack_offset)
  swapaware_cli.mend_step(options)
  swapaware_cli.mark_test_only(options)
  return slurm.SUCCESS
end

function slurm_cli_post_submit(offset, job_id, step_id)
  return slurm.SUCCESS
end
