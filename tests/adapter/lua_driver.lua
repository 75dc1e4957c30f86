-- Test driver: load slurm_plugin/swapaware.lua as slurmctld would and run job_descs through it.
-- usage: lua5.1 lua_driver.lua <plugin_dir> <settings_dir>   (stdin: JSON list of job_desc tables)
package.path = arg[1] .. "/?.lua;" .. package.path
local cjson = require("cjson")
local socket = require("socket")
local S = dofile(string.match(debug.getinfo(1, "S").source, "^@(.*)/[^/]*$") .. "/../slurm_stub.lua")
local M = require("swapaware")
M.load_settings(arg[2])
local jobs = cjson.decode(io.read("*a"))
-- Bytes that are not UTF-8 travel as {"hex": "..."} both ways (JSON strings cannot hold them).
local function unhex(h) return (string.gsub(h, "..", function(x) return string.char(tonumber(x, 16)) end)) end
local function hex(s) return (string.gsub(s, ".", function(c) return string.format("%02x", string.byte(c)) end)) end
local results = {}
for i, jd in ipairs(jobs) do
  if jd.stale_error ~= nil then         -- M.stale on an error text
    results[i] = { stale = M.stale(jd.stale_error) }
  elseif jd.clean_hex ~= nil then       -- M.utf8_clean on bytes
    results[i] = { cleaned_hex = hex(M.utf8_clean(unhex(jd.clean_hex))) }
  else
    local binary = {}
    for k, v in pairs(jd) do
      if type(v) == "table" and v.hex ~= nil then jd[k] = unhex(v.hex); binary[k] = true end
    end
    local facts = M.facts(jd, 1000)
    local t0 = socket.gettime()
    local rc = M.submit(jd, {}, 1000)
    local elapsed = socket.gettime() - t0
    local fp = M.fingerprint(jd.script)
    for k in pairs(binary) do jd[k] = { hex = hex(jd[k]) } end
    results[i] = { rc = rc, job = jd, elapsed_s = elapsed, fingerprint = fp, facts = facts }
  end
end
io.write(cjson.encode({ results = results, logs = S.logs, user = S.user }))
