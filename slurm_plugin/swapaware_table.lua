--[[
swapaware's admission table path (Lua 5.1, inside slurmctld; required by swapaware.lua).

The policy service publishes what it would decide for the job classes it knows (the "class
table", `table=` in swapaware_plugin.conf, format swapaware-admission/2: a JSON header, the distinct
decisions as JSON lines, one plain line per key; policy_service/core/admission_format.py) and the queue gate per QoS (`<table>.gate`). A GPU job
whose class the table holds is decided here with no socket I/O; anything else (no table, a table
that may not be used, no entry for the job's key, no decision for the gate's state) returns false
and the job takes the RPC path unchanged. Nothing here raises into slurmctld: swapaware.lua calls
T.decide under pcall and takes the RPC path on any error.

A table is never used (one log line per distinct reason, then silence until the reason changes)
when: lua-posix (posix.sys.stat) or lua-cjson is missing, the file is missing or not a regular
file, its owner is not in table_uids, it is group or other writable, it is larger than
T.MAX_BYTES, it is truncated or corrupt (its header's counts, its lines, its last line "end"), its
format or mode is unknown, its dialect is not slurm_release, or valid_until passed. The files are
checked at most every table_check_ms: the class table is read again when its (inode, size, mtime)
or its first 512 bytes (the header: version and counts) changed, the queue gate (small, rewritten
after every queue poll) is read at each check and its text compared. The signature alone is not
enough: the service replaces the files by rename, and two rewrites within one second can reuse a
freed inode with one size (seen in a test: the older gate served until the next rewrite).

A reload (slurmctld's Lua mutex is held meanwhile) reads the file and indexes its key lines with
string.find alone: key -> where its line's rest starts. A decision's JSON is decoded the first
time a job uses it, checked as M.validate checks an RPC reply, and kept for the version.

Settings (swapaware_plugin.conf): table=<path> (default "auto": admission.json beside socket=, where
    the service publishes it with its default [admission] table_path = "auto"; empty: off)  table_check_ms=1000  table_uids=0[,uid...] (who may
    own the files; default: root and slurmctld's own user)  slurm_release=<22.05|24.11|26.05> (absent: any)

Why one file of ~640 lines: every module of the plugin is one more file each site copies beside
slurm.conf on every controller and keeps in step at each upgrade (admin-guide.md, doctor's
job_submit_files), and this one is a single path that one table hit runs from end to end, in the
order a reader follows it: Settings, Key, Logging, Files, the class table, the queue gate, decision
ids, Lookup, T.decide.
]]

local T = {}

T.FORMAT = "swapaware-admission/2"
T.MAX_BYTES = 256 * 1024 * 1024   -- a larger file is never read (100,000 keys: ~15 MB)
T.GATE_FORMAT = "swapaware-gate/1"
T.PLACEHOLDER = "IDIDIDIDIDIDIDID"
T.MODES = { enforce = true, shadow = true }
T.STATES = { short = true, normal = true, long = true, unknown = true }
-- The facts policy.decide() reads, in key order (policy_service.core.admission.table_key).
T.KEY_FIELDS = { "user", "account", "partition", "jobName", "tresPerNode", "tresPerJob", "tresPerTask",
  "tresPerSocket", "scriptFingerprint", "comment", "envMemHint", "minNodes", "numTasks",
  "isBatch", "hetJob", "qos", "cpusPerTres", "memPerTres", "ntasksPerTres", "tresBind", "tresFreq",
  "exclusive" }
-- What a decision may set: the fields M.validate() sets from an RPC reply.
local STRING_SETS = { tres_per_node = true, tres_per_job = true, tres_per_task = true, tres_per_socket = true,
  tres_bind = true, admin_comment = true }
local MAX_SITE_FACTOR = 2147483645

local have_posix, pstat = pcall(require, "posix.sys.stat")
local have_cjson, cjson = pcall(require, "cjson")
local have_unistd, punistd = pcall(require, "posix.unistd")

-- The table is on by default ("auto": admission.json beside the service's socket, where the service
-- publishes it by default, [admission] table_path = "auto"):
-- files owned by root or by the user slurmctld itself runs as (SlurmUser, the service's user as the
-- admin guide installs it) are used. Trusting our own uid gives nothing away: slurmctld's user can
-- change its jobs directly.
local function default_uids()
  local uids = { [0] = true }
  local ok, euid = pcall(function() return punistd.geteuid() end)
  if have_unistd and ok and tonumber(euid) then uids[tonumber(euid)] = true end
  return uids
end
T.DEFAULTS = { table = "auto", table_check_ms = 1000, table_uids = default_uids(), slurm_release = "" }
T.counters = { table_hit = 0, table_miss = 0 }

-- Settings --------------------------------------------------------------------------------
-- setting(out, k, v): takes one swapaware_plugin.conf line of the table path into out; false if
-- k is not one of its keys.
function T.setting(out, k, v)
  if k == "table" then out.table = v
  elseif k == "table_check_ms" and tonumber(v) then out.table_check_ms = tonumber(v)
  elseif k == "slurm_release" then out.slurm_release = v
  elseif k == "table_uids" then
    local uids = {}
    for u in string.gmatch(v, "[^,%s]+") do
      if tonumber(u) then uids[tonumber(u)] = true end
    end
    out.table_uids = uids
  else return false end
  return true
end

-- check_s(settings): seconds between two stats of the same file (table_check_ms)
local function check_s(settings)
  return (settings.table_check_ms or T.DEFAULTS.table_check_ms) / 1000
end

-- path(settings): the class table's path, or nil when the table is off ("auto": beside the socket).
function T.path(settings)
  local t = settings.table
  if t == "auto" then
    local dir = string.match(settings.socket or "", "^(.*)/[^/]*$")
    return (dir and dir ~= "") and (dir .. "/admission.json") or nil
  end
  if t == nil or t == "" then return nil end
  return t
end

-- paths(settings): T.path(settings) and the gate's path, worked out again only when table= or
-- socket= changed (not per job).
local paths_of, main_path, gate_path = {}, nil, nil
local function paths(settings)
  local t, sock = settings.table, settings.socket
  if paths_of.table ~= t or paths_of.socket ~= sock or paths_of.settings == nil then
    paths_of = { table = t, socket = sock, settings = true }
    main_path = T.path(settings)
    gate_path = (main_path or "") .. ".gate"
  end
  return main_path, gate_path
end

-- Key -------------------------------------------------------------------------------------
local SEP = "\31"
local function render(v)
  if v == true then return "1" elseif v == false then return "0" elseif v == nil then return "" end
  if type(v) == "number" then return string.format("%d", v) end
  return v
end

-- The facts that are not text (M.facts makes every other one a string, used in the key as it is),
-- rendered through a table whose misses call render(): each number is formatted once (at most
-- 1024 remembered) and a flag never.
local NUMBER_FACTS = { minNodes = true, numTasks = true, ntasksPerTres = true }
local FLAG_FACTS = { isBatch = true, hetJob = true }
local digits_n = 0
local DIGITS = setmetatable({}, { __index = function(t, v)
  local s = render(v)
  if type(v) == "number" and v == v and digits_n < 1024 then rawset(t, v, s); digits_n = digits_n + 1 end
  return s
end })
local FLAGS = setmetatable({ [true] = "1", [false] = "0" }, { __index = function(_, v) return render(v) end })

-- T.key(facts): the rendered KEY_FIELDS of facts as M.facts makes them, joined by SEP, made by one
-- concatenation (generated from KEY_FIELDS: no table of parts, no call per field).
do
  local parts = {}
  for i, f in ipairs(T.KEY_FIELDS) do
    parts[i] = string.format(NUMBER_FACTS[f] and "DIGITS[f[%q]]" or FLAG_FACTS[f] and "FLAGS[f[%q]]" or "f[%q]", f)
  end
  T.key = assert(loadstring("local DIGITS, FLAGS, SEP = ...\nreturn function(f) return " ..
                            table.concat(parts, " .. SEP .. ") .. " end"))(DIGITS, FLAGS, SEP)
end

-- Logging: once per distinct reason --------------------------------------------------------
local logged = {}   -- file path -> the reason code last logged for it
T.log = function() end

-- why(path, code, fmt, ...): nil and code, after logging the reason unless it was the last one
-- logged for path. The gate's consequence differs from the table's.
local function why(path, code, fmt, ...)
  if logged[path] ~= code then
    logged[path] = code
    local effect = string.sub(path, -5) == ".gate" and "queue state taken as unknown" or "jobs take the RPC path"
    T.log("admission file %s not used (%s): " .. fmt, path, effect, ...)
  end
  return nil, code
end

-- Files -----------------------------------------------------------------------------------
-- signature(st): what tells a replaced file from the one loaded.
local function signature(st)
  return string.format("%d:%d:%d", st.st_ino, st.st_size, st.st_mtime)
end

-- check(path, uids): the file's stat signature if it may be read, else nil and a reason code
-- (logged once).
local function check(path, uids)
  local st = pstat.stat(path)
  if not st then return why(path, "missing", "no such file") end
  if pstat.S_ISREG(st.st_mode) == 0 then return why(path, "not_regular", "not a regular file") end
  if not uids[st.st_uid] then
    return why(path, "owner", "owned by uid %d, not one of table_uids", st.st_uid)
  end
  if st.st_mode % 32 >= 16 or st.st_mode % 4 >= 2 then   -- S_IWGRP 020, S_IWOTH 002
    return why(path, "writable", "group or other writable (mode %o)", st.st_mode % 4096)
  end
  if st.st_size > T.MAX_BYTES then
    return why(path, "size", "%d bytes, more than %d", st.st_size, T.MAX_BYTES)
  end
  return signature(st)
end

-- The class table --------------------------------------------------------------------------
-- What was read of each file: path, when it was last checked, what tells it from its next rewrite
-- (the table: its stat signature and head; the gate: its text), what was made of it.
local cur = { path = nil, checked = -math.huge, sig = nil, tbl = nil }
local gate = { path = nil, checked = -math.huge, text = nil, doc = nil }

local find, sub, match, format = string.find, string.sub, string.match, string.format

local function read_all(path)
  local f = io.open(path, "rb")
  if not f then return why(path, "missing", "cannot open it") end
  local text = f:read("*a")
  f:close()
  return text or ""
end

-- head(path): the file's first HEAD_BYTES ("" when it cannot be read).
local HEAD_BYTES = 512
local function head(path)
  local f = io.open(path, "rb")
  if not f then return "" end
  local text = f:read(HEAD_BYTES)
  f:close()
  return text or ""
end

local function printable(s)
  return (string.gsub(sub(s, 1, 64), "[^%w%p ]", "?"))
end

local function broken(path, what)
  return why(path, "corrupt", "corrupt or truncated (%s)", what)
end

-- parse(path, text, settings): the class table of a file's text (header fields, where each
-- decision line starts, key -> where its line goes on after the key), or nil and a reason (logged
-- once).
local function parse(path, text, settings)
  local e1 = find(text, "\n", 1, true)
  local magic = e1 and sub(text, 1, e1 - 1) or text
  if magic ~= T.FORMAT then return why(path, "format", "format %s unknown", printable(magic)) end
  local e2 = find(text, "\n", e1 + 1, true)
  if not e2 then return broken(path, "no header") end
  local ok, h = pcall(cjson.decode, sub(text, e1 + 1, e2 - 1))
  if not ok or type(h) ~= "table" then return broken(path, "header not JSON") end
  if type(h.entries) ~= "number" then return why(path, "format", "format %s unknown", "without entries") end
  if type(h.decisions) ~= "number" then return why(path, "format", "format %s unknown", "without decisions") end
  if type(h.valid_until) ~= "number" then return why(path, "format", "format %s unknown", "without valid_until") end
  if type(h.version) ~= "string" or not match(h.version, "^[0-9a-f]+$") or #h.version ~= 16 then
    return why(path, "format", "format %s unknown", "without a 16-hex version")
  end
  if not T.MODES[h.mode] then return why(path, "mode", "mode %s unknown", tostring(h.mode)) end
  local rel = settings.slurm_release or ""
  if rel ~= "" and h.dialect ~= rel then
    return why(path, "dialect", "dialect %s, this slurmctld is %s", tostring(h.dialect), rel)
  end
  if sub(text, -5) ~= "\n" .. "end\n" then return broken(path, "no last line end") end
  local stop = #text - 3       -- where "end" starts
  local dec, p = {}, e2 + 1
  for d = 1, h.decisions do
    local e = find(text, "\n", p, true)
    if e == nil or e >= stop then return broken(path, "fewer decision lines than counted") end
    dec[d] = p      -- where its line starts: decoded at its first use
    p = e + 1
  end
  -- key lines, indexed by their 16-hex digest (short strings: Lua hashes them whole; see T.digest)
  local index = {}
  for _ = 1, h.entries do
    local e = find(text, "\n", p, true)
    if e == nil or e >= stop then return broken(path, "fewer key lines than counted") end
    local d = sub(text, p, p + 15)
    if index[d] == nil then index[d] = p end     -- the publisher writes each digest once
    p = e + 1
  end
  if p ~= stop then return broken(path, "more lines than counted") end
  return { version = h.version, valid_until = h.valid_until, mode = h.mode, dialect = h.dialect,
           per_qos = h.per_qos == true, text = text, index = index, dec = dec, plans = {}, memo = {}, memo_n = 0 }
end

-- current(settings, now_s): the class table that may be used now, or nil (the reason logged).
function T.current(settings, now_s)
  -- the table last found usable, while the same settings neither stat it (table_check_ms has not
  -- passed since) nor see it expire: what the checks below would find
  local c = cur
  if c.settings == settings and now_s < c.fresh_until then return c.tbl end
  c.settings = nil
  local path = paths(settings)
  if path == nil then return nil end
  if not have_posix then return why(path, "posix", "lua-posix (posix.sys.stat) is not installed") end
  if not have_cjson then return why(path, "cjson", "lua-cjson is not installed") end
  if cur.path ~= path then cur = { path = path, checked = -math.huge } end
  if now_s - cur.checked >= check_s(settings) then
    cur.checked = now_s
    local sig, code = check(path, settings.table_uids or T.DEFAULTS.table_uids)
    -- (with the head of the file: its header names the version and counts the lines, and
    -- (inode, size, mtime in whole seconds) is the same for two rewrites within one second that
    -- reuse a freed inode and happen to have one size)
    local marked = sig and sig .. head(path)
    if not sig then
      cur.sig, cur.tbl, cur.code = nil, nil, code
    elseif marked ~= cur.sig then
      local text = read_all(path)
      local after = check(path, settings.table_uids or T.DEFAULTS.table_uids)
      if after ~= sig then
        cur.sig, cur.tbl = nil, nil         -- replaced while read: read it at the next check
        cur.checked = -math.huge
        return nil
      end
      cur.sig, cur.tbl = marked, nil      -- the old table is freed before the new one is indexed
      cur.tbl = text and parse(path, text, settings)
      if cur.tbl and (logged[path] ~= nil or not cur.announced) then
        cur.announced = true    -- the first load, and the first after one that could not be used
        T.log("admission table %s version %s used (mode %s, dialect %s)", path, cur.tbl.version,
              cur.tbl.mode, tostring(cur.tbl.dialect))
      end
    end
  end
  local tbl = cur.tbl
  if tbl == nil then return nil end
  if now_s > tbl.valid_until then
    return why(path, "expired", "version %s expired %.0f s ago", tbl.version, now_s - tbl.valid_until)
  end
  if logged[path] ~= nil then logged[path] = nil end
  cur.settings = settings
  cur.fresh_until = math.min(cur.checked + check_s(settings), tbl.valid_until)
  return tbl
end

-- reset(): forget the loaded files (the next use stats and reads them again).
function T.reset()
  cur = { path = nil, checked = -math.huge }
  gate = { path = nil, checked = -math.huge }
end

-- The queue gate ---------------------------------------------------------------------------

local function load_gate(path, settings, now_s, again)
  if gate.path ~= path then gate = { path = path, checked = -math.huge } end
  if now_s - gate.checked < check_s(settings) then return gate.doc end
  gate.checked = now_s
  local uids = settings.table_uids or T.DEFAULTS.table_uids
  local sig = check(path, uids)
  if not sig then
    gate.text, gate.doc = nil, nil
    return nil
  end
  -- Read at every check, its text compared, not only when its signature changed: (inode, size,
  -- mtime in whole seconds) is the same for two rewrites within one second that reuse a freed
  -- inode and happen to have one size (a test met it: the older state served until the next
  -- rewrite). The file is small and checked at most every table_check_ms.
  local text = read_all(path)
  if check(path, uids) ~= sig then
    -- replaced while read (the publisher rewrites it after every queue poll): the gate read
    -- before serves this job, as it would have within table_check_ms, and the file is read
    -- again at the next job; with none read before, it is read once more now (taking "unknown"
    -- here gave the job the table's decision for an unknown queue where Admit, reading the
    -- live snapshot, decided otherwise)
    gate.checked = -math.huge
    if gate.doc == nil and not again then return load_gate(path, settings, now_s, true) end
    return gate.doc
  end
  if text == nil then  -- (read_all logged why)
    gate.text, gate.doc = nil, nil
  elseif text ~= gate.text then
    local ok, doc = pcall(cjson.decode, text)
    if not ok or type(doc) ~= "table" then
      doc = why(path, "json", "not JSON (truncated or corrupt)")
    elseif doc.format ~= T.GATE_FORMAT or type(doc.valid_until) ~= "number" then
      doc = why(path, "format", "format %s unknown", tostring(doc.format))
    end
    gate.text, gate.doc, gate.prep = text, doc, nil
    if doc then logged[path] = nil end
  end
  return gate.doc
end

-- This host's name, read once per Lua state ("" when it cannot be read).
local host_name = nil
function T.hostname()
  if host_name == nil then
    local f = io.open("/proc/sys/kernel/hostname", "r")
    host_name = f and (f:read("*l") or "") or ""
    if f then f:close() end
  end
  return host_name
end

-- A gate that sends every job to the RPC path: logged once per distinct reason.
local declined_logged = nil
local function declined(path, fmt, ...)
  local text = string.format(fmt, ...)
  if declined_logged ~= text then
    declined_logged = text
    T.log("admission gate %s: jobs take the RPC path (%s)", path, text)
  end
  return nil
end

-- prepare(doc): what a loaded gate says of every job, worked out once per load (and again should
-- T.started_at change): why it sends every job to the RPC path (nil: it does not), its views.
local function prepare(doc)
  local why
  if type(doc.rpc_only) == "string" and doc.rpc_only ~= "" then
    why = doc.rpc_only
  elseif type(doc.controller) == "string" and doc.controller ~= "" and doc.controller ~= T.hostname() then
    why = string.format("written for the slurmctld on %s, this host is %s", doc.controller, T.hostname())
  -- a snapshot taken before this slurmctld started (1 s of slack: os.time() counts whole seconds)
  -- says nothing of its nodes' registration: typed shard jobs are refused until they register
  elseif T.started_at and type(doc.taken_at) == "number" and doc.taken_at < T.started_at + 1 then
    why = "queue snapshot taken before this slurmctld started"
  end
  return { started_at = T.started_at, why = why, views = type(doc.views) == "table" and doc.views or {} }
end

-- The state gate_state last gave, with what it was worked out from (``seen``): the same gate
-- table not checked since (load_gate would return the same doc without a stat), the same view,
-- settings and slurmctld start, within the doc's valid_until. decide() reads it first: a hit then
-- calls no gate function (each function a hit calls is cache lines it touches cold inside slurmctld).
local seen = { state = nil }

-- gate_state(settings, view, now_s): "short" | "normal" | "long" | "unknown" for the view (the
-- job's qos where the table is per qos, else ""): "unknown" when the gate file is missing, may not
-- be used or is past its valid_until (as decide() treats a stale queue snapshot). nil: the gate
-- sends every job to the RPC path (rpc_only: the service's live facts differ from what the table
-- assumed, e.g. the controller in control refuses shards; or it was written for the slurmctld of
-- another host: a controller that just took over must not use its predecessor's gate), stale or
-- not: a writer whose queue polls stall while control passes leaves a stale gate that names its
-- own controller, and "unknown" would still let an entry held for every state decide.
function T.gate_state(settings, view, now_s)
  local _, path = paths(settings)
  local doc = load_gate(path, settings, now_s)
  seen.state = nil
  if doc == nil then return "unknown" end
  local prep = gate.prep
  if prep == nil or prep.started_at ~= T.started_at then
    prep = prepare(doc)
    gate.prep = prep
  end
  if prep.why then return declined(path, "%s", prep.why) end
  declined_logged = nil
  if now_s > doc.valid_until then return "unknown" end
  local state = prep.views[view]
  if state == nil then state = doc.other end
  if not T.STATES[state] then return "unknown" end
  seen.gate, seen.checked, seen.view, seen.settings = gate, gate.checked, view, settings
  seen.started_at, seen.valid_until = T.started_at, doc.valid_until
  seen.until_s = gate.checked + check_s(settings)
  seen.state = state
  return state
end

-- Decision ids -----------------------------------------------------------------------------
-- 16 lower hex: 8 drawn from /dev/urandom once per Lua state (again when the counter wraps), then
-- an 8 hex counter.
local id_prefix, id_count = nil, 0

local function draw_prefix()
  local f = io.open("/dev/urandom", "rb")
  local bytes = f and f:read(4)
  if f then f:close() end
  if not bytes or #bytes ~= 4 then error("cannot read /dev/urandom") end
  return string.format("%02x%02x%02x%02x", string.byte(bytes, 1, 4))
end

function T.new_id()
  if id_prefix == nil or id_count > 4294967295 then
    id_prefix, id_count = draw_prefix(), 0
  end
  local id = id_prefix .. string.format("%08x", id_count)
  id_count = id_count + 1
  return id
end

-- Lookup ----------------------------------------------------------------------------------
-- plan(decision): a decision's job_desc assignments, checked as M.validate checks an RPC reply,
-- with where its AdminComment's placeholder id starts and ends (the table token follows it), or
-- nil when the decision is not one the plugin can apply.
function T.plan(decision)
  if type(decision) ~= "table" or type(decision.set) ~= "table" then return nil end
  local set = {}
  for field, value in pairs(decision.set) do
    if STRING_SETS[field] then
      if type(value) ~= "string" or #value > 4096 then return nil end
      set[field] = value
    elseif field == "site_factor" then
      if type(value) ~= "number" or value ~= math.floor(value) or math.abs(value) > MAX_SITE_FACTOR then
        return nil
      end
      set.site_factor = value
    else
      return nil
    end
  end
  if set.tres_per_node ~= nil and set.tres_per_node ~= "" and not match(set.tres_per_node, "^[%w:/,._-]+$") then
    return nil
  end
  local ac = set.admin_comment
  if ac == nil then return nil end
  local a, b = find(ac, "id=" .. T.PLACEHOLDER, 1, true)
  -- the token's 29 characters follow: " tbl=" .. version .. ":" .. 7 digits .. letter
  if a == nil or sub(ac, b + 1, b + 5) ~= " tbl=" or #ac < b + 30 then return nil end
  local msg = decision.message
  if msg ~= nil and type(msg) ~= "string" then return nil end
  return { set = set, message = msg, a = a, b = b }
end

-- plan_of(tbl, d): decision number d's plan, decoded and checked at its first use; false when
-- it cannot be applied.
local function plan_of(tbl, d)
  local p = tbl.plans[d]
  if p == nil then
    local at = tbl.dec[d]
    local ok, decision = false, nil
    if at then ok, decision = pcall(cjson.decode, sub(tbl.text, at, find(tbl.text, "\n", at, true) - 1)) end
    p = ok and T.plan(decision) or false
    tbl.plans[d] = p
  end
  return p
end

local LETTER = { short = "s", normal = "n", long = "l", unknown = "u" }
local ESCAPE = { ["\\"] = "\\\\", ["\t"] = "\\t", ["\n"] = "\\n" }

-- digest(key): 16 hex of two polynomial hashes over every byte (admission_format.key_digest).
-- The lines are indexed by it, not by the key: Lua 5.1 hashes a string longer than 31 bytes from
-- every (length / 32 + 1)-th byte only, so keys that differ between those bytes would share one
-- hash and their index would cost time quadratic in their number.
local byte, min = string.byte, math.min
function T.digest(key)
  local n = #key
  local h1, h2 = n, 0
  for i = 1, n, 4096 do
    local bytes = { byte(key, i, min(n, i + 4095)) }
    for j = 1, #bytes do
      local b = bytes[j]
      h1 = (h1 * 31 + b) % 4294967296
      h2 = (h2 * 65599 + b) % 4294967291
    end
  end
  return string.format("%08x%08x", h1, h2)
end

-- entry_at(tbl, key): where the key's line goes on after the key, or nil (no entry). The line's
-- key must be the whole key: the digest only finds it.
local function entry_at(tbl, key)
  local p = tbl.index[T.digest(key)]
  if p == nil then return nil end
  if find(key, "[\\\t\n]") then key = string.gsub(key, "[\\\t\n]", ESCAPE) end
  local text, q = tbl.text, p + 17 + #key
  -- (the line's key, cut out of the text, is the job's key string itself when equal: Lua interns
  -- strings, so the comparison allocates nothing)
  if byte(text, p + 16) ~= 9 or byte(text, q) ~= 9 or sub(text, p + 17, q - 1) ~= key then return nil end
  return q + 1
end

-- pick(tbl, pos, state): (plan, entry number, letter) of the entry's decision in the state, or nil.
local function pick(tbl, pos, state)
  local text = tbl.text
  local number = sub(text, pos, pos + 6)
  if sub(text, pos + 7, pos + 7) ~= "\t" or not match(number, "^%d%d%d%d%d%d%d$") then return nil end
  local refs = sub(text, pos + 8, find(text, "\n", pos, true) - 1)
  local letter = LETTER[state]
  local d = match(" " .. refs .. " ", " " .. letter .. "(%d+) ")
  if d == nil then
    letter, d = "a", match(refs, "^a(%d+)$")
    if d == nil then return nil end
  end
  return plan_of(tbl, tonumber(d)), number, letter
end

-- MEMO_MAX: the keys whose lookup (digest, key line, decision per state) a loaded table
-- remembers; past it the memo starts over. A burst of a few classes (an array, a sweep) looks
-- each key up once per table version (which never changes once loaded). Kept small: a remembered
-- key stays interned, and keys that differ only between the bytes Lua 5.1 hashes (see T.digest)
-- share one string-table chain that every new key string walks.
T.MEMO_MAX = 64

-- locate(tbl, key): the memo of the key's entry: {pos = where its line goes on after the key, or
-- false (no entry); [state] = {plan, entry number, letter} or false, once chosen}.
local function locate(tbl, key)
  local m = tbl.memo[key]
  if m == nil then
    if tbl.memo_n >= T.MEMO_MAX then tbl.memo, tbl.memo_n = {}, 0 end
    m = { pos = entry_at(tbl, key) or false }
    tbl.memo[key] = m
    tbl.memo_n = tbl.memo_n + 1
  end
  return m
end

-- choose(tbl, m, state): the located entry's decision in the state as the job gets it, or false:
-- {plan = {set, fields, message} for M.apply (set: the decision's, its admin_comment written per job),
-- comment: its AdminComment as a format of the id's two halves (string.format copies the text
-- around them byte for byte, NULs too: only a %s argument is cut at a NUL), the table token in it}.
local function choose(tbl, m, state)
  local r = m[state]
  if r == nil then
    local p, number, letter = pick(tbl, m.pos, state)
    r = false
    if p then
      local set, fields, ac = {}, {}, p.set.admin_comment
      for k, v in pairs(p.set) do set[k], fields[#fields + 1] = v, k end
      local tail = " tbl=" .. tbl.version .. ":" .. number .. letter .. sub(ac, p.b + 31)
      r = { plan = { set = set, fields = fields, message = p.message },
            comment = string.gsub(sub(ac, 1, p.a + 2), "%%", "%%%%") .. "%s%08x" .. string.gsub(tail, "%%", "%%%%") }
    end
    m[state] = r
  end
  return r
end

-- decide(M, job_desc, facts, now_s, key): true when the table decided the job of these facts
-- (M.facts; its assignments applied to job_desc), false when it takes the RPC path. ``key``:
-- T.key(facts) where the caller has it. May raise: the caller runs it under pcall.
-- A hit of a class and gate state met before runs in this body alone, from the memos (T.current's
-- freshness, locate's and choose's entries, gate_state's ``seen``), with the assignments of M.apply
-- written out: inside slurmctld the caches are cold at each submission, and each function called
-- is its closure, prototype, code and constants to fetch (docs/admission-table.md, "Why a hit
-- costs 86 us inside slurmctld"). Anything not met before takes the functions above.
function T.decide(M, job_desc, facts, now_s, key)
  local settings = M.settings
  local tbl = cur.tbl
  if cur.settings ~= settings or now_s >= cur.fresh_until then
    tbl = T.current(settings, now_s)
    if tbl == nil then return false end
  end
  key = key or T.key(facts)
  local m = tbl.memo[key]
  if m == nil then m = locate(tbl, key) end
  if not m.pos then
    T.counters.table_miss = T.counters.table_miss + 1
    return false
  end
  local view = tbl.per_qos and facts.qos or ""
  local state = seen.state
  if state == nil or seen.gate ~= gate or seen.checked ~= gate.checked or seen.view ~= view
      or seen.settings ~= settings or seen.started_at ~= T.started_at or now_s >= seen.until_s
      or now_s > seen.valid_until then
    state = T.gate_state(settings, view, now_s)
  end
  local r = m[state]
  if r == nil then r = state ~= nil and choose(tbl, m, state) end
  if not r then
    T.counters.table_miss = T.counters.table_miss + 1
    return false
  end
  -- the id as T.new_id() draws it, formatted straight into the AdminComment: the one string a hit
  -- makes (every string is garbage slurmctld's Lua collects later, in whatever code allocates next)
  if id_prefix == nil or id_count > 4294967295 then id_prefix, id_count = draw_prefix(), 0 end
  local plan = r.plan
  local set, fields = plan.set, plan.fields
  set.admin_comment = format(r.comment, id_prefix, id_count)
  id_count = id_count + 1
  for i = 1, #fields do  -- M.apply(job_desc, plan), written out
    local field = fields[i]
    job_desc[field] = set[field]
  end
  T.counters.table_hit = T.counters.table_hit + 1
  local msg = plan.message
  if msg and msg ~= "" and slurm and slurm.log_user then
    slurm.log_user("%s", msg)
  end
  return true
end

return T
