-- Differential test driver (test_admission_differential.py): the real slurm_plugin/swapaware.lua
-- with its admission table path, one Lua state for a whole file of job_descs, as slurmctld keeps one.
-- usage: lua5.1 admission_diff_driver.lua <plugin_dir> <settings_dir> <jobs.jsonl> [facts]
-- Each input line {"job": <job_desc>, "uid": n}; each output line {"key", "facts", "wants_gpu"} and, unless
-- "facts" is given, "rpc" (the job took the RPC path), "set" (what the table path assigned to
-- the job_desc) and "user" (messages to the user). The RPC path's transport (M.call) is counted and
-- answered with a decision that changes nothing.
package.path = arg[1] .. "/?.lua;" .. package.path
local cjson = require("cjson")
local user = {}
slurm = {
  SUCCESS = 0, ERROR = -1,
  log_info = function() end,
  log_error = function(fmt, ...) io.stderr:write(string.format(fmt, ...), "\n") end,
  log_user = function(fmt, ...) table.insert(user, string.format(fmt, ...)) end,
}
local M = require("swapaware")
local T = require("swapaware_table")
M.load_settings(arg[2])
-- One Lua state per phase here, where slurmctld keeps one from its start: this state stands for a
-- slurmctld that started before the queue snapshots the phase decides with (a state started after
-- one sends every job to the RPC path until the next poll: tests/unit/plugin/test_lua_table.py).
T.started_at = 0
local rpc = 0
M.call = function()
  rpc = rpc + 1
  return '{"response":{"decision":{"decisionId":"rpc","rewrite":{}}}}'
end
-- what the plugin assigns to the job_desc, as slurmctld's job_desc sees it (every write a call)
local applied = nil
local function recorded(job)
  return setmetatable({}, {
    __index = job,
    __newindex = function(_, k, v)
      applied = applied or {}
      applied[k] = v
      job[k] = v
    end,
  })
end
local only_facts = arg[4] == "facts"
for line in io.lines(arg[3]) do
  local req = cjson.decode(line)
  local job = req.job
  local facts = M.facts(job, req.uid)
  local out = { key = T.key(facts), facts = facts, wants_gpu = M.wants_gpu(job) }
  if not only_facts then
    local before = rpc
    applied, user = nil, {}
    M.submit(recorded(job), {}, req.uid)
    out.rpc = rpc > before
    if not out.rpc then out.set = applied end
    out.user = user
  end
  io.write(cjson.encode(out), "\n")
end
io.write(cjson.encode({ counters = T.counters }), "\n")
