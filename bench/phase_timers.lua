-- The phases of a table hit, timed where the plugin calls them: wraps the module functions the
-- plugin calls through its module tables (so the code timed is the code that runs).
--   gres   swapaware_facts.read_fields (the 4 GRES fields: is it a GPU job at all?)
--   key    swapaware_facts.snapshot(..., "key"): the other fields of the class key
--   facts  swapaware_facts.key_facts (a tree from before it: .facts)
--   table  swapaware_table.decide
-- usage: local sums, restore = dofile("phase_timers.lua")(F, T, clock[, on_decide])
--   sums: seconds per phase, added to at each call; restore(): the modules as they were;
--   on_decide(hit): called with each decide's result (e.g. to count hits).
return function(F, T, clock, on_decide)
  local sums, saved = { gres = 0, key = 0, facts = 0, table = 0 }, {}
  local function timed(mod, name, phase, when, after)
    local inner = mod[name]
    saved[#saved + 1] = { mod, name, inner }
    mod[name] = function(...)
      if when and not when(...) then return inner(...) end
      local t0 = clock()
      local r1, r2, r3 = inner(...)
      sums[phase] = sums[phase] + (clock() - t0)
      if after then after(r1) end
      return r1, r2, r3
    end
  end
  timed(F, "read_fields", "gres")
  timed(F, "snapshot", "key", function(_, _, part) return part == "key" end)
  timed(F, F.key_facts and "key_facts" or "facts", "facts")
  timed(T, "decide", "table", nil, on_decide)
  local function restore()
    for i = #saved, 1, -1 do saved[i][1][saved[i][2]] = saved[i][3] end
  end
  return sums, restore
end
