"""The job_submit.lua files the submit benches install in place of swapaware's (bench/table_mode.py),
run by the real Lua 5.1: noop leaves a job as typed; rewrite shapes it as the table's decision
would (same fields, an AdminComment of the same length) while nothing in it reads as a decision to
the service's catch-up."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from policy_service.slurm.slurm_text import decision_ids_in
from policy_service.core.admission import PLACEHOLDER_ID

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "bench"))
import table_mode  # noqa: E402

if shutil.which("lua5.1") is None or subprocess.run(["lua5.1", "-e", 'require("cjson")'],
                                                   capture_output=True).returncode != 0:
    pytest.skip("lua5.1 with lua-cjson not installed (contrib/dev-cluster/cluster.sh install)", allow_module_level=True)

DRIVER = """
local S = dofile(arg[1])
local cjson = require("cjson")
dofile(arg[2])
local out = {}
for _, job in ipairs(cjson.decode(arg[3])) do
  local rc = slurm_job_submit(job, {}, 1000)
  out[#out + 1] = { rc = rc, job = job }
end
io.write(cjson.encode(out))
"""

SETS = {"bench0": {"tres_per_node": "gres:shard:3", "tres_per_job": "", "site_factor": 12,
                   "admin_comment": f"swapaware:v1 id={PLACEHOLDER_ID} tbl=0123456789abcdef:0000001a action=share "
                                    "shards=3"}}


def run(tmp_path: Path, lua: str, jobs: list[dict]) -> list[dict]:
    (tmp_path / "job_submit.lua").write_text(lua)
    (tmp_path / "driver.lua").write_text(DRIVER)
    r = subprocess.run(["lua5.1", str(tmp_path / "driver.lua"), str(ROOT / "tests" / "slurm_stub.lua"),
                        str(tmp_path / "job_submit.lua"), json.dumps(jobs)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_rewrite_shapes_the_job_as_the_table_would_and_reads_as_no_decision(tmp_path):
    job = {"name": "bench0", "tres_per_node": "gres:gpu:1", "user_name": "root"}
    other = {"name": "elsewhere", "tres_per_node": "gres:gpu:1"}
    (shaped, untouched) = run(tmp_path, table_mode.rewrite_lua(SETS), [dict(job), dict(other)])
    assert shaped["rc"] == 0 and untouched == {"rc": 0, "job": other}
    got, want = shaped["job"], SETS["bench0"]
    assert {k: got.get(k) for k in want if k != "admin_comment"} == {k: v for k, v in want.items()
                                                                    if k != "admin_comment"}
    assert got["user_name"] == "root"
    comment = got["admin_comment"]
    assert len(comment) == len(want["admin_comment"])
    assert "swapaware:v1" not in comment and " tbl=" not in comment and decision_ids_in(comment) == set()


def test_noop_leaves_every_job_as_typed(tmp_path):
    job = {"name": "bench0", "tres_per_node": "gres:gpu:1"}
    assert run(tmp_path, table_mode.NOOP_LUA, [dict(job)]) == [{"rc": 0, "job": job}]
