--[[
swapaware's client-side step mending (Lua 5.1, runs inside srun through cli_filter/lua).
See cli_filter.lua. Pure helpers are exposed for the tests (tests/adapter/plugin/test_cli_filter.py).
]]

local M = {}

M.GPU_OPTIONS = { "gpus", "gpus-per-node", "gpus-per-task", "gpus-per-socket" }

-- The comment cli_filter gives a --test-only submission (sbatch, srun): slurmctld runs job_submit for
-- it as for a real job, and nothing in the job_desc tells the two apart (measured on 22.05: the same
-- bitflags, job_id and fields). swapaware.lua leaves a job carrying it alone, so a will-run query is
-- answered for the request as typed and records no decision. No job is ever made of it.
M.TEST_ONLY_MARK = "swapaware:test-only"

-- count_of("h100:2") -> 2, ("1") -> 1, ("gres/gpu=3") -> 3; a GPU named without a count is 1.
local function count_of(value)
  return tonumber(string.match(value or "", "[:=]?(%d+)$") or "1") or 1
end

-- split_gres("gres/gpu:1,gres/nvme:2") -> the entries that are neither gpu nor shard, whether a gpu
-- entry (count > 0) was present, and the GPUs those entries ask for.
function M.split_gres(value)
  local kept, gpu, count = {}, false, 0
  for entry in string.gmatch(value or "", "[^,]+") do
    local name = string.match(entry, "^gres[:/]([^:=]+)") or string.match(entry, "^([^:=]+)")
    if name == "gpu" then
      local n = count_of(entry)
      if n > 0 then gpu, count = true, count + n end
    elseif name ~= "shard" then
      kept[#kept + 1] = entry
    end
  end
  return kept, gpu, count
end

-- implicit_gpu_bind(v): the binding Slurm gives --gpus-per-task itself ("gres/gpu:per_task:1").
function M.implicit_gpu_bind(value)
  return string.match(value or "", "^gres[:/]gpu:per_task:%d+$") ~= nil
end

-- An option's value as a string; "" when it is not given (Slurm reads an unset flag as "unset").
local function get(options, key)
  local ok, v = pcall(function() return options[key] end)
  if not ok or v == nil or v == "unset" then return "" end
  return tostring(v)
end

local function set(options, key, value)
  return pcall(function() options[key] = value end)
end

local function none(gres)
  return gres == "none" or gres == "gres/none" or gres == "gres:none"
end

-- The step's new --gres, or nil when the step is left as it is, and its new --tres-per-task (nil:
-- unchanged). Inside a job that holds shards (SLURM_SHARDS_ON_NODE), measured on 22.05 and 26.05:
-- a step that asks for a gpu is refused ("Invalid generic resource (gres) specification"); a plain
-- step of a job holding typed shards (shard:h100:k, as a typed request is rewritten) is refused the
-- same way, while one asking --gres=shard:k runs on the job's GPU. So a step that asks for GPUs
-- and a plain step ask for the job's shards on the node instead (its one GPU). A step asking for more GPUs
-- than the job holds (srun -n2 --gpus-per-task=1 in a 1-GPU job) is left as typed: Slurm refuses
-- it, as it does without swapaware. On 23.11+ a step inherits the job's --gpus-per-task as
-- --tres-per-task ("gres/gpu=1", from SLURM_TRES_PER_TASK in the batch step's environment): its
-- gpu entry goes, the rest ("cpu=2") stays. env: a function like os.getenv.
function M.step_gres(options, env)
  if get(options, "type") ~= "srun" then return nil end
  if (env("SLURM_JOB_ID") or "") == "" then return nil end
  local shards = tonumber(env("SLURM_SHARDS_ON_NODE") or "")
  if shards == nil or shards < 1 then return nil end
  local gres = get(options, "gres")
  if none(gres) then return nil end
  local kept, asks, asked = M.split_gres(gres)
  local ntasks = tonumber(get(options, "ntasks")) or tonumber(env("SLURM_NTASKS") or "") or 1
  -- the GPUs the step asks for on the node: the most any of its options asks (an option the job's
  -- environment hands every step, as --gpus-per-task, and one the user typed ask for the same GPUs)
  local zero = false  -- a GPU option given as 0 (--gpus=0): the step asks for no GPU
  for _, key in ipairs(M.GPU_OPTIONS) do
    local v = get(options, key)
    if v == "0" or string.match(v, "^[%a%d_-]*:?0$") then
      zero = true
    elseif v ~= "" then
      asks = true
      asked = math.max(asked, count_of(v) * (key == "gpus-per-task" and ntasks or 1))
    end
  end
  local per_task_kept, per_task_gpu, per_task_count = M.split_gres(get(options, "tres-per-task"))
  if per_task_gpu then asked = math.max(asked, per_task_count * ntasks) end
  -- the step names its GRES (other GRES, shards, gpu:0) or --gpus=0 and asks for no GPU: as typed
  if not asks and not per_task_gpu and (gres ~= "" or zero) then return nil end
  if (asks or per_task_gpu) and asked > (tonumber(env("SLURM_GPUS_ON_NODE") or "") or 1) then return nil end
  kept[#kept + 1] = "shard:" .. tostring(math.floor(shards))
  return table.concat(kept, ","), per_task_gpu and table.concat(per_task_kept, ",") or nil
end

function M.mend_step(options, env)
  env = env or os.getenv
  local ok, gres, per_task = pcall(M.step_gres, options, env)
  if not ok or gres == nil then return false end
  for _, key in ipairs(M.GPU_OPTIONS) do
    -- Lua nil cannot be assigned (the option setter takes strings); "" is "not given".
    if get(options, key) ~= "" then set(options, key, "") end
  end
  if per_task ~= nil then set(options, "tres-per-task", per_task) end
  -- The binding Slurm gives --gpus-per-task itself, inherited by the step (26.05:
  -- SLURM_TRES_BIND=gres/gpu:per_task:1), names GPUs the job does not hold: the step would run
  -- without CUDA_VISIBLE_DEVICES. A --gpu-bind the user typed cannot be taken away here (srun
  -- refuses an empty one: "Invalid --gpu-bind argument", measured on 22.05 and 26.05); a job whose
  -- batch script binds GPUs keeps its GPU request instead (swapaware_facts.script_binds_gpus).
  if M.implicit_gpu_bind(get(options, "tres-bind")) then set(options, "tres-bind", "") end
  set(options, "gres", gres)
  if slurm and slurm.log_verbose then
    slurm.log_verbose("swapaware: this job holds %s GPU shard(s): the step asks for --gres=%s",
      tostring(env("SLURM_SHARDS_ON_NODE")), gres)
  end
  return true
end

-- mark_test_only(options): a --test-only sbatch or srun carries M.TEST_ONLY_MARK in its comment
-- (true when marked). Nothing else changes: Slurm answers when and where the request as typed
-- would start, and makes no job.
function M.mark_test_only(options)
  local t = get(options, "type")
  -- Slurm gives a flag option as "set" or "unset" (measured: an sbatch without --test-only had its
  -- comment marked when any value counted)
  if (t ~= "sbatch" and t ~= "srun") or get(options, "test-only") ~= "set" then return false end
  local comment = get(options, "comment")
  if string.find(comment, M.TEST_ONLY_MARK, 1, true) then return true end
  return set(options, "comment", comment == "" and M.TEST_ONLY_MARK or (comment .. " " .. M.TEST_ONLY_MARK))
end

return M
