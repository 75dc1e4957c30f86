--[[
swapaware job_submit module (Lua 5.1, runs inside slurmctld).

A site with its own job_submit.lua adds:
    package.path = "/etc/slurm/?.lua;" .. package.path   -- where this file lives
    local swapaware = require("swapaware")
    ... and in slurm_job_submit(job_desc, part_list, submit_uid):
    swapaware.submit(job_desc, part_list, submit_uid)

What it does: reads the job's facts (swapaware_facts.lua, installed beside this file; no secrets:
the batch script's fingerprint, never its text), decides the job from the admission table the
service publishes when it holds the job's class (swapaware_table.lua), else sends the facts as
proto3 JSON over the policy service's controller-local Unix socket, validates the whole reply,
then applies it at once. It never raises and never rejects a job: on any
problem (service down, slow, bad reply) the job goes through unchanged and one log line
says why. A circuit breaker stops calling a failing service for a while so slurmctld, which
holds its locks during this call, is never stalled by repeated timeouts.

Settings come from swapaware_plugin.conf beside slurm.conf (key=value lines):
    socket=/run/swapaware/policy.sock   timeout_ms=200   breaker_s=10   enabled=1
    max_script_bytes=4194304   (Slurm's max_script_size: a larger script is refused by slurmctld
                                after this plugin ran, so such a job is not decided at all)
    table=  table_check_ms=1000  table_uids=0  slurm_release=   (the admission table the service
                                publishes, decided here with no round trip: swapaware_table.lua)
]]

local M = {}
local have_facts, F = pcall(require, "swapaware_facts")
if have_facts then
  -- what tests, benches and a site's own job_submit.lua call through swapaware
  for _, k in ipairs({ "NO_VAL", "SLURM_FIELD_LIMITS", "fingerprint", "utf8_clean", "cap", "exclusive",
      "het_component", "wants_gpu", "snapshot", "new_snapshot", "facts", "over_slurm_limit", "KEY_READS",
      "REST_READS", "LIMITED" }) do
    M[k] = F[k]
  end
end
M.MAX_SITE_FACTOR = 2147483645
-- what cli_filter puts in a --test-only submission's comment (swapaware_cli.lua, M.TEST_ONLY_MARK)
local TEST_ONLY_MARK = "swapaware:test-only"
local str = have_facts and F.str or tostring

M.settings = { socket = "/run/swapaware/policy.sock", timeout_ms = 200, breaker_s = 10, enabled = true,
               max_script_bytes = 4194304 }
M.state = { open_until = 0, failures = 0, logged_open = false }
-- Jobs let through unchanged, counted for this Lua state and sent with each Admit (the service's
-- swapaware_plugin_fail_open_total); the instance tells the service when a new state starts over.
M.counters = { instance = string.format("%d-%s", os.time(), string.match(tostring({}), "0x%x+") or "0"),
               breaker_open = 0, service_error = 0 }

local REWRITE_KEYS = {
  tresPerNode = "tres_per_node", tresPerJob = "tres_per_job", tresPerTask = "tres_per_task",
  tresPerSocket = "tres_per_socket", adminComment = "admin_comment", tresBind = "tres_bind",
}

local have_cjson, cjson = pcall(require, "cjson")
local have_socket, socket = pcall(require, "socket")
local have_unix, unix = pcall(require, "socket.unix")
local have_table, T = pcall(require, "swapaware_table")

local function log_info(fmt, ...)
  if slurm and slurm.log_info then slurm.log_info("swapaware: " .. fmt, ...) end
end

local function log_error(fmt, ...)
  if slurm and slurm.log_error then slurm.log_error("swapaware: " .. fmt, ...) end
end

if have_table then
  T.log = log_info
  for k, v in pairs(T.DEFAULTS) do M.settings[k] = v end
end

local function now()
  if have_socket then return socket.gettime() end
  return os.time()
end

-- process_start(): when this process (slurmctld) started, wall clock: /proc/self/stat's start time
-- (field 22, clock ticks after boot; USER_HZ is 100 on Linux) after /proc/stat's btime (whole
-- seconds); nil where either cannot be read.
local function process_start()
  local f = io.open("/proc/self/stat", "r")
  local stat = f and f:read("*l")
  if f then f:close() end
  local g = io.open("/proc/stat", "r")
  local all = g and g:read("*a")
  if g then g:close() end
  local btime = all and tonumber(string.match(all, "\nbtime (%d+)"))
  local rest = stat and string.match(stat, "%) (.*)$")
  if not btime or not rest then return nil end
  local i = 2
  for tok in string.gmatch(rest, "%S+") do
    i = i + 1
    if i == 22 then return tonumber(tok) and btime + tonumber(tok) / 100 end
  end
  return nil
end

-- When slurmctld started (or, 23.11+, was reconfigured, which restarts it; a job_submit.lua
-- reloaded in a running slurmctld keeps its start). The service and the table's gate compare it
-- with their queue snapshot's time: one taken before says nothing of the nodes' registration with
-- this slurmctld (T.gate_state, Admit). Where /proc cannot tell, when this Lua state was created.
M.counters.started_at = process_start() or now()
if have_table then T.started_at = M.counters.started_at end

-- Settings --------------------------------------------------------------------------------
function M.parse_settings(text, base)
  local out = {}
  for k, v in pairs(base or M.settings) do out[k] = v end
  for line in string.gmatch(text or "", "[^\n]+") do
    local k, v = string.match(line, "^%s*([%w_]+)%s*=%s*(.-)%s*$")
    if k == "socket" then out.socket = v
    elseif k == "timeout_ms" and tonumber(v) then out.timeout_ms = tonumber(v)
    elseif k == "breaker_s" and tonumber(v) then out.breaker_s = tonumber(v)
    elseif k == "max_script_bytes" and tonumber(v) then out.max_script_bytes = tonumber(v)
    elseif k == "enabled" then out.enabled = (v == "1" or v == "true" or v == "yes")
    elseif k and have_table then T.setting(out, k, v)
    elseif k == "table" then out.table = v
    end
  end
  return out
end

function M.load_settings(dir)
  local f = io.open(dir .. "/swapaware_plugin.conf", "r")
  if not f then return M.settings end
  local text = f:read("*a")
  f:close()
  M.settings = M.parse_settings(text, M.settings)
  return M.settings
end

-- Reply -----------------------------------------------------------------------------------
-- Returns a table of job_desc assignments, or nil and an error. Nothing is applied here.
function M.validate(reply)
  if type(reply) ~= "table" then return nil, "reply is not a JSON object" end
  if reply.error ~= nil then
    local e = reply.error
    return nil, "service error " .. str(type(e) == "table" and e.code) .. ": " .. str(type(e) == "table" and e.message)
  end
  local resp = reply.response
  if type(resp) ~= "table" or type(resp.decision) ~= "table" then return nil, "reply has no decision" end
  local d = resp.decision
  local rw = d.rewrite or {}
  if type(rw) ~= "table" then return nil, "rewrite is not an object" end
  local set = {}
  for key, value in pairs(rw) do
    local field = REWRITE_KEYS[key]
    if field ~= nil then
      if type(value) ~= "string" then return nil, key .. " is not a string" end
      if #value > 4096 then return nil, key .. " is too long" end
      set[field] = value
    elseif key == "siteFactor" then
      local v = tonumber(value)
      if v == nil or v ~= math.floor(v) or math.abs(v) > M.MAX_SITE_FACTOR then
        return nil, "siteFactor out of range"
      end
      -- The Lua job_desc setter adds Slurm's NICE_OFFSET itself (seen on 22.05: adding it
      -- here wraps the factor to -2^31). Assign the plain value.
      set.site_factor = v
    elseif key ~= "userMessage" then
      return nil, "unknown rewrite key " .. tostring(key)
    end
  end
  if set.tres_per_node ~= nil and set.tres_per_node ~= "" and not string.match(set.tres_per_node, "^[%w:/,._-]+$") then
    return nil, "tres_per_node has unexpected characters"
  end
  return { set = set, decision_id = str(d.decisionId), message = rw.userMessage }
end

-- apply(job_desc, plan): every assignment of plan.set (in the order of plan.fields where it lists
-- them: a table decision's, named once per table version, no pairs() per job).
function M.apply(job_desc, plan)
  local set, fields = plan.set, plan.fields
  if fields then
    for i = 1, #fields do
      local field = fields[i]
      job_desc[field] = set[field]
    end
    return
  end
  for field, value in pairs(set) do
    job_desc[field] = value
  end
end

-- Transport -------------------------------------------------------------------------------
-- One request line, one response line, under one overall deadline. The connection is kept
-- open between submissions (slurmctld keeps this Lua state), so the usual cost is one write
-- and one read; any error closes it, and a stale one is replaced once within the deadline.
M.conn = nil

local function close_conn()
  if M.conn then pcall(function() M.conn:close() end) end
  M.conn = nil
end

local function connect(path, timeout_s)
  local ctor = unix.stream or unix
  local c, err = ctor()
  if not c then return nil, "socket: " .. str(err) end
  c:settimeout(timeout_s)
  local ok, cerr = c:connect(path)
  if not ok then c:close(); return nil, "connect " .. path .. ": " .. str(cerr) end
  return c
end

local function exchange(c, line, deadline)
  local t = deadline - now()
  if t <= 0 then return nil, "timeout" end
  c:settimeout(t)
  local sent, serr = c:send(line .. "\n")
  if not sent then return nil, "send: " .. str(serr) end
  t = deadline - now()
  if t <= 0 then return nil, "timeout" end
  c:settimeout(t)
  local resp, rerr = c:receive("*l")
  if not resp then return nil, "receive: " .. str(rerr) end
  return resp
end

-- stale(err): the kept connection was closed by the other end (the service restarted) before
-- this request reached it, so sending it again cannot make a second decision. A timeout is never
-- stale: the service may be deciding the request right now.
function M.stale(err)
  err = str(err)
  if string.find(err, "timeout", 1, true) then return false end
  return string.find(err, "closed", 1, true) ~= nil or string.find(err, "Broken pipe", 1, true) ~= nil
      or string.find(err, "reset by peer", 1, true) ~= nil
end

function M.call(path, line, timeout_s)
  if not (have_socket and have_unix) then return nil, "lua-socket (socket.unix) is not installed" end
  local deadline = now() + timeout_s
  local reused = M.conn ~= nil
  if not reused then
    local c, err = connect(path, timeout_s)
    if not c then return nil, err end
    M.conn = c
  end
  local resp, err = exchange(M.conn, line, deadline)
  if resp then return resp end
  close_conn()
  if reused and M.stale(err) and deadline - now() > 0 then
    -- the kept connection had gone stale (service restarted): one fresh try
    local c, cerr = connect(path, deadline - now())
    if not c then return nil, cerr end
    M.conn = c
    resp, err = exchange(c, line, deadline)
    if resp then return resp end
    close_conn()
  end
  return nil, err
end

-- Entry point -----------------------------------------------------------------------------
local function breaker_fail(why)
  M.counters.service_error = M.counters.service_error + 1
  local st = M.state
  st.failures = st.failures + 1
  local wait = math.min(M.settings.breaker_s * (2 ^ math.min(st.failures - 1, 4)), 300)
  st.open_until = now() + wait
  st.logged_open = false
  log_error("job passes unchanged (fail-open): %s; not asking the service for %d s", why, wait)
end

-- table_decide(job_desc, jd, submit_uid): T.decide of the job's class key facts and key
-- (F.key_facts: made again only for a job unlike those seen lately).
local function table_decide(job_desc, jd, submit_uid)
  local facts, key = F.key_facts(jd, submit_uid, T.key)
  return T.decide(M, job_desc, facts, now(), key)
end

-- by_table(job_desc, jd, submit_uid): true when the published admission table decided the job
-- (swapaware_table.lua) from its snapshot jd; false: the job takes the RPC path. Never raises.
M.table_error = nil
local function by_table(job_desc, jd, submit_uid)
  if not have_table then
    if M.table_error ~= "module" then
      M.table_error = "module"
      log_error("table=%s is set but swapaware_table.lua cannot be loaded (%s); jobs take the RPC path",
                M.settings.table, tostring(T))
    end
    return false
  end
  local ok, hit = pcall(table_decide, job_desc, jd, submit_uid)
  if ok then return hit end
  if M.table_error ~= tostring(hit) then
    M.table_error = tostring(hit)
    log_error("admission table path failed (jobs take the RPC path): %s", tostring(hit))
  end
  return false
end

-- over_limits(jd, part): false, or true after logging why the job passes unchanged (a script over
-- max_script_bytes, or a field over Slurm's limit), of the fields the snapshot's ``part`` read
-- ("key", "rest", nil: all; the script is of the key).
local function over_limits(jd, part)
  local script = jd.script
  if part ~= "rest" and script ~= nil and #script > M.settings.max_script_bytes then
    log_info("job passes unchanged: its batch script is %d bytes, over max_script_bytes=%d (Slurm's " ..
             "max_script_size refuses it)", #script, M.settings.max_script_bytes)
    return true
  end
  local field, size, limit = F.over_slurm_limit(jd, part)
  if field then
    log_info("job passes unchanged, nothing recorded: its %s is %d bytes, over Slurm's %d (slurmctld refuses " ..
             "the job after job_submit)", field, size, limit)
    return true
  end
  return false
end

-- One snapshot and one facts table per Lua state, filled again for each job (slurmctld calls
-- job_submit under its Lua mutex, one job at a time; neither is kept past the call): a table hit
-- then allocates its AdminComment alone, about 0.2 KB (5.2 KB with both made per job, 0.7 KB with
-- a plan per job; bench/lua_table.py). Each read of the snapshot assigns every field it reads, nil
-- ones too, and a field is used only once this job's part holding it was read: nothing stays from
-- the job before, and the snapshot is not cleared.
local snap, facts_buf = nil, {}
M.facts_error_logged = false
local function decide(job_desc, submit_uid)
  if not M.settings.enabled then return end
  if not have_facts then
    if not M.facts_error_logged then
      M.facts_error_logged = true
      log_error("swapaware_facts.lua cannot be loaded (%s): every job passes unchanged; install it beside " ..
                "swapaware.lua", tostring(F))
    end
    return
  end
  snap = snap or F.new_snapshot()
  local jd = F.read_fields(job_desc, F.GRES_FIELDS, snap)
  if not F.wants_gpu(jd) then return end
  -- from here on the job's fields are read from jd, written to job_desc
  local by_tbl = M.settings.table ~= nil and M.settings.table ~= ""
  local part = by_tbl and "key" or nil
  F.snapshot(job_desc, jd, part)
  if over_limits(jd, part) then return end
  -- a --test-only query, marked by cli_filter (swapaware_cli.lua): answered for the request as typed
  local comment = jd.comment
  if comment and comment ~= "" and string.find(comment, TEST_ONLY_MARK, 1, true) then return end
  if not have_cjson then
    log_error("lua-cjson is not installed; job passes unchanged")
    return
  end
  if by_tbl then
    if by_table(job_desc, jd, submit_uid) then return end
    F.snapshot(job_desc, jd, "rest")
    if over_limits(jd, "rest") then return end
  end
  local st = M.state
  if now() < st.open_until then
    M.counters.breaker_open = M.counters.breaker_open + 1
    if not st.logged_open then
      log_info("service marked unavailable (circuit open); GPU jobs pass unchanged")
      st.logged_open = true
    end
    return
  end
  local c = M.counters
  local line = cjson.encode({ method = "Admit", request = { job = F.facts(jd, submit_uid, facts_buf), brief = true,
    plugin = { instance = c.instance, breakerOpen = c.breaker_open, serviceError = c.service_error,
      startedAt = c.started_at } } })
  local resp, err = M.call(M.settings.socket, line, M.settings.timeout_ms / 1000)
  if not resp then return breaker_fail(err) end
  local ok, reply = pcall(cjson.decode, resp)
  if not ok then return breaker_fail("reply is not JSON") end
  local plan, verr = M.validate(reply)
  if not plan then
    -- The service answered: a bad request or reply is not an outage, keep the breaker closed.
    M.counters.service_error = M.counters.service_error + 1
    log_error("job passes unchanged: %s", verr)
    return
  end
  st.failures = 0
  M.apply(job_desc, plan)
  if plan.message and plan.message ~= "" and slurm and slurm.log_user then
    slurm.log_user("%s", plan.message)
  end
end

-- Never raises, never rejects: returns slurm.SUCCESS (or 0 outside slurmctld).
function M.submit(job_desc, part_list, submit_uid)
  local ok, err = pcall(decide, job_desc, submit_uid)
  if not ok then log_error("internal error, job passes unchanged: %s", tostring(err)) end
  return (slurm and slurm.SUCCESS) or 0
end

return M
