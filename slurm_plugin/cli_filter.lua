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

Install: beside slurm.conf on every host that has slurm.conf (login, controller and compute nodes),
before `CliFilterPlugins=lua` enters slurm.conf: Slurm refuses every sbatch/salloc/srun on a host
where the file is missing. A site with its own cli_filter.lua calls
`swapaware_cli.mend_step(options)` from its slurm_cli_pre_submit (see swapaware_cli.lua).
]]

local function script_dir()
  local src = debug.getinfo(1, "S").source
  return string.match(src, "^@(.*)/[^/]*$") or "/etc/slurm"
end

package.path = script_dir() .. "/?.lua;" .. package.path

-- Never the reason a host cannot submit: without swapaware_cli.lua (a host that got cli_filter.lua
-- alone, e.g. from a configless slurmctld, which sends cli_filter.lua but no module beside it) or
-- with one that fails, every submission goes on untouched, and nothing is printed to the user
-- (`swapaware doctor` names the missing file; srun -vv shows the error).
local ok, swapaware_cli = pcall(require, "swapaware_cli")
if not ok then
  local err = swapaware_cli
  swapaware_cli = nil
  if slurm and slurm.log_debug then slurm.log_debug("swapaware cli_filter: %s", tostring(err)) end
end

function slurm_cli_setup_defaults(options, early_pass)
  return slurm.SUCCESS
end

function slurm_cli_pre_submit(options, pack_offset)
  if swapaware_cli then
    local done, err = pcall(function()
      swapaware_cli.mend_step(options)
      swapaware_cli.mark_test_only(options)
    end)
    if not done and slurm.log_debug then slurm.log_debug("swapaware cli_filter: %s", tostring(err)) end
  end
  return slurm.SUCCESS
end

function slurm_cli_post_submit(offset, job_id, step_id)
  return slurm.SUCCESS
end
