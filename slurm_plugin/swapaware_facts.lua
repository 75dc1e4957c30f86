--[[
swapaware job_submit: the job's facts (Lua 5.1, inside slurmctld; required by swapaware.lua).

What the plugin reads of a job_desc and how it turns it into the facts the service and the
admission table decide from: each field read once per job into a plain snapshot (the table path
reads the class key's fields alone), the batch script's fingerprint (never its text), user-typed
text capped and made valid UTF-8, and Slurm's own field limits. Pure functions of what they are
given, but for the memo of the last scripts' fingerprints; nothing here logs or does I/O.

Why one file of ~490 lines: each module is one more file every site copies beside slurm.conf on
every controller (admin-guide.md, doctor's job_submit_files); this one holds what a job_desc becomes,
in one reading: the script's fingerprint, user text made valid, the job_desc reads into a snapshot,
the facts (RPC path) and the class key's facts (table path), then the check against Slurm's own
field limits (M.SLURM_FIELD_LIMITS, at the top).
]]

local M = {}

M.NO_VAL = 4294967294
-- The fingerprint reads at most FP_LIMIT bytes of the script (about 0.08 ms in Lua 5.1 on this
-- project's 2-core development box, whatever the script's size): all of a script up to that size; of a longer one its first
-- FP_HEAD bytes, its last FP_TAIL bytes and its length in decimal digits.
M.FP_LIMIT, M.FP_HEAD, M.FP_TAIL = 4096, 3072, 1024
M.FP_MOD1, M.FP_MUL1 = 2147483647, 31
M.FP_MOD2, M.FP_MUL2 = 2147483629, 131

-- Field lengths slurmctld refuses a job for, checked AFTER job_submit (job_mgr.c,
-- _test_job_desc_fields: "strlen(comment) too big (1025 > 1024)"), the same on 22.05, 24.11 and
-- 26.05. A job over one is never created: deciding it would record a decision no job holds, and
-- rewriting its GRES could make an over-long request one Slurm takes. So such a job passes as
-- typed and the service is not asked. (The table path checks only the fields it reads, those of
-- the class key: a job over a limit in another field, decided by the table, is refused by
-- slurmctld with what the table set, and no decision is recorded: the service records a table
-- decision from the job Slurm holds.) Every field of that check the Lua job_desc shows is listed,
-- not only those the plugin reads (PATH_MAX: 4096). The script's own limit is max_script_bytes.
M.SLURM_FIELD_LIMITS = {
  account = 1024, alloc_node = 1024, array_inx = 4096, burst_buffer = 8192, comment = 1024,
  cpus_per_tres = 1024, dependency = 131072, extra = 1024, features = 1024, licenses = 1024,
  mail_user = 1024, mcs_label = 1024, mem_per_tres = 1024, name = 1024, network = 1024, partition = 1024,
  prefer = 1024, qos = 1024, reservation = 1024, std_err = 4096, std_in = 4096, std_out = 4096,
  tres_bind = 1024, tres_freq = 1024, tres_per_job = 1024, tres_per_node = 1024, tres_per_socket = 1024,
  tres_per_task = 1024, wckey = 1024, work_dir = 4096,
}

local GRES_FIELDS = { "tres_per_node", "tres_per_job", "tres_per_task", "tres_per_socket" }
M.GRES_FIELDS = GRES_FIELDS

-- Same fingerprint as policy_service.core.request.script_fingerprint (doubles stay exact). Twelve
-- bytes at a time, read into locals (no table per chunk), and each hash reduced once per four
-- (h1) or three (h2) bytes rather than at every byte: the value is the same, since reducing at the
-- end of a chain of multiply-adds gives what reducing at each step gives, and every intermediate
-- stays below 2^53 (h1 < 2^31, times 31^4 = 923,521: < 2^51; h2 < 2^31, times 131^3 = 2,248,091:
-- < 2^53). About twice as fast as a byte at a time (bench/lua_table.py, distinct scripts).
local byte = string.byte
local function fp_update(h1, h2, s, i, n)
  local m1, k1, m2, k2 = M.FP_MOD1, M.FP_MUL1, M.FP_MOD2, M.FP_MUL2
  while i + 11 <= n do
    local a, b, c, d, e, f, g, h, x, y, z, w = byte(s, i, i + 11)
    h1 = ((((h1 * k1 + a) * k1 + b) * k1 + c) * k1 + d) % m1
    h1 = ((((h1 * k1 + e) * k1 + f) * k1 + g) * k1 + h) % m1
    h1 = ((((h1 * k1 + x) * k1 + y) * k1 + z) * k1 + w) % m1
    h2 = (((h2 * k2 + a) * k2 + b) * k2 + c) % m2
    h2 = (((h2 * k2 + d) * k2 + e) * k2 + f) % m2
    h2 = (((h2 * k2 + g) * k2 + h) * k2 + x) % m2
    h2 = (((h2 * k2 + y) * k2 + z) * k2 + w) % m2
    i = i + 12
  end
  while i <= n do
    local b = byte(s, i)
    h1 = (h1 * k1 + b) % m1
    h2 = (h2 * k2 + b) % m2
    i = i + 1
  end
  return h1, h2
end

-- The fingerprints of the last scripts seen: submissions of a few scripts in turn (sweeps and arrays
-- of several users) read each once. A script is a table key by identity (Lua interns strings: the
-- same text is the same string), so a lookup costs no hashing of its text. At most FP_MEMO_N
-- scripts and FP_MEMO_BYTES of their text are held; past either the memo starts over.
M.FP_MEMO_N, M.FP_MEMO_BYTES = 16, 4 * 1024 * 1024
local fp_memo, fp_memo_n, fp_memo_bytes = {}, 0, 0

function M.fingerprint(script)
  if script == nil or script == "" then return "" end
  local known = fp_memo[script]
  if known then return known end
  local n = #script
  local h1, h2
  if n <= M.FP_LIMIT then
    h1, h2 = fp_update(0, 0, script, 1, n)
  else
    h1, h2 = fp_update(0, 0, script, 1, M.FP_HEAD)
    h1, h2 = fp_update(h1, h2, script, n - M.FP_TAIL + 1, n)
    local len = tostring(n)
    h1, h2 = fp_update(h1, h2, len, 1, #len)
  end
  local fp = string.format("%08x%08x", h1, h2)
  if fp_memo_n >= M.FP_MEMO_N or fp_memo_bytes + n > M.FP_MEMO_BYTES then
    fp_memo, fp_memo_n, fp_memo_bytes = {}, 0, 0
  end
  if n <= M.FP_MEMO_BYTES then
    fp_memo[script], fp_memo_n, fp_memo_bytes = fp, fp_memo_n + 1, fp_memo_bytes + n
  end
  return fp
end

-- utf8_clean(s): s with each byte that is not part of a well-formed UTF-8 character replaced by
-- "?" (never longer than s). The service reads strict UTF-8 JSON: one stray byte in --comment
-- would otherwise cost the job its decision.
function M.utf8_clean(s)
  if not string.find(s, "[\128-\255]") then return s end
  local out, i, start, n = {}, 1, 1, #s
  while i <= n do
    local c = string.byte(s, i)
    local len = 0
    if c < 128 then len = 1
    elseif c >= 194 and c <= 223 then len = 2
    elseif c >= 224 and c <= 239 then len = 3
    elseif c >= 240 and c <= 244 then len = 4 end
    local ok = len > 0 and i + len - 1 <= n
    if ok and len > 1 then
      local lo, hi = 128, 191   -- the second byte's range excludes overlongs and surrogates
      if c == 224 then lo = 160 elseif c == 237 then hi = 159 elseif c == 240 then lo = 144 elseif c == 244 then hi = 143 end
      local c2 = string.byte(s, i + 1)
      ok = c2 >= lo and c2 <= hi
      for k = 2, len - 1 do
        if ok then
          local ck = string.byte(s, i + k)
          ok = ck >= 128 and ck <= 191
        end
      end
    end
    if ok then
      i = i + len
    else
      out[#out + 1] = string.sub(s, start, i - 1)
      out[#out + 1] = "?"
      i = i + 1
      start = i
    end
  end
  out[#out + 1] = string.sub(s, start)
  return table.concat(out)
end

function M.str(v)
  if v == nil then return "" end
  return tostring(v)
end
local str = M.str

-- The strings lately seen to be plain ASCII of at most CLEAN_BYTES (text() gives them back as
-- they are up to its cap; all are under Slurm's limits), looked up by the interned string: no scan
-- of a value the plugin has seen. At most CLEAN_N; past it the memo starts over (emptied in place:
-- the limit check holds it too).
local CLEAN_N, CLEAN_BYTES = 256, 1024
local clean, clean_n = {}, 0
local find = string.find

-- text(v, n): a user-typed field as the service takes it: at most n bytes, valid UTF-8.
local function text(v, n)
  if v == nil then return "" end
  if clean[v] and #v <= n then return v end
  if type(v) ~= "string" then v = tostring(v) end
  if #v > n then return M.utf8_clean(M.cap(v, n)) end
  if find(v, "[\128-\255]") then return M.utf8_clean(v) end
  if #v <= CLEAN_BYTES then
    if clean_n >= CLEAN_N then
      for k in pairs(clean) do clean[k] = nil end
      clean_n = 0
    end
    clean[v], clean_n = true, clean_n + 1
  end
  return v
end

-- cap(s, n): at most n bytes of s, never ending inside a UTF-8 character. The service refuses
-- longer fields (policy_service/trust/limits.py); a field Slurm itself takes must not leave a job
-- undecided (those over Slurm's own limits never get here: M.over_slurm_limit).
function M.cap(s, n)
  if #s <= n then return s end
  s = string.sub(s, 1, n)
  local last = string.byte(s, -1)
  if last and last >= 128 then
    s = string.gsub(s, "[\128-\191]*$", "")   -- continuation bytes of a cut character
    local lead = string.byte(s, -1)
    if lead and lead >= 192 then s = string.sub(s, 1, -2) end   -- and its lead byte
  end
  return s
end

local floor = math.floor
local function num(v)
  v = tonumber(v)
  if v == nil or v < 0 or v >= M.NO_VAL then return 0 end
  return floor(v)
end

local function env_value(env, name)
  if type(env) ~= "table" then return "" end
  local v = env[name]      -- (one lookup: in slurmctld each is a call that scans the job's environment)
  if v ~= nil then return str(v) end
  if next(env) == nil then return "" end   -- slurmctld's: an empty table behind that lookup
  for _, entry in pairs(env) do
    if type(entry) == "string" then
      local k, v = string.match(entry, "^([^=]+)=(.*)$")
      if k == name then return v end
    end
  end
  return ""
end

-- num16(v): a 16-bit job_desc number (--ntasks-per-gpu), 0 when unset (NO_VAL16 = 65534 and up).
local function num16(v)
  v = tonumber(v)
  if v == nil or v < 0 or v >= 65534 then return 0 end
  return math.floor(v)
end

-- exclusive(shared): --exclusive as job_desc.shared holds it ("node", "user", "mcs", or the number
-- of a value not named here); "" for unset (NO_VAL16) and --oversubscribe (1).
local EXCLUSIVE = { [0] = "node", [2] = "user", [3] = "mcs" }
function M.exclusive(shared)
  shared = tonumber(shared)
  if shared == nil or shared == 1 or shared >= 65534 then return "" end
  return EXCLUSIVE[shared] or tostring(math.floor(shared))
end

-- het_job_offset: NO_VAL for a plain job, 0, 1, ... for the components of a heterogeneous job.
function M.het_component(offset)
  offset = tonumber(offset)
  return offset ~= nil and offset >= 0 and offset < M.NO_VAL
end

function M.wants_gpu(job_desc)
  for i = 1, #GRES_FIELDS do
    local v = job_desc[GRES_FIELDS[i]]
    if v ~= nil and find(tostring(v), "gpu", 1, true) then return true end
  end
  return false
end

-- The job_desc fields the class key (swapaware_table.lua T.key) is made of, besides the GRES fields:
-- all the table path reads. (Those M.facts reads for the RPC path alone, user_id and work_dir, and
-- those only the limit check reads are read once the table has not decided the job: a job over one
-- of their limits is refused by slurmctld after job_submit, what the table set going with it, and
-- a table decision is recorded only from the job Slurm holds.)
local KEY_READS = { "user_name", "account", "partition", "name", "script", "comment",
  "environment", "min_nodes", "num_tasks", "het_job_offset", "qos", "cpus_per_tres", "mem_per_tres",
  "ntasks_per_tres", "tres_bind", "tres_freq", "shared" }
-- The other job_desc fields M.facts reads. The time limit is no part of the class key: no decision
-- reads it (the differential test holds the table to Admit with jobs that differ in it alone), and
-- the service records a table-made job with its own TimeLimit from Slurm (admission/catchup.py).
local FACT_ONLY = { "user_id", "work_dir", "time_limit" }
local function index(t, k) return t[k] end

local function read_plain(job_desc, fields, into)
  for i = 1, #fields do
    local f = fields[i]
    into[f] = job_desc[f]
  end
  return into
end

-- read_fields(job_desc, fields, into): into[f] = job_desc[f] for each f of the list (nil ones too:
-- what a job did not set never stays from the job before). No read raises in slurmctld (its
-- job_desc gives nil for a field it does not know): one pcall for all; should one raise, each is
-- read under a pcall of its own and one that raises is nil.
function M.read_fields(job_desc, fields, into)
  if pcall(read_plain, job_desc, fields, into) then return into end
  for i = 1, #fields do
    local ok, v = pcall(index, job_desc, fields[i])
    if ok then into[fields[i]] = v else into[fields[i]] = nil end
  end
  return into
end
local read_fields = M.read_fields
-- REST_READS: every field the RPC path and the limit check read that the table path does not.
local REST_READS = {}
do
  local read = {}
  for _, list in ipairs({ GRES_FIELDS, KEY_READS }) do
    for _, f in ipairs(list) do read[f] = true end
  end
  for _, f in ipairs(FACT_ONLY) do
    REST_READS[#REST_READS + 1] = f
    read[f] = true
  end
  local limit_only = {}
  for field in pairs(M.SLURM_FIELD_LIMITS) do
    if not read[field] then limit_only[#limit_only + 1] = field end
  end
  table.sort(limit_only)
  for _, f in ipairs(limit_only) do REST_READS[#REST_READS + 1] = f end
end
M.KEY_READS, M.REST_READS = KEY_READS, REST_READS

-- snapshot(job_desc, s, part): a plain table of the job_desc fields the plugin reads, each read once
-- (``s``: the GRES fields already read; ``part``: "key" for those of the class key alone, "rest" for
-- the others, nil for all). slurmctld's job_desc is a table whose every read calls into slurmctld (a
-- chain of string compares over the field names, then a new Lua string; getpwuid for user_name on
-- older releases, two tables for environment), under the Lua mutex and the job write lock: reading
-- each field where it was used read the script three times and the GRES and limit fields twice.
function M.snapshot(job_desc, s, part)
  s = s or read_fields(job_desc, GRES_FIELDS, M.new_snapshot())
  if part ~= "rest" then read_fields(job_desc, KEY_READS, s) end
  if part ~= "key" then read_fields(job_desc, REST_READS, s) end
  return s
end

-- new_snapshot(): an empty table sized for the fields the table path reads (a constructor naming
-- them: filling it never rehashes; 32 slots, 1.3 KB: sized for every field, 64 slots, it doubled
-- what a table hit allocates). A job the table has not decided grows it once for the rest.
do
  local names = {}
  for _, list in ipairs({ GRES_FIELDS, KEY_READS }) do
    for _, f in ipairs(list) do names[#names + 1] = f .. " = nil" end
  end
  M.new_snapshot = assert(loadstring("return function() return { " .. table.concat(names, ", ") .. " } end"))()
  -- clear_snapshot(s): s with every field a snapshot holds set to nil (its slots kept: the plugin
  -- fills one table per Lua state again for each job)
  local clear = {}
  for _, list in ipairs({ GRES_FIELDS, KEY_READS, REST_READS }) do
    for _, f in ipairs(list) do clear[#clear + 1] = "s." .. f .. " = nil" end
  end
  M.clear_snapshot = assert(loadstring("return function(s) " .. table.concat(clear, "; ") .. "; return s end"))()
end

-- script_binds_gpus(script): the batch script names a GPU binding for its steps (--gpu-bind,
-- --tres-bind, or SLURM_GPU_BIND / SLURM_TRES_BIND set in it). A step that holds shards gets no
-- CUDA_VISIBLE_DEVICES under any GPU binding, and cli_filter cannot take a --gpu-bind away (srun
-- refuses an empty one): measured on 22.05 and 26.05. Such a job keeps its GPU request. A function
-- of the script alone, so of its fingerprint (the admission table's key).
function M.script_binds_gpus(script)
  if type(script) ~= "string" then return false end
  return string.find(script, "gpu-bind", 1, true) ~= nil or string.find(script, "tres-bind", 1, true) ~= nil
    or string.find(script, "GPU_BIND", 1, true) ~= nil or string.find(script, "TRES_BIND", 1, true) ~= nil
end

-- env_hint(job_desc): SWAPAWARE_GPU_MEM of the job's environment as it is there, "" without one.
-- Looked up once per environment table (slurmctld makes one at each read of the field, and the
-- snapshot reads it once per job): the table path and then the RPC path of one job look it up once.
local hint_env, hint_value = nil, nil
local function hint_of(env)
  if env ~= hint_env or env == nil then
    hint_env, hint_value = env, env_value(env, "SWAPAWARE_GPU_MEM")
  end
  return hint_value
end
function M.env_hint(job_desc)
  local ok, env = pcall(index, job_desc, "environment")
  return ok and hint_of(env) or ""
end

-- facts(job_desc, submit_uid, into, key_only, hint): the facts of a job_desc (or of its snapshot),
-- into ``into`` (every field assigned: the plugin keeps one table per Lua state, so a table hit
-- allocates none) or a new table. ``key_only``: those of the class key (swapaware_table.lua
-- T.KEY_FIELDS) alone, what the table path reads; uid, workDir, timeLimitMin and stepGpuBind (a function of the
-- script, so of its fingerprint: four searches of the whole script) are left nil. ``hint``:
-- M.env_hint(job_desc) where the caller has it (the environment looked up once).
function M.facts(job_desc, submit_uid, into, key_only, hint)
  local out = into or {}
  if key_only then
    out.uid, out.workDir, out.stepGpuBind, out.timeLimitMin = nil, nil, nil, nil
  else
    out.uid = num(submit_uid or job_desc.user_id)
    out.workDir = text(job_desc.work_dir, 4096)
    out.timeLimitMin = num(job_desc.time_limit)
    out.stepGpuBind = M.script_binds_gpus(job_desc.script)
  end
  out.user = text(job_desc.user_name, 1024)
  out.account = text(job_desc.account, 1024)
  out.partition = text(job_desc.partition, 1024)
  out.jobName = text(job_desc.name, 1024)
  out.tresPerNode = text(job_desc.tres_per_node, 1024)
  out.tresPerJob = text(job_desc.tres_per_job, 1024)
  out.tresPerTask = text(job_desc.tres_per_task, 1024)
  out.tresPerSocket = text(job_desc.tres_per_socket, 1024)
  out.scriptFingerprint = M.fingerprint(job_desc.script)
  out.comment = text(job_desc.comment, 4096)
  out.envMemHint = text(hint or M.env_hint(job_desc), 64)
  out.minNodes = num(job_desc.min_nodes)
  out.numTasks = num(job_desc.num_tasks)
  out.isBatch = job_desc.script ~= nil
  out.hetJob = M.het_component(job_desc.het_job_offset)
  out.qos = text(job_desc.qos, 1024)
  out.cpusPerTres = text(job_desc.cpus_per_tres, 1024)
  out.memPerTres = text(job_desc.mem_per_tres, 1024)
  out.ntasksPerTres = num16(job_desc.ntasks_per_tres)
  out.tresBind = text(job_desc.tres_bind, 1024)
  out.tresFreq = text(job_desc.tres_freq, 1024)
  out.exclusive = M.exclusive(job_desc.shared)
  return out
end

-- Key facts remembered by what they are made of -------------------------------------------
-- The table path decides bursts of a few classes (arrays, sweeps, users' runs in turn): a job whose
-- key part of the snapshot (GRES_FIELDS and KEY_READS; of environment, SWAPAWARE_GPU_MEM) is that
-- of a job seen lately gets that job's facts and key, made again by nothing. Remembered by job
-- name, in a ring of KEY_MEMO_N entries filled again in place (no garbage once full); a script over
-- KEY_MEMO_SCRIPT bytes is never held (the fingerprint's memo bounds what it holds).
M.KEY_MEMO_N, M.KEY_MEMO_SCRIPT = 32, 65536
local NONAME = {}
local ring, ring_at, by_name, unkept = {}, 0, {}, {}
local same_key, copy_key
do
  local eq, set = {}, {}
  for _, list in ipairs({ GRES_FIELDS, KEY_READS }) do
    for _, f in ipairs(list) do
      if f ~= "environment" then
        eq[#eq + 1] = string.format("s[%q] == r[%q]", f, f)
        set[#set + 1] = string.format("r[%q] = s[%q]", f, f)
      end
    end
  end
  same_key = assert(loadstring("return function(s, r) return " .. table.concat(eq, " and ") .. " end"))()
  copy_key = assert(loadstring("return function(s, r) " .. table.concat(set, "; ") .. " end"))()
end

-- key_facts(s, submit_uid, key_of): the class key's facts of snapshot s (M.facts(..., true)) and
-- key_of(facts), remembered as above. The facts are the memo's own: read them, never change them.
function M.key_facts(s, submit_uid, key_of)
  local name = s.name
  if name == nil then name = NONAME end
  local hint, e = hint_of(s.environment), by_name[name]     -- (s: a snapshot, a plain table)
  if e and e.key ~= nil and e.key_of == key_of and e.hint == hint and same_key(s, e.raw) then
    return e.facts, e.key
  end
  local script = s.script
  if type(script) == "string" and #script > M.KEY_MEMO_SCRIPT then
    local facts = M.facts(s, submit_uid, unkept, true, hint)
    return facts, key_of(facts)
  end
  if e == nil then
    ring_at = ring_at % M.KEY_MEMO_N + 1
    e = ring[ring_at]
    if e then by_name[e.name] = nil else e = { raw = {}, facts = {} }; ring[ring_at] = e end
    e.name, by_name[name] = name, e
  end
  e.key = nil       -- (should key_of raise, the entry matches no job)
  copy_key(s, e.raw)
  e.hint, e.key_of = hint, key_of
  M.facts(s, submit_uid, e.facts, true, hint)
  e.key = key_of(e.facts)
  return e.facts, e.key
end

-- The fields of Slurm's limit check, sorted, per part of the snapshot (M.snapshot's ``part``): a
-- check after each part reads only what that part added, and names the same field every time
-- (pairs() over the limits would give the order of the hash).
local LIMITED = { key = {}, rest = {}, all = {} }
do
  local in_key = {}
  for _, list in ipairs({ GRES_FIELDS, KEY_READS }) do
    for _, f in ipairs(list) do in_key[f] = true end
  end
  for field in pairs(M.SLURM_FIELD_LIMITS) do
    local part = LIMITED[in_key[field] and "key" or "rest"]
    part[#part + 1] = field
    LIMITED.all[#LIMITED.all + 1] = field
  end
  for _, list in pairs(LIMITED) do table.sort(list) end
end
M.LIMITED = LIMITED

-- over_slurm_limit(fields, part): the first field (by name) slurmctld will refuse the job for, its
-- size and limit, of the job's fields as M.snapshot read them; ``part``: "key" or "rest" checks
-- only the fields of that part, nil all of them.
-- (one generated function per part: a statement per field, a type check only for a field set and
-- not one text() has seen clean: those are strings of at most CLEAN_BYTES, under every limit)
local over = {}
for part, list in pairs(LIMITED) do
  local body = {}
  for i, f in ipairs(list) do
    local limit = M.SLURM_FIELD_LIMITS[f]
    assert(limit >= CLEAN_BYTES)
    body[i] = string.format("v = s[%q]; if v ~= nil and not clean[v] and type(v) == 'string' and #v > %d then " ..
                            "return %q, #v, %d end", f, limit, f, limit)
  end
  over[part] = assert(loadstring("local clean = ...; return function(s) local v; " .. table.concat(body, "; ") ..
                                 " end"))(clean)
end
function M.over_slurm_limit(fields, part)
  return over[part or "all"](fields)
end

return M
