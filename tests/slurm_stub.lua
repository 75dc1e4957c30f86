-- The `slurm` table slurmctld gives job_submit.lua, for the test drivers (tests/adapter/lua_driver.lua,
-- tests/unit/lua_table_driver.lua): what the plugin logs is kept in S.logs, what it tells the user
-- in S.user.  usage: local S = dofile(<tests dir> .. "/slurm_stub.lua")
local S = { logs = {}, user = {} }
slurm = {
  SUCCESS = 0, ERROR = -1,
  log_info = function(fmt, ...) table.insert(S.logs, "info: " .. string.format(fmt, ...)) end,
  log_error = function(fmt, ...) table.insert(S.logs, "error: " .. string.format(fmt, ...)) end,
  log_user = function(fmt, ...) table.insert(S.user, string.format(fmt, ...)) end,
}
return S
