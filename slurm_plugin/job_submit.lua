--[[
job_submit.lua for JobSubmitPlugins=lua: swapaware's GPU admission.
Install beside slurm.conf together with swapaware.lua, swapaware_facts.lua, swapaware_table.lua
and swapaware_plugin.conf.
A site that already has a job_submit.lua keeps its own and calls swapaware.submit() from it
(see swapaware.lua).
]]

local function script_dir()
  local src = debug.getinfo(1, "S").source
  local dir = string.match(src, "^@(.*)/[^/]*$")
  return dir or "/etc/slurm"
end

local dir = script_dir()
package.path = dir .. "/?.lua;" .. package.path
local swapaware = require("swapaware")
swapaware.load_settings(dir)

function slurm_job_submit(job_desc, part_list, submit_uid)
  return swapaware.submit(job_desc, part_list, submit_uid)
end

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
  return slurm.SUCCESS
end

return slurm.SUCCESS
