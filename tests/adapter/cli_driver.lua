-- Test driver: slurm_plugin/swapaware_cli.lua as srun's cli_filter/lua runs it.
-- usage: lua5.1 cli_driver.lua <plugin_dir>   (stdin: JSON list of {options=..., env=...})
-- The options object behaves as Slurm's: reads give the option's string (nil when unset), and
-- assignments take strings only (Slurm's setter calls luaL_checkstring: nil raises).
package.path = arg[1] .. "/?.lua;" .. package.path
local cjson = require("cjson")
local verbose = {}
slurm = {
  SUCCESS = 0,
  log_verbose = function(fmt, ...) table.insert(verbose, string.format(fmt, ...)) end,
}
local M = require("swapaware_cli")

local function options_of(values)
  local store = {}
  for k, v in pairs(values) do store[k] = v end
  return setmetatable({}, {
    __index = function(_, k) return store[k] end,
    __newindex = function(_, k, v)
      if type(v) ~= "string" then error("bad argument #3 (string expected, got " .. type(v) .. ")") end
      store[k] = v
    end,
  }), store
end

local results = {}
for i, case in ipairs(cjson.decode(io.read("*a"))) do
  local options, store = options_of(case.options)
  local env = case.env
  local mended = M.mend_step(options, function(name) return env[name] end)
  local marked = M.mark_test_only(options)
  results[i] = { mended = mended, marked = marked, options = store }
end
io.write(cjson.encode({ results = results, verbose = verbose }))
