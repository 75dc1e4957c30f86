--[[
swapaware's client-side step mending (Lua 5.1, runs inside srun through cli_filter/lua).
See cli_filter.lua. Pure helpers are exposed for the tests (tests/adapter/test_cli_filter.py).
]]

local M = {}

M.GPU_OPTIONS = { "gpus", "gpus-per-node", "gpus-per-task", "gpus-per-socket" }

-- split_gres("gres/gpu:1,gres/nvme:2") -> the entries that are neither gpu nor shard, and
-- whether a gpu entry (count > 0) was present. The step gets the job's own shards instead.
function M.split_gres(value)
  local kept, gpu = {}, false
  for entry in string.gmatch(value or "", "[^,]+") do
    local name = string.match(entry, "^gres[:/]([^:=]+)") or string.match(entry, "^([^:=]+)")
    if name == "gpu" then
      local count = string.match(entry, "[:=](%d+)$")
      if count ~= "0" then gpu = true end
    elseif name ~= "shard" then
      kept[#kept + 1] = entry
    end
  end
  return kept, gpu
end

-- implicit_gpu_bind(v): the binding Slurm gives --gpus-per-task itself ("gres/gpu:per_task:1").
function M.implicit_gpu_bind(value)
  return string.match(value or "", "^gres[:/]gpu:per_task:%d+$") ~= nil
end

local function get(options, key)
  local ok, v = pcall(function() return options[key] end)
  if not ok or v == nil then return "" end
  return tostring(v)
end

local function set(options, key, value)
  return pcall(function() options[key] = value end)
end

-- The step's new --gres, or nil when the step is left as it is, and its new --tres-per-task (nil:
-- unchanged). On 23.11+ a step inherits the job's --gpus-per-task as --tres-per-task
-- ("gres/gpu=1", from SLURM_TRES_PER_TASK in the batch step's environment): its gpu entry goes,
-- the rest ("cpu=2") stays. env: a function like os.getenv.
function M.step_gres(options, env)
  if get(options, "type") ~= "srun" then return nil end
  if (env("SLURM_JOB_ID") or "") == "" then return nil end
  local shards = tonumber(env("SLURM_SHARDS_ON_NODE") or "")
  if shards == nil or shards < 1 then return nil end
  local kept, asks = M.split_gres(get(options, "gres"))
  for _, key in ipairs(M.GPU_OPTIONS) do
    local v = get(options, key)
    if v ~= "" and v ~= "0" and not string.match(v, "^[%a%d_-]*:?0$") then asks = true end
  end
  local per_task_kept, per_task_gpu = M.split_gres(get(options, "tres-per-task"))
  if not asks and not per_task_gpu then return nil end
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
  -- without CUDA_VISIBLE_DEVICES. A binding the user typed never gets here (such a job is not
  -- rewritten to shards).
  if M.implicit_gpu_bind(get(options, "tres-bind")) then set(options, "tres-bind", "") end
  set(options, "gres", gres)
  if slurm and slurm.log_verbose then
    slurm.log_verbose("swapaware: this job holds %s GPU shard(s): the step asks for --gres=%s",
      tostring(env("SLURM_SHARDS_ON_NODE")), gres)
  end
  return true
end

return M
