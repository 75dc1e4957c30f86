"""The job_submit plugin's admission table path (slurm_plugin/swapaware_table.lua), run by the real
Lua 5.1 with Debian's lua-cjson, lua-socket and lua-posix and the real swapaware.lua. The RPC path
is swapaware.lua's own, its transport (M.call) counted and answered with a decision that changes
nothing, so a job the table did not decide comes back as typed with one RPC call."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from policy_service.core.admission_format import read_table, render_table

ROOT = Path(__file__).resolve().parents[3]
DRIVER = Path(__file__).parents[1] / "lua_table_driver.lua"
PLACEHOLDER = "IDIDIDIDIDIDIDID"
VERSION = "0123456789abcdef"

if shutil.which("lua5.1") is None:
    if os.environ.get("CI"):
        raise RuntimeError("lua5.1 is missing: contrib/dev-cluster/cluster.sh install provides it")
    pytest.skip("lua5.1 not installed (run contrib/dev-cluster/cluster.sh install)", allow_module_level=True)
_posix = subprocess.run(["lua5.1", "-e", 'require("posix.sys.stat")'], capture_output=True)
if _posix.returncode != 0:
    if os.environ.get("CI"):
        raise RuntimeError("lua-posix is missing: contrib/dev-cluster/cluster.sh install provides it")
    pytest.skip("lua-posix not installed (run contrib/dev-cluster/cluster.sh install)", allow_module_level=True)


class Plugin:
    """One Lua state (as slurmctld keeps one), fed one request per line."""

    def __init__(self, settings_dir: Path, hide: str | None = None, plugin_dir: Path = ROOT / "slurm_plugin"):
        args = ["lua5.1", str(DRIVER), str(plugin_dir), str(settings_dir)] + ([hide] if hide else [])
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)

    def req(self, op: str, **kw) -> dict:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=10)
            raise AssertionError(f"the Lua driver ended: {self.proc.stderr.read() if self.proc.stderr else ''}")
        out = json.loads(line)
        for name in ("logs", "user"):       # lua-cjson writes an empty list as {}
            out[name] = out[name] or []
        return out

    def submit(self, job: dict) -> dict:
        return self.req("submit", job=job)

    def key(self, job: dict) -> str:
        return self.req("key", job=job)["key"]

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(timeout=10)


def gpu_job(**kw) -> dict:
    job = {"user_name": "alice", "account": "proj", "partition": "gpu", "name": "train",
           "tres_per_node": "gres:gpu:1", "time_limit": 60, "min_nodes": 4294967294,
           "script": "#!/bin/bash\npython train.py\n", "work_dir": "/home/alice", "comment": ""}
    job.update(kw)
    return job


def template(entry: int, letter: str, action: str = "share") -> str:
    return f"swapaware:v1 id={PLACEHOLDER} tbl={VERSION}:{entry:07d}{letter} action={action} shards=2"


def decision(entry: int, letter: str, shards: int = 2, site_factor: int = 7, message: str | None = "shared") -> dict:
    d = {"set": {"tres_per_node": f"gres:shard:{shards}", "tres_per_job": "", "site_factor": site_factor,
                 "admin_comment": template(entry, letter)}}
    if message is not None:
        d["message"] = message
    return d


def write_atomic(path: Path, text: str, mode: int = 0o644) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def table_doc(entries: dict, **kw) -> dict:
    import time
    doc = {"format": "swapaware-admission/2", "version": VERSION, "generated_at": time.time(),
           "valid_until": time.time() + 300, "dialect": "24.11", "mode": "enforce", "per_qos": False,
           "entries": entries}
    doc.update(kw)
    return doc


def gate_doc(views: dict, other: str = "normal", valid_s: float = 300) -> dict:
    import time
    return {"format": "swapaware-gate/1", "generated_at": time.time(), "valid_until": time.time() + valid_s,
            "views": views, "other": other}


@pytest.fixture
def setup(tmp_path):
    """(plugin factory, table path): swapaware_plugin.conf with the table path on, files owned by
    this test's uid (in table_uids), checked at every job."""
    table = tmp_path / "run" / "admission.json"
    table.parent.mkdir()
    plugins: list[Plugin] = []

    def make(extra: str = "", hide: str | None = None, check_ms: int = 0) -> Plugin:
        conf = tmp_path / f"etc{len(plugins)}"      # one per Lua state: each reads it as it starts
        conf.mkdir()
        (conf / "swapaware_plugin.conf").write_text(
            f"socket={tmp_path}/none.sock\ntable={table}\ntable_check_ms={check_ms}\n"
            f"table_uids=0,{os.getuid()}\nslurm_release=24.11\n{extra}")
        p = Plugin(conf, hide)
        plugins.append(p)
        return p

    yield make, table
    for p in plugins:
        p.close()


def publish(plugin: Plugin, table: Path, entries_by_job: list[tuple[dict, dict]], gate: dict | None = None,
            **kw) -> None:
    entries = {plugin.key(job): entry for job, entry in entries_by_job}
    write_atomic(table, render_table(table_doc(entries, **kw)).decode())
    if gate is not None:
        write_atomic(table.with_name(table.name + ".gate"), json.dumps(gate))


def expected(job: dict, d: dict, decision_id: str) -> dict:
    out = dict(job)
    out.update(d["set"])
    out["admin_comment"] = d["set"]["admin_comment"].replace(PLACEHOLDER, decision_id)
    return out


def decision_id(job: dict) -> str:
    return job["admin_comment"].split()[1].removeprefix("id=")


# --- hits ----------------------------------------------------------------------------------

def test_a_hit_applies_exactly_the_set_with_a_fresh_id(setup):
    make, table = setup
    p = make()
    job = gpu_job()
    entry = {"short": decision(1, "s", shards=8, site_factor=0, message=None), "long": decision(1, "l")}
    publish(p, table, [(job, entry)], gate=gate_doc({"": "long"}))
    first, second = p.submit(dict(job)), p.submit(dict(job))
    ids = [decision_id(first["job"]), decision_id(second["job"])]
    for res, d_id in zip((first, second), ids):
        assert res["job"] == expected(job, entry["long"], d_id)
        assert res["rc"] == 0
    assert all(len(i) == 16 and int(i, 16) >= 0 and i == i.lower() for i in ids)
    assert ids[0] != ids[1] and ids[0][:8] == ids[1][:8]      # one random prefix per Lua state, a counter
    assert int(ids[1][8:], 16) == int(ids[0][8:], 16) + 1
    assert second["rpc_calls"] == 0
    assert second["counters"] == {"table_hit": 2, "table_miss": 0}
    assert first["user"] == ["shared"] and second["user"] == ["shared"]
    assert second["logs"] == []                                   # nothing logged per job


def test_the_gate_view_is_the_qos_where_the_table_is_per_qos(setup):
    make, table = setup
    p = make()
    job = gpu_job(qos="high")
    entry = {"short": decision(2, "s", shards=8), "long": decision(2, "l", shards=1)}
    publish(p, table, [(job, entry)], gate=gate_doc({"high": "short", "": "long"}, other="long"), per_qos=True)
    res = p.submit(dict(job))
    assert res["job"] == expected(job, entry["short"], decision_id(res["job"]))
    publish(p, table, [(job, entry)], gate=gate_doc({"high": "short", "": "short"}, other="long"), per_qos=False)
    res = p.submit(dict(job))   # the whole queue's view ("")
    assert res["job"] == expected(job, entry["short"], decision_id(res["job"]))
    publish(p, table, [(job, entry)], gate=gate_doc({"low": "short"}, other="long"), per_qos=True)
    res = p.submit(dict(job))   # a qos the gate does not list: "other"
    assert res["job"] == expected(job, entry["long"], decision_id(res["job"]))


@pytest.mark.parametrize("gate", ["missing", "stale", "corrupt", "group_writable"])
def test_a_gate_that_cannot_be_used_is_state_unknown(setup, gate):
    make, table = setup
    p = make()
    job = gpu_job()
    entry = {"unknown": decision(3, "u", shards=8), "long": decision(3, "l", shards=1)}
    gate_path = table.with_name(table.name + ".gate")
    publish(p, table, [(job, entry)], gate=gate_doc({"": "long"}, valid_s=-1 if gate == "stale" else 300))
    if gate == "missing":
        gate_path.unlink()
    elif gate == "corrupt":
        write_atomic(gate_path, '{"format": "swapaware-gate/1", "views": {')
    elif gate == "group_writable":
        os.chmod(gate_path, 0o664)
    res = p.submit(dict(job))
    assert res["job"] == expected(job, entry["unknown"], decision_id(res["job"]))
    assert res["rpc_calls"] == 0


HOST = Path("/proc/sys/kernel/hostname").read_text().strip()


@pytest.mark.parametrize("extra,hit", [
    ({}, True),
    ({"controller": HOST}, True),
    ({"controller": HOST + "-backup"}, False),   # written for another host's slurmctld
    ({"rpc_only": "shards refused: node1: the controller in control reports 0 a100 shards"}, False),
    ({"rpc_only": ""}, True),
    # a snapshot taken before this Lua state (slurmctld) started: its nodes may not have registered
    ({"taken_at": time.time() - 3600}, False),
    ({"taken_at": time.time() + 3600}, True),
])
def test_a_gate_can_send_every_job_to_the_rpc_path(setup, extra, hit):
    """The gate's rpc_only (the service's live facts differ from what the table assumed) and
    controller (a controller that just took over must not use its predecessor's gate)."""
    make, table = setup
    p = make()
    job = gpu_job()
    entry = {"*": decision(9, "a")}
    publish(p, table, [(job, entry)], gate={**gate_doc({"": "long"}), **extra})
    results = [p.submit(dict(job)) for _ in range(2)]
    if hit:
        assert all(r["rpc_calls"] == 0 and "tbl=" in r["job"]["admin_comment"] for r in results)
        return
    assert [r["rpc_calls"] for r in results] == [1, 2]   # counted per Lua state
    assert results[1]["counters"] == {"table_hit": 0, "table_miss": 2}
    logs = [line for r in results for line in r["logs"] if ".gate" in line]
    assert len(logs) == 1 and "jobs take the RPC path" in logs[0], logs   # said once
    assert (extra.get("rpc_only") or ("taken_at" in extra and "queue snapshot taken before this slurmctld started")
            or f"written for the slurmctld on {HOST}-backup, this host is {HOST}") in logs[0]


def test_an_entry_held_as_star_serves_every_state(setup):
    make, table = setup
    p = make()
    job = gpu_job()
    entry = {"*": decision(4, "a")}
    publish(p, table, [(job, entry)], gate=gate_doc({"": "short"}))
    res = p.submit(dict(job))
    assert res["job"] == expected(job, entry["*"], decision_id(res["job"]))
    assert f"tbl={VERSION}:0000004a " in res["job"]["admin_comment"]


def test_each_job_desc_field_is_read_once_and_the_job_is_the_same(setup):
    """slurmctld's job_desc answers every read with a call into slurmctld (under its Lua mutex and
    job write lock): the plugin reads each field once per job, on the table path and on the RPC
    path, and decides the same as from a plain table."""
    make, table = setup
    p = make()
    known, other = gpu_job(), gpu_job(name="other")
    entry = {"*": decision(8, "a")}
    publish(p, table, [(known, entry)], gate=gate_doc({"": "normal"}))
    hit = p.req("submit_counted", job=dict(known))
    assert hit["job"] == expected(known, entry["*"], decision_id(hit["job"])) and hit["rpc_calls"] == 0
    miss = p.req("submit_counted", job=dict(other))
    assert miss["job"] == other and miss["rpc_calls"] == 1
    for res in (hit, miss):
        assert {"script", "tres_per_node", "user_name", "environment", "name", "comment"} <= set(res["reads"])
        assert {k: n for k, n in res["reads"].items() if n > 1} == {}
    # a hit reads the key's fields alone; the RPC path and the limit check the other 19 besides (the
    # time limit among them: no part of the key)
    rest = set(p.req("key_reads", job=known)["rest"])
    assert {"work_dir", "user_id", "time_limit", "mail_user", "dependency", "std_out"} <= rest and len(rest) == 19
    assert not rest & set(hit["reads"]) and rest <= set(miss["reads"])
    assert set(miss["reads"]) - set(hit["reads"]) == rest
    cpu = p.req("submit_counted", job={"user_name": "alice", "name": "cpu", "script": "#!/bin/sh\n"})
    assert set(cpu["reads"]) == {"tres_per_node", "tres_per_job", "tres_per_task", "tres_per_socket"}
    assert cpu["rpc_calls"] == 1                  # (the count of this Lua state: the miss above)


# --- the RPC path ----------------------------------------------------------------------------

def test_a_job_the_table_does_not_hold_takes_the_rpc_path(setup):
    make, table = setup
    p = make()
    known, other = gpu_job(), gpu_job(name="other")
    publish(p, table, [(known, {"short": decision(5, "s")})], gate=gate_doc({"": "long"}))
    res = p.submit(dict(other))                  # no entry
    assert res["job"] == other and res["rpc_calls"] == 1
    res = p.submit(dict(known))                  # an entry, but no decision for the state "long"
    assert res["job"] == known and res["rpc_calls"] == 2
    assert res["counters"] == {"table_hit": 0, "table_miss": 2}


def test_a_decision_the_plugin_cannot_apply_takes_the_rpc_path(setup):
    make, table = setup
    p = make()
    bad = [{"set": {"tres_per_node": "gres:shard:1;rm", "admin_comment": template(6, "a")}},
           {"set": {"tres_per_node": "gres:shard:1", "admin_comment": "swapaware:v1 id=0"}},
           {"set": {"tres_per_node": "gres:shard:1", "admin_comment": template(6, "a"), "partition": "x"}},
           {"set": {"site_factor": 1.5, "admin_comment": template(6, "a")}},
           "not an object"]
    jobs = [gpu_job(name=f"bad{i}") for i in range(len(bad))]
    publish(p, table, [(job, {"*": d}) for job, d in zip(jobs, bad)])
    for n, job in enumerate(jobs, 1):
        res = p.submit(dict(job))
        assert res["job"] == job and res["rpc_calls"] == n


def corrupt(table: Path) -> None:
    lines = table.read_text().split("\n")
    write_atomic(table, "\n".join(lines[:2] + ["{ this is not json", "one more line"] + lines[2:]))


def truncate(table: Path) -> None:
    text = table.read_text()
    write_atomic(table, text[: len(text) - 2])


def header_not_json(table: Path) -> None:
    lines = table.read_text().split("\n")
    write_atomic(table, "\n".join(lines[:1] + [lines[1][: len(lines[1]) // 2]] + lines[2:]))


def json_table(table: Path) -> None:     # the format before swapaware-admission/2
    doc = read_table(table.read_bytes())
    write_atomic(table, json.dumps(dict(doc, format="swapaware-admission/1")))


def doc_change(**kw):
    def change(table: Path) -> None:
        doc = read_table(table.read_bytes())
        doc.update(kw)
        write_atomic(table, render_table(doc).decode())
    return change


def chmod(mode: int):
    return lambda table: os.chmod(table, mode)


def foreign_owner(table: Path) -> None:
    if os.getuid() != 0:
        pytest.skip("chown to another uid needs root")
    os.chown(table, 54321, -1)


def not_regular(table: Path) -> None:
    table.unlink()
    table.mkdir()


# case -> (how the good table is spoiled, the words of its one log line)
UNUSABLE = {
    "missing": (lambda t: t.unlink(), "no such file"),
    "not_regular": (not_regular, "not a regular file"),
    "truncated": (truncate, "corrupt or truncated (no last line end)"),
    "corrupt": (corrupt, "corrupt or truncated (more lines than counted)"),
    "header_not_json": (header_not_json, "corrupt or truncated (header not JSON)"),
    "format": (doc_change(format="swapaware-admission/9"), "format swapaware-admission/9 unknown"),
    "json": (json_table, 'format {"format": "swapaware-admission/1"'),
    "version": (doc_change(version="0123"), "format without a 16-hex version unknown"),
    "no_entries": (doc_change(entries=None), "format without entries unknown"),
    "dialect": (doc_change(dialect="26.05"), "dialect 26.05, this slurmctld is 24.11"),
    "expired": (doc_change(valid_until=1.0), "expired"),
    "mode": (doc_change(mode="off"), "mode off unknown"),
    "group_writable": (chmod(0o664), "group or other writable (mode 664)"),
    "other_writable": (chmod(0o646), "group or other writable (mode 646)"),
    "foreign_owner": (foreign_owner, "owned by uid 54321, not one of table_uids"),
}


@pytest.mark.parametrize("case", sorted(UNUSABLE))
def test_a_table_that_may_not_be_used_never_is(setup, case):
    spoil, words = UNUSABLE[case]
    make, table = setup
    p = make()
    job = gpu_job()
    publish(p, table, [(job, {"*": decision(7, "a")})], gate=gate_doc({"": "short"}))
    assert p.submit(dict(job))["counters"]["table_hit"] == 1        # the control: the good table is used
    spoil(table)
    logs = []
    for n in (2, 3):
        res = p.submit(dict(job))
        assert res["job"] == job, case                               # as typed: the RPC path changed nothing
        assert res["rpc_calls"] == n - 1
        logs += res["logs"]
    assert len(logs) == 1 and words in logs[0] and str(table) in logs[0], logs
    assert "jobs take the RPC path" in logs[0]
    # a good table again: used again, said once
    if table.is_dir():
        table.rmdir()
    publish(p, table, [(job, {"*": decision(7, "a")})])
    res = p.submit(dict(job))
    assert res["job"] == expected(job, decision(7, "a"), decision_id(res["job"]))
    assert len(res["logs"]) == 1 and "used" in res["logs"][0]


def test_without_lua_posix_the_table_is_never_used(setup):
    make, table = setup
    p = make(hide="posix")
    job = gpu_job()
    publish(p, table, [(job, {"*": decision(8, "a")})])
    results = [p.submit(dict(job)) for _ in range(2)]
    assert [r["job"] for r in results] == [job, job] and results[-1]["rpc_calls"] == 2
    logs = results[0]["logs"] + results[1]["logs"]
    assert len(logs) == 1 and "lua-posix (posix.sys.stat) is not installed" in logs[0]


def test_without_lua_cjson_jobs_pass_unchanged(setup):
    make, table = setup
    writer = make()
    job = gpu_job()
    publish(writer, table, [(job, {"*": decision(9, "a")})])
    p = make(hide="cjson")
    res = p.submit(dict(job))
    assert res["job"] == job and res["rpc_calls"] == 0    # no cjson: no RPC path either (fail-open)
    assert any("lua-cjson is not installed" in line for line in res["logs"])


def test_without_swapaware_facts_every_job_passes_unchanged_and_the_log_says_why_once(setup):
    """An upgrade that copied swapaware.lua but not swapaware_facts.lua: the plugin still loads
    (slurmctld refuses to start with a job_submit.lua that fails to load; 26.05 rejects jobs on a
    Lua error) and lets every job through as typed, neither table nor RPC."""
    make, table = setup
    writer = make()
    job = gpu_job()
    publish(writer, table, [(job, {"*": decision(9, "a")})], gate=gate_doc({"": "normal"}))
    p = make(hide="facts")
    results = [p.submit(dict(job)) for _ in range(2)]
    assert [r["job"] for r in results] == [job, job] and [r["rc"] for r in results] == [0, 0]
    assert results[-1]["rpc_calls"] == 0 and results[-1]["counters"] == {"table_hit": 0, "table_miss": 0}
    logs = results[0]["logs"] + results[1]["logs"]
    assert len(logs) == 1 and "swapaware_facts.lua cannot be loaded" in logs[0], logs


def test_an_error_inside_the_table_path_takes_the_rpc_path(setup):
    make, table = setup
    p = make()
    job = gpu_job()
    publish(p, table, [(job, {"*": decision(10, "a")})])
    p.req("raise")
    results = [p.submit(dict(job)) for _ in range(2)]
    assert [r["job"] for r in results] == [job, job] and results[-1]["rpc_calls"] == 2
    logs = [line for line in results[0]["logs"] + results[1]["logs"] if line.startswith("error")]
    assert len(logs) == 1 and "raised by the test" in logs[0] and "RPC path" in logs[0]


def test_an_empty_table_setting_never_looks_for_one(tmp_path):
    conf = tmp_path / "etc"
    conf.mkdir()
    (conf / "swapaware_plugin.conf").write_text(f"socket={tmp_path}/none.sock\ntable=\n")
    p = Plugin(conf)
    try:
        assert p.req("settings")["settings"]["table"] == ""
        res = p.submit(gpu_job())
        assert res["rpc_calls"] == 1 and res["logs"] == [] and res["counters"] == {"table_hit": 0, "table_miss": 0}
    finally:
        p.close()


def test_by_default_the_table_is_looked_for_beside_the_socket(tmp_path):
    """No table= line: "auto", admission.json beside socket= (where the service publishes it with its
    default [admission] table_path); none there: the round trip, and one log line that says why."""
    conf = tmp_path / "etc"
    conf.mkdir()
    (conf / "swapaware_plugin.conf").write_text(f"socket={tmp_path}/run/none.sock\n")
    p = Plugin(conf)
    try:
        assert p.req("settings")["settings"]["table"] == "auto"
        res = p.submit(gpu_job())
        assert res["rpc_calls"] == 1, res
        assert any(f"{tmp_path}/run/admission.json not used" in line and "no such file" in line
                   for line in res["logs"]), res["logs"]
    finally:
        p.close()


# --- reload ----------------------------------------------------------------------------------

def test_a_new_version_is_read_once_the_check_interval_passed(setup):
    make, table = setup
    job = gpu_job()
    fast, slow = make(check_ms=0), make(check_ms=600_000)
    one, two = decision(11, "a", shards=1), decision(11, "a", shards=3)
    publish(fast, table, [(job, {"*": one})])
    assert fast.submit(dict(job))["job"]["tres_per_node"] == "gres:shard:1"
    assert slow.submit(dict(job))["job"]["tres_per_node"] == "gres:shard:1"
    publish(fast, table, [(job, {"*": two})])
    assert fast.submit(dict(job))["job"]["tres_per_node"] == "gres:shard:3"
    assert slow.submit(dict(job))["job"]["tres_per_node"] == "gres:shard:1"   # not stat'ed again yet


def test_settings_are_parsed(setup):
    make, _ = setup
    p = make(extra="table_uids=0, 7,x,12\n")
    s = p.req("settings")["settings"]
    assert s["table_uids"] == {"0": True, "7": True, "12": True}
    assert s["slurm_release"] == "24.11" and s["table_check_ms"] == 0


# --- the key ---------------------------------------------------------------------------------

KEY_JOBS = [
    gpu_job(),
    gpu_job(tres_per_node="", tres_per_job="gres:gpu:h100:1", qos="high", comment="mem=20G", shared=0,
            num_tasks=1, ntasks_per_tres=1, cpus_per_tres="gres:gpu:4", mem_per_tres="gres:gpu:1000",
            tres_bind="gres:gpu:closest", tres_freq="gpu:high", het_job_offset=0, min_nodes=1),
    gpu_job(tres_per_node="", tres_per_task="gres:gpu:1", num_tasks=1, script=None, environment={
        "SWAPAWARE_GPU_MEM": "12G"}, user_name="b\u00f6b", comment="caf\u00e9 \u2603", time_limit=4294967294),
    gpu_job(name="x" * 2000, tres_per_socket="gres:gpu:1", shared=2),
]


def test_the_key_is_every_fact_decide_reads_in_the_published_order(setup):
    make, _ = setup
    p = make()
    for job in KEY_JOBS:
        out = p.req("key", job={k: v for k, v in job.items() if v is not None})
        f = out["facts"]
        want = [f["user"], f["account"], f["partition"], f["jobName"], f["tresPerNode"], f["tresPerJob"],
                f["tresPerTask"], f["tresPerSocket"], f["scriptFingerprint"],
                f["comment"], f["envMemHint"], str(f["minNodes"]), str(f["numTasks"]),
                "1" if f["isBatch"] else "0", "1" if f["hetJob"] else "0", f["qos"], f["cpusPerTres"],
                f["memPerTres"], str(f["ntasksPerTres"]), f["tresBind"], f["tresFreq"], f["exclusive"]]
        assert out["key"] == "\x1f".join(want)


def test_the_key_needs_no_field_the_table_path_leaves_unread(setup):
    """The table path reads the job_desc fields of the class key alone: the key of that snapshot is
    the key of the whole job, for every job here (each field set, typed and odd)."""
    make, _ = setup
    p = make()
    for job in KEY_JOBS:
        full = {k: v for k, v in job.items() if v is not None}
        full.update(work_dir="/w/" + full.get("name", ""), user_id=1234, mail_user="m@x", std_out="/o")
        out = p.req("key_reads", job=full)
        assert out["key"] == p.key(full)
        assert not set(out["reads"]) & set(out["rest"])


def test_a_table_hit_leaves_slurms_refusal_to_slurm_and_a_key_field_over_its_limit_passes(setup):
    """A field the table path does not read (--mail-user) over Slurm's limit: the table decides the job
    and slurmctld refuses it after job_submit, with what was set (no decision is recorded: the service
    records a table decision from the job Slurm holds). A field of the key over its limit: as typed,
    neither table nor RPC, as on the RPC path."""
    make, table = setup
    p = make()
    known = gpu_job()
    entry = {"*": decision(3, "a")}
    over_key = gpu_job(comment="c" * 1025)
    publish(p, table, [(known, entry), (over_key, entry)], gate=gate_doc({"": "normal"}))
    hit = p.submit(gpu_job(mail_user="m" * 1025))
    assert hit["job"]["admin_comment"].startswith("swapaware:v1 id=") and hit["rpc_calls"] == 0
    passed = p.submit(dict(over_key))
    assert passed["job"] == over_key and passed["rpc_calls"] == 0
    assert any("comment is 1025 bytes" in line for line in passed["logs"]), passed["logs"]
    miss = p.submit(gpu_job(name="other", mail_user="m" * 1025))     # RPC path: checked before asking
    assert "admin_comment" not in miss["job"] and miss["rpc_calls"] == 0
    assert any("mail_user is 1025 bytes" in line for line in miss["logs"]), miss["logs"]


def test_the_limit_check_of_each_part_reads_that_parts_fields_and_names_the_first_by_name(setup):
    """Slurm's field limits, split as the snapshot is read: the key's (checked before the table
    decides) and the rest (checked once it has not); together every limited field, once."""
    make, _ = setup
    p = make()
    limited = p.req("over_limit", job={}, part="all")["limited"]
    key_reads = set(p.req("key_reads", job=gpu_job())["reads"])
    assert sorted(limited["key"] + limited["rest"]) == limited["all"] == sorted(set(limited["all"]))
    assert set(limited["key"]) <= key_reads and not set(limited["rest"]) & key_reads
    assert len(limited["all"]) == 30 and {"comment", "tres_per_node", "name"} <= set(limited["key"])
    both = {"mail_user": "m" * 1025, "comment": "c" * 1025, "std_out": "o" * 4097}
    assert [(r["field"], r["size"], r["limit"]) for r in (p.req("over_limit", job=both, part=part)
                                                          for part in ("all", "key", "rest"))] == [
        ("comment", 1025, 1024), ("comment", 1025, 1024), ("mail_user", 1025, 1024)]
    assert p.req("over_limit", job={"comment": "c" * 1024, "std_out": "o" * 4096}, part="all")["field"] is None


def test_the_key_is_the_services_table_key(setup):
    admission = pytest.importorskip("policy_service.core.admission")
    from google.protobuf import json_format
    from policy_service._generated.swapaware.v1 import policy_pb2 as pb
    make, _ = setup
    p = make()
    for job in KEY_JOBS:
        out = p.req("key", job={k: v for k, v in job.items() if v is not None})
        facts = json_format.ParseDict(out["facts"], pb.JobFacts())
        assert out["key"] == admission.table_key(facts)


def test_a_stale_gate_is_read_again_even_when_it_looks_unchanged(setup):
    """A gate rewritten within the same second on a reused inode has the same (inode, size, mtime):
    once stale it is read again at every check."""
    make, table = setup
    p = make()
    job = gpu_job()
    entry = {"unknown": decision(12, "u", shards=8), "long": decision(12, "l", shards=1)}
    publish(p, table, [(job, entry)])
    gate = table.with_name(table.name + ".gate")

    def rewrite(valid_until: str) -> None:   # in place: same inode, same size, mtime put back
        text = ('{"format": "swapaware-gate/1", "valid_until": %s, "views": {"": "long"}, "other": "long"}'
                % valid_until)
        st = gate.stat() if gate.exists() else None
        with open(gate, "r+" if st else "w") as f:
            f.write(text)
        os.chmod(gate, 0o644)
        if st:
            os.utime(gate, ns=(st.st_atime_ns, st.st_mtime_ns))

    rewrite("1000000000.5")                  # stale
    res = p.submit(dict(job))
    assert res["job"] == expected(job, entry["unknown"], decision_id(res["job"]))
    rewrite("9999999999.5")                  # fresh, looking the same to stat
    res = p.submit(dict(job))
    assert res["job"] == expected(job, entry["long"], decision_id(res["job"]))


# --- the file (swapaware-admission/2) -------------------------------------------------------------

def test_keys_with_a_tab_a_line_break_or_a_backslash_are_found(setup):
    """Such a key is escaped in the file's key line and the job's key is escaped the same way;
    other keys whose escaped form would look alike stay apart."""
    make, table = setup
    p = make()
    jobs = [gpu_job(comment="a\tb"), gpu_job(comment="a\\tb"), gpu_job(comment="x\ny\\"), gpu_job(comment="x\\ny\\")]
    keys = [p.key(j) for j in jobs]
    assert "\t" in keys[0] and "\n" in keys[2] and len(set(keys)) == 4
    publish(p, table, [(job, {"*": decision(20 + n, "a", shards=n + 1)}) for n, job in enumerate(jobs)])
    for n, job in enumerate(jobs):
        res = p.submit(dict(job))
        assert res["job"]["tres_per_node"] == f"gres:shard:{n + 1}", n
        assert f"tbl={VERSION}:{20 + n:07d}a " in res["job"]["admin_comment"]
    assert res["rpc_calls"] == 0


def test_one_decision_line_serves_every_entry_and_state_that_decides_alike(setup):
    """The file holds each distinct decision once; the plugin writes each job's token (version,
    entry number, state letter) into the shared template."""
    make, table = setup
    p = make()
    jobs = [gpu_job(name=f"same{n}") for n in range(3)]
    entries = [(job, {"short": decision(30 + n, "s"), "long": decision(30 + n, "l")}) for n, job in enumerate(jobs)]
    publish(p, table, entries, gate=gate_doc({"": "long"}))
    text = table.read_text()
    assert text.count("admin_comment") == 1 and len(text.splitlines()) == 2 + 1 + 3 + 1
    for n, job in enumerate(jobs):
        res = p.submit(dict(job))
        assert res["job"] == expected(job, decision(30 + n, "l"), decision_id(res["job"]))
    assert read_table(table.read_bytes())["entries"][p.key(jobs[2])] == {"i": 32, **entries[2][1]}


def test_more_lines_than_counted_is_never_used(setup):
    make, table = setup
    p = make()
    job = gpu_job()
    publish(p, table, [(job, {"*": decision(40, "a")})])
    lines = table.read_text().split("\n")
    write_atomic(table, "\n".join(lines[:-2] + [lines[-3].replace("\t", "x\t", 1)] + lines[-2:]))
    res = p.submit(dict(job))
    assert res["job"] == job and res["rpc_calls"] == 1
    assert any("corrupt or truncated (more lines than counted)" in line for line in res["logs"]), res["logs"]


def test_a_line_is_used_only_for_its_whole_key_whatever_its_digest(setup):
    """The digest only finds a line: a job whose digest names a line of another key takes the RPC
    path (a digest two keys share cannot hand one job's decision to the other)."""
    from policy_service.core.admission_format import key_digest
    make, table = setup
    p = make()
    mine, other = gpu_job(), gpu_job(name="other")
    publish(p, table, [(other, {"*": decision(50, "a")})])
    text = table.read_text()
    write_atomic(table, text.replace(key_digest(p.key(other)), key_digest(p.key(mine))))
    res = p.submit(dict(mine))
    assert res["job"] == mine and res["rpc_calls"] == 1 and res["counters"]["table_miss"] == 1
    res = p.submit(dict(other))                  # its own digest is in no line now
    assert res["job"] == other and res["rpc_calls"] == 2


def test_the_plugins_digest_is_the_services(setup):
    from policy_service.core.admission_format import key_digest
    make, table = setup
    p = make()
    for job in KEY_JOBS + [gpu_job(comment="a\tb\\n\n")]:
        job = {k: v for k, v in job.items() if v is not None}
        key = p.key(job)
        publish(p, table, [(job, {"*": decision(60, "a")})])
        assert key_digest(key) in table.read_text()
        assert p.submit(dict(job))["counters"]["table_hit"] >= 1
