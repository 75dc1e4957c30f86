"""Where a table hit's time goes inside slurmctld: the plugin's table path timed phase by phase
on the real dev cluster, so that an admin (or a faster controller) can see which part of the
job_submit call to work on.

job_submit.lua here loads swapaware as slurmctld does, then wraps four functions of its modules
with a clock (lua-socket's gettime; two reads per call): the plugin calls them through the module
tables, so the code timed is the code that runs.
  gres   swapaware_facts.read_fields of the 4 GRES fields (is it a GPU job at all?)
  key    swapaware_facts.snapshot(..., "key"): the other fields of the class key, each read once
         from slurmctld's job_desc (every read calls into slurmctld)
  facts  swapaware_facts.key_facts (a tree from before it: swapaware_facts.facts): the class key's
         facts of the snapshot (script fingerprint, text caps) and the key, made again only for a
         job unlike those seen lately
  table  swapaware_table.decide: the table's freshness check, the lookup, the gate state, the
         decision id and the assignments to job_desc (the key too, in a tree before key_facts)
  rest   the whole swapaware.submit less those four (the limit check, the pcalls; in a tree
         before key_facts, the snapshot's clearing)
The sums are logged every 16 calls to slurmctld.log. Blocks of --jobs sbatch from 1 and from 8
submitters (--submitters), interleaved over --rounds: whether the Lua time grows with concurrent
submissions (contention on slurmctld's locks) or not. The same job classes as submit_burst.py,
put in the table first by one round trip each.

    SWAPAWARE_DEV_TABLE=1 bash contrib/dev-stack.sh up
    .venv/bin/python bench/lua_phases.py [--jobs 400 --rounds 3 --submitters 1,8]

Compare with the same phases in lua5.1 alone: bench/lua_table.py (its "as inside slurmctld" line:
a fake job_desc whose reads and writes are calls, split into these phases).
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from submit_burst import NAMES, settle, stack_env, submit  # noqa: E402
from submit_overhead import set_mode  # noqa: E402
from table_mode import BATCH, ctld_log, log_size, plugin_files, set_table, table_on, warm  # noqa: E402

PHASES = ("gres", "key", "facts", "table")
TIMERS = Path(__file__).with_name("phase_timers.lua")  # the phases' timing, shared with the lua5.1 bench's driver
PHASES_RE = re.compile(r"swapaware-phases reads_in_total=(\d+) n=(\d+) hits=(\d+) total=([0-9.]+) hit_total=([0-9.]+) " +
                       " ".join(f"{p}=([0-9.]+)" for p in PHASES) + r" clock=([0-9.]+) reads=([0-9.]+) fields=(\d+)")
PHASES_LUA = """
local function script_dir()
  return string.match(debug.getinfo(1, "S").source, "^@(.*)/[^/]*$") or "/etc/slurm"
end
local dir = script_dir()
package.path = dir .. "/?.lua;" .. package.path
local swapaware = require("swapaware")
swapaware.load_settings(dir)
local F, T = require("swapaware_facts"), require("swapaware_table")
local clock
if "CLOCK" == "cpu" then  -- the calling thread's CPU time: what slurmctld spends, whatever else runs
  local ptime = require("posix.time")
  local gettime, id = ptime.clock_gettime, ptime.CLOCK_THREAD_CPUTIME_ID
  clock = function() local t = gettime(id) return t.tv_sec + t.tv_nsec * 1e-9 end
else
  clock = require("socket").gettime
end
local clock_read_us  -- what one clock read costs here (the report takes the reads inside each interval out)
do
  local t0 = clock()
  for _ = 1, 2000 do clock() end
  clock_read_us = (clock() - t0) / 2001 * 1e6
end
local n, hits, total, hit_total = 0, 0, 0, 0
local phased = "PHASED" == "phases"   -- false: --whole, swapaware.submit timed alone (no wrappers)
local sums = { gres = 0, key = 0, facts = 0, table = 0 }
if phased then
  sums = dofile(dir .. "/PHASE_TIMERS")(F, T, clock, function(hit) if hit then hits = hits + 1 end end)
end

-- Slurm's own part: the fields the plugin reads of job_desc (learnt from the first job through a
-- recording proxy), each read once more after the plugin ran, timed apart from it
local fields, reads = nil, 0

function slurm_job_submit(job_desc, part_list, submit_uid)
  local jd, seen = job_desc, nil
  if fields == nil then
    seen = {}
    jd = setmetatable({}, {
      __index = function(_, k) if seen[k] == nil then seen[k] = #seen + 1; seen[#seen + 1] = k end return job_desc[k] end,
      __newindex = function(_, k, v) job_desc[k] = v end })
  end
  local hits_before = hits
  local t0 = clock()
  local rc = swapaware.submit(jd, part_list, submit_uid)
  local took = clock() - t0
  total = total + took
  if not phased then  -- a table hit's AdminComment holds tbl= (read after the timed call)
    local ac = job_desc.admin_comment
    if ac and string.find(ac, "tbl=", 1, true) then hits = hits + 1 end
  end
  if hits > hits_before then hit_total = hit_total + took end
  if seen then
    fields = { unpack(seen) }
  else
    t0 = clock()
    for i = 1, #fields do local _ = job_desc[fields[i]] end
    reads = reads + (clock() - t0)
  end
  n = n + 1
  if n == BATCH then
    slurm.log_info("swapaware-phases reads_in_total=%d n=%d hits=%d total=%.1f hit_total=%.1f gres=%.1f key=%.1f facts=%.1f "
                   .. "table=%.1f clock=%.3f reads=%.1f fields=%d", phased and 9 or 1, n, hits, total * 1e6, hit_total * 1e6,
                   sums.gres * 1e6, sums.key * 1e6, sums.facts * 1e6,
                   sums.table * 1e6, clock_read_us, reads * 1e6, #fields)
    n, hits, total, hit_total, reads = 0, 0, 0, 0, 0
    for k in pairs(sums) do sums[k] = 0 end
  end
  return rc
end

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
  return slurm.SUCCESS
end

return slurm.SUCCESS
"""
# clock reads inside each interval: one per phase (its second read); in the total, as logged: nine
# with the phases timed (its own second read and the four phases' two each), one with --whole
READS = {**dict.fromkeys(PHASES, 1), "reads": 1}


def phases_dir(dst: Path, clock: str = "cpu", phased: bool = True) -> Path:
    """The tree's plugin files with the phase-timing job_submit.lua (``clock``: "cpu", the thread's
    CPU time, or "wall"; ``phased`` False: swapaware.submit timed whole, its phases not wrapped)."""
    dst.mkdir(parents=True, exist_ok=True)
    lua = (PHASES_LUA.replace("BATCH", str(BATCH)).replace('"CLOCK"', f'"{clock}"')
           .replace('"PHASED"', '"phases"' if phased else '"whole"')
           .replace("PHASE_TIMERS", TIMERS.name))
    for name, text in plugin_files().items():
        (dst / name).write_text(lua if name == "job_submit.lua" else text)
    (dst / TIMERS.name).write_text(TIMERS.read_text())  # beside job_submit.lua, where slurmctld runs it
    return dst


def parse_phases(text: str) -> dict[str, float]:
    """Summed calls, hits and microseconds per phase of the lines logged in ``text``, less the clock
    reads inside each interval (the cost of one read as the Lua state measured it at load)."""
    out = dict.fromkeys(("n", "hits", "total", "hit_total", *PHASES, "reads", "clock_us", "fields"), 0.0)
    for m in PHASES_RE.finditer(text):
        in_total, *sums, clock_us, reads, fields = m.groups()
        for name, value in zip(("n", "hits", "total", "hit_total", *PHASES, "reads"), (*sums, reads)):
            out[name] += float(value)
        out["fields"] = max(out["fields"], float(fields))
        for name, count in {**READS, "total": int(in_total)}.items():
            out[name] -= count * float(clock_us) * float(sums[0])
        out["hit_total"] -= int(in_total) * float(clock_us) * float(sums[1])
        out["clock_us"] = max(out["clock_us"], float(clock_us))
    return out


def logged_since(env: dict[str, str], offset: int) -> str:
    with open(ctld_log(env), "rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


def block(env: dict[str, str], tag: str, n: int, submitters: int) -> tuple[dict[str, float], int]:
    settle(env)
    at = log_size(env)
    with ThreadPoolExecutor(submitters) as pool:
        errors = [e for _, e in pool.map(lambda i: submit(env, tag, i), range(n)) if e]
    subprocess.run(["scancel", "--user=root", "--state=PENDING"], env=env, timeout=300)
    return parse_phases(logged_since(env, at)), len(errors)


def report(stats: dict[int, dict[str, float]], errors: dict[int, int], clock: str, clock_us: float) -> None:
    print(f"{'submitters':>10s} {'jobs':>6s} {'hits':>6s} {'total us':>9s} {'a hit us':>9s} " +
          " ".join(f"{p + ' us':>9s}" for p in (*PHASES, "rest")) + f" {'errors':>7s} {'Slurm reads us':>15s}")
    for s, st in stats.items():
        n = st["n"] or float("nan")
        rest = st["total"] - sum(st[p] for p in PHASES)
        print(f"{s:10d} {st['n']:6.0f} {st['hits']:6.0f} {st['total'] / n:9.1f} "
              f"{st['hit_total'] / (st['hits'] or float('nan')):9.1f} " +
              " ".join(f"{st[p] / n:9.1f}" for p in PHASES) + f" {rest / n:9.1f} {errors[s]:7d} {st['reads'] / n:15.1f}")
    fields = max(st["fields"] for st in stats.values())
    print("per job, inside slurmctld: the plugin's swapaware.submit and the four phases of its table path, "
          + ("the thread's CPU time (CLOCK_THREAD_CPUTIME_ID)" if clock == "cpu" else "wall-clock time")
          + f", less the clock reads inside each (one read {clock_us:.2f} us, measured in slurmctld's Lua state); "
          f"a hit = total over the jobs the table decided alone; rest = total less the four; Slurm reads = the {fields:.0f} job_desc fields the plugin reads, each read once "
          "more after it ran (Slurm's accessors alone: what any plugin reading them pays)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=400, help="sbatch per block")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--submitters", default="1,8", help="comma-separated: one block per value per round")
    ap.add_argument("--whole", action="store_true",
                    help="time swapaware.submit alone, its phases not wrapped (their clock reads, cold in slurmctld, "
                         "cost more than the hot read taken out; hits counted from the AdminComment)")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                    help="cpu: the slurmctld thread's CPU time (holds still on a busy machine); wall: lua-socket's clock")
    args = ap.parse_args()
    counts = [int(x) for x in args.submitters.split(",") if x.strip()]
    env = stack_env()
    was_table = table_on(env)
    tag = f"phases{int(time.time()) % 100000}"
    stats = {s: dict.fromkeys(("n", "hits", "total", "hit_total", *PHASES, "reads", "fields"), 0.0) for s in counts}
    errors = dict.fromkeys(counts, 0)
    clock_us = 0.0
    try:
        with tempfile.TemporaryDirectory() as d:
            lua = phases_dir(Path(d) / "phases", args.clock, not args.whole)
            set_table(env, False)             # the classes' first decisions: one round trip each
            set_mode("on", env, lua)
            took = warm(env, [f"{tag}-{k}" for k in range(NAMES)])
            print(f"table warm: the published table held the {NAMES} job classes {took:.1f} s after their "
                  "round-trip decisions", file=sys.stderr)
            set_table(env, True)
            set_mode("on", env, lua)          # slurmctld restarted: a new Lua state reading table=
            block(env, tag, max(counts) * BATCH, max(counts))   # warm-up, not counted
            for r in range(args.rounds):
                for s in (counts if r % 2 == 0 else list(reversed(counts))):
                    got, errs = block(env, tag, args.jobs, s)
                    clock_us = max(clock_us, got.pop("clock_us"))
                    stats[s]["fields"] = max(stats[s]["fields"], got.pop("fields"))
                    for k, v in got.items():
                        stats[s][k] += v
                    errors[s] += errs
                    per = got["total"] / got["n"] if got["n"] else float("nan")
                    per_hit = got["hit_total"] / got["hits"] if got["hits"] else float("nan")
                    print(f"round {r + 1}/{args.rounds}, {s} submitters: {got['n']:.0f} jobs logged, "
                          f"{got['hits']:.0f} by the table, {per:.1f} us/job ({per_hit:.1f} a hit)", file=sys.stderr)
    finally:
        set_table(env, was_table)
        set_mode("on", env)
    report(stats, errors, args.clock, clock_us)


if __name__ == "__main__":
    main()
