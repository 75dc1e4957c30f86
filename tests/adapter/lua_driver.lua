-- Test driver: load slurm_plugin/swapaware.lua as slurmctld would and run job_descs through it.
-- usage: lua5.1 lua_driver.lua <plugin_dir> <settings_dir>   (stdin: JSON list of job_desc tables)
package.path = arg[1] .. "/?.lua;" .. package.path
local cjson = require("cjson")
local socket = require("socket")
local logs, user = {}, {}
slurm = {
  SUCCESS = 0, ERROR = -1,
  log_info = function(fmt, ...) table.insert(logs, "info: " .. string.format(fmt, ...)) end,
  log_error = function(fmt, ...) table.insert(logs, "error: " .. string.format(fmt, ...)) end,
  log_user = function(fmt, ...) table.insert(user, string.format(fmt, ...)) end,
}
local M = require("swapaware")
M.load_settings(arg[2])
local jobs = cjson.decode(io.read("*a"))
local results = {}
for i, jd in ipairs(jobs) do
  local t0 = socket.gettime()
  local rc = M.submit(jd, {}, 1000)
  results[i] = { rc = rc, job = jd, elapsed_s = socket.gettime() - t0, fingerprint = M.fingerprint(jd.script) }
end
io.write(cjson.encode({ results = results, logs = logs, user = user }))
