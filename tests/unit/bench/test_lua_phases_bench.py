"""bench/lua_phases.py's job_submit.lua, run by the real Lua 5.1 with the real plugin and a published
table: it must time the plugin's own table path (each phase of a hit measured, the misses not
counted as hits) and leave every job as the plugin alone leaves it."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.unit.plugin.test_lua_table import ROOT, decision, expected, gate_doc, gpu_job, publish, setup  # noqa: F401

sys.path.insert(0, str(ROOT / "bench"))
import lua_phases  # noqa: E402

DRIVER = """
local phases, jobs_json = arg[1], arg[2]
local S = dofile(arg[3])
local cjson = require("cjson")
dofile(phases .. "/job_submit.lua")
local out = {}
for _, job in ipairs(cjson.decode(jobs_json)) do
  slurm_job_submit(job, {}, 1000)
  out[#out + 1] = job
end
io.write(cjson.encode({ jobs = out, logs = S.logs }))
"""


@pytest.mark.parametrize("clock,phased", [("cpu", True), ("wall", True), ("cpu", False)])
def test_the_phases_are_those_of_the_plugins_own_table_path(setup, tmp_path, clock, phased):
    make, table = setup
    p = make()
    known, entry = gpu_job(), {"*": decision(3, "a")}
    publish(p, table, [(known, entry)], gate=gate_doc({"": "normal"}))
    lua = lua_phases.phases_dir(tmp_path / "phases", clock, phased)
    (lua / "swapaware_plugin.conf").write_text((tmp_path / "etc0" / "swapaware_plugin.conf").read_text())
    other = gpu_job(name="not-in-the-table")
    jobs = [known] * 24 + [other] * 8           # two logged batches of 16: 24 hits, 8 misses
    driver = tmp_path / "driver.lua"
    driver.write_text(DRIVER)
    r = subprocess.run(["lua5.1", str(driver), str(lua), json.dumps(jobs), str(ROOT / "tests" / "slurm_stub.lua")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for job in out["jobs"][:24]:               # decided by the table as the plugin alone decides
        assert job == expected(known, entry["*"], job["admin_comment"].split()[1].removeprefix("id="))
    assert all(job == other for job in out["jobs"][24:])   # the misses: the RPC path, no service: as typed
    logs = "\n".join(out["logs"])
    assert 0 < lua_phases.parse_phases(logs)["clock_us"] < 50  # one clock read, measured by the Lua state
    raw = lua_phases.parse_phases(re.sub(r"clock=[0-9.]+", "clock=0", logs))  # the clock reads left in
    assert raw["n"] == 32 and raw["hits"] == 24
    assert 0 < raw["hit_total"] < raw["total"]  # the hits' time alone: the 8 misses' left out
    if phased:
        assert all(raw[phase] > 0 for phase in lua_phases.PHASES)
        assert raw["total"] > sum(raw[phase] for phase in lua_phases.PHASES)
    else:   # --whole: nothing wrapped, the total alone (hits counted from the AdminComment)
        assert all(raw[phase] == 0 for phase in lua_phases.PHASES) and raw["total"] > 0
        assert "reads_in_total=1 n=16" in logs
    # the fields the plugin read of the first job (through the recording proxy), read again for the others
    assert raw["fields"] >= 20 and raw["reads"] > 0


def test_parse_phases_sums_every_logged_batch_less_its_clock_reads():
    """Each batch's sums less its clock reads: one per phase and, in the total, as many per job as
    logged (nine with the phases timed: 16 jobs x 0.5 us, then 16 x 0.25 us; one with --whole)."""
    text = ("x swapaware-phases reads_in_total=9 n=16 hits=16 total=800.0 hit_total=800.0 gres=80.0 key=300.5 facts=200.0 table=150.0 clock=0.500 "
            "reads=400.0 fields=24\n"
            "y swapaware-phases reads_in_total=9 n=16 hits=12 total=900.0 hit_total=700.0 gres=90.0 key=310.5 facts=210.0 table=160.0 clock=0.250 "
            "reads=420.0 fields=24\n")
    # a hit's: as many reads per hit (16 x 0.5 us, then 12 x 0.25 us)
    assert lua_phases.parse_phases(text) == {"n": 32, "hits": 28, "total": 1700.0 - 9 * 12,
                                             "hit_total": 1500.0 - 9 * (8 + 3), "gres": 170.0 - 12,
                                             "key": 611.0 - 12, "facts": 410.0 - 12, "table": 310.0 - 12,
                                             "reads": 820.0 - 12, "clock_us": 0.5, "fields": 24}
    whole = ("z swapaware-phases reads_in_total=1 n=16 hits=16 total=800.0 hit_total=800.0 gres=0.0 key=0.0 facts=0.0 table=0.0 "
             "clock=0.500 reads=400.0 fields=24\n")
    assert lua_phases.parse_phases(whole)["total"] == 800.0 - 16 * 0.5
