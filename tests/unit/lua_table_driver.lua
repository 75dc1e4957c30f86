-- Test driver: slurm_plugin/swapaware.lua with its admission table path, as slurmctld loads it,
-- one JSON request per stdin line, one JSON answer per stdout line.
-- usage: lua5.1 lua_table_driver.lua <plugin_dir> <settings_dir> [hide]   (hide: posix | cjson | facts)
package.path = arg[1] .. "/?.lua;" .. package.path
local cjson = require("cjson")
local socket = require("socket")
local hide = arg[3]
if hide == "posix" then
  package.preload["posix.sys.stat"] = function() error("hidden by the test") end
elseif hide == "facts" then      -- swapaware_facts.lua not installed beside swapaware.lua
  package.preload["swapaware_facts"] = function() error("hidden by the test") end
elseif hide == "cjson" then
  package.loaded["cjson"] = nil
  package.preload["cjson"] = function() error("hidden by the test") end
end
local HERE = string.match(debug.getinfo(1, "S").source, "^@(.*)/[^/]*$")
local S = dofile(HERE .. "/../slurm_stub.lua")
local M = require("swapaware")
local T = require("swapaware_table")
M.load_settings(arg[2])
-- The RPC path: counted, answered with a decision that changes nothing (the job stays as typed).
local rpc_calls = 0
M.call = function(path, line, timeout_s)
  rpc_calls = rpc_calls + 1
  return '{"response":{"decision":{"decisionId":"rpc","rewrite":{}}}}'
end

local function answer(t)
  t.logs, t.user, t.rpc_calls, t.counters = S.logs, S.user, rpc_calls, T.counters
  io.write(cjson.encode(t), "\n")
  io.flush()
  S.logs, S.user = {}, {}
end

for line in io.lines() do
  local req = cjson.decode(line)
  if req.op == "submit" then
    local rc = M.submit(req.job, {}, req.uid or 1000)
    answer({ rc = rc, job = req.job })
  elseif req.op == "submit_counted" then  -- the job_desc behind __index/__newindex, as slurmctld gives
    local fields, reads, writes = req.job, {}, {}   -- it (each read a call into slurmctld): reads and
    local env, env_lookups = fields.environment, 0  -- writes counted per field, and the lookups in
    local jd = setmetatable({}, {                   -- environment (a new table at each read, as there)
      __index = function(_, k)
        reads[k] = (reads[k] or 0) + 1
        if k ~= "environment" or type(env) ~= "table" then return fields[k] end
        return setmetatable({}, { __index = function(_, name) env_lookups = env_lookups + 1; return env[name] end })
      end,
      __newindex = function(_, k, v) writes[k] = (writes[k] or 0) + 1; fields[k] = v end })
    local rc = M.submit(jd, {}, req.uid or 1000)
    answer({ rc = rc, job = fields, reads = reads, writes = writes, env_lookups = env_lookups })
  elseif req.op == "key" then
    local facts = M.facts(req.job, req.uid or 1000)
    answer({ key = T.key(facts), facts = facts })
  elseif req.op == "key_reads" then     -- the key from the fields the table path reads alone
    local reads = {}
    local jd = setmetatable({}, { __index = function(_, k) reads[k] = true; return req.job[k] end })
    local s = M.snapshot(jd, nil, "key")
    local names = {}
    for k in pairs(reads) do names[#names + 1] = k end
    answer({ key = T.key(M.facts(s, req.uid or 1000)), reads = names, rest = M.REST_READS })
  elseif req.op == "over_limit" then    -- the limit check of one snapshot part ("all": every field)
    local field, size, limit = M.over_slurm_limit(req.job, req.part ~= "all" and req.part or nil)
    answer({ field = field or cjson.null, size = size, limit = limit, limited = M.LIMITED })
  elseif req.op == "raise" then         -- the table path raises from here on
    T.key = function() error("raised by the test") end
    answer({})
  elseif req.op == "replace_on_read" then  -- the next io.open of req.path for reading first replaces
    local open, path, text = io.open, req.path, req.text  -- the file with req.text (written beside it,
    io.open = function(p, mode)                             -- renamed over it: a new inode, as the
      if p == path and (mode == nil or string.sub(mode, 1, 1) == "r") then  -- publisher's rewrite), once
        io.open = open
        local f = open(path .. ".tmp", "wb")
        f:write(text)
        f:close()
        os.rename(path .. ".tmp", path)
      end
      return open(p, mode)
    end
    answer({})
  elseif req.op == "settings" then
    answer({ settings = M.settings })
  elseif req.op == "bench_hit" then     -- seconds per decide() of jobs the table decides, in turn
    local function make_jobs(n)
      local jobs, plain = {}, {}
      for i = 1, n do
        local jd = {}
        for k, v in pairs(req.jobs[(i - 1) % #req.jobs + 1]) do jd[k] = v end
        plain[i] = jd
        if req.proxy then     -- each read and write a function call, as slurmctld's job_desc
          local fields = jd
          jd = setmetatable({}, { __index = function(_, k) return fields[k] end,
                                  __newindex = function(_, k, v) fields[k] = v end })
        end
        jobs[i] = jd
      end
      return jobs, plain
    end
    local jobs, plain = make_jobs(req.n)
    local t0 = socket.gettime()
    for i = 1, req.n do M.submit(jobs[i], {}, 1000) end
    local total = socket.gettime() - t0
    -- bytes the hits allocate (the collector stopped; the table already loaded by the hits above):
    -- garbage that slurmctld's Lua state collects later, in whatever Lua code allocates next. The
    -- job_desc's writes go nowhere, as into slurmctld's C setter (a plain table would count its
    -- own growth).
    local m = math.min(req.n, 1000)
    local more = {}
    for i, jd in ipairs(make_jobs(m)) do
      more[i] = setmetatable({}, { __index = jd, __newindex = function() end })
    end
    collectgarbage("collect")
    collectgarbage("stop")
    local k0 = collectgarbage("count")
    for i = 1, m do M.submit(more[i], {}, 1000) end
    local alloc_bytes = (collectgarbage("count") - k0) * 1024 / m
    collectgarbage("restart")
    local t1 = socket.gettime()
    local facts = M.facts(req.jobs[1], 1000)
    for _ = 1, req.n do T.key(facts) end
    local key_s = socket.gettime() - t1
    local t2 = socket.gettime()
    for i = 1, req.n do M.facts(req.jobs[(i - 1) % #req.jobs + 1], 1000) end
    local facts_s = socket.gettime() - t2
    answer({ seconds = total, key_seconds = key_s, facts_seconds = facts_s, job = plain[req.n],
             alloc_bytes = alloc_bytes })
  elseif req.op == "bench_slurm" then   -- table hits as inside slurmctld, each job timed alone
    -- The job_desc as slurmctld gives it: every read a call (__index), environment a new table behind
    -- a lookup function of its own at each read (_push_job_env), every write a call (__newindex); the
    -- calls counted. Before each job slurm.jobs is made again with req.queue entries, as slurmctld's
    -- _update_jobs_global does at each submission: its garbage paces the collector as there. The
    -- phases as bench/lua_phases.py splits them (two clock reads each).
    local calls = { read = 0, env = 0, write = 0 }
    local function job_desc(fields)
      local env = fields.environment
      return setmetatable({}, {
        __index = function(_, k)
          calls.read = calls.read + 1
          if k ~= "environment" then return fields[k] end
          return setmetatable({}, { __index = function(_, name)
            calls.env = calls.env + 1
            return type(env) == "table" and env[name] or nil
          end, __newindex = function() end })
        end,
        __newindex = function(_, k, v) calls.write = calls.write + 1; fields[k] = v end })
    end
    local function queue(n)
      local jobs = {}
      for j = 1, n do jobs[tostring(j)] = setmetatable({}, { __index = function() end, _job_rec_ptr = j }) end
      slurm.jobs = jobs
    end
    local F, clock = require("swapaware_facts"), socket.gettime
    local sums, restore = dofile(HERE .. "/../../bench/phase_timers.lua")(F, T, clock)
    local hits0, total, fields = T.counters.table_hit, 0, nil
    local cold, coldbuf = (req.cold_mb or 0) * 65536, {}   -- numbers, 16 bytes each in the array part
    for j = 1, cold do coldbuf[j] = j end
    collectgarbage("collect")
    for i = 1, req.n do       -- each job made just before its submission (what slurmctld holds live)
      fields = {}
      for k, v in pairs(req.jobs[(i - 1) % #req.jobs + 1]) do fields[k] = v end
      local jd = job_desc(fields)
      queue(req.queue or 0)
      S.user = {}
      if cold > 0 then        -- other work between jobs, as slurmctld's RPCs: the caches emptied of the plugin's
        local sum = 0
        for j = 1, cold, 4 do sum = sum + coldbuf[j] end   -- one read per 64-byte line
      end
      local t0 = clock()
      M.submit(jd, {}, 1000)
      total = total + (clock() - t0)
    end
    local last = fields
    restore()
    slurm.jobs = nil
    answer({ seconds = total, phases = sums, calls = calls, hits = T.counters.table_hit - hits0, job = last })
  elseif req.op == "bench_load" then    -- seconds to stat, read, decode and check the table
    local best = math.huge
    for _ = 1, req.n do
      T.reset()
      collectgarbage("collect")
      local t0 = socket.gettime()
      local tbl = T.current(M.settings, socket.gettime())
      local dt = socket.gettime() - t0
      if tbl == nil then error("the table was not loaded") end
      if dt < best then best = dt end
    end
    answer({ seconds = best, memory_kib = collectgarbage("count") })
  else
    error("unknown op " .. tostring(req.op))
  end
end
