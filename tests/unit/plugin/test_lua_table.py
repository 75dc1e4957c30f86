"""The job_submit plugin's admission table path (slurm_plugin/swapaware_table.lua), run by the real
Lua 5.1 with Debian's lua-cjson, lua-socket and lua-posix and the real swapaware.lua. The RPC path
is swapaware.lua's own, its transport (M.call) counted and answered with a decision that changes
nothing, so a job the table did not decide comes back as typed with one RPC call.

This module holds the harness the other table tests import (Plugin, the ``setup`` fixture, publish,
gpu_job, decision, expected...) and the table's lookup: a hit, the gate's view of the queue (and a gate
that cannot be used, or that sends every job to the RPC path), and the job_desc fields a job reads.
Split by subject: test_lua_table_file.py (finding, reading and trusting the file, its format),
test_lua_table_key.py (the class key and its limits), test_lua_table_rpc_path.py (what the table does
not decide, missing Lua libraries, errors). About 400 lines: the harness is one piece the three others
import whole."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from policy_service.core.admission_format import render_table
from tests.waiting import wait_for

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
@pytest.mark.parametrize("stale", [False, True], ids=["fresh", "stale"])
def test_a_gate_can_send_every_job_to_the_rpc_path(setup, extra, hit, stale):
    """The gate's rpc_only (the service's live facts differ from what the table assumed) and
    controller (a controller that just took over must not use its predecessor's gate), whether
    the gate is fresh or stale: a writer whose queue polls stall while control passes leaves a
    stale gate naming its own controller, and a stale gate's state is "unknown", which an entry
    held for every state ("a") would still serve."""
    make, table = setup
    p = make()
    job = gpu_job()
    entry = {"*": decision(9, "a")}
    gate = {**gate_doc({"": "long"}, valid_s=-1 if stale else 300), **extra}
    publish(p, table, [(job, entry)], gate=gate)
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


def test_a_gate_replaced_while_read_leaves_the_state_read_before(setup):
    """The publisher rewrites the gate after every queue poll (write, rename): a job whose read
    meets a rewrite keeps the state read before (not "unknown": differential test, CI run 11), and
    the next job reads the new file."""
    make, table = setup
    p = make()
    job = gpu_job()
    entry = {"long": decision(5, "l", shards=1), "unknown": decision(5, "u", shards=8),
             "short": decision(5, "s", shards=8)}
    publish(p, table, [(job, entry)], gate=gate_doc({"": "long"}))
    gate_path = table.with_name(table.name + ".gate")
    assert f"tbl={VERSION}:0000005l " in p.submit(dict(job))["job"]["admin_comment"]
    write_atomic(gate_path, json.dumps(gate_doc({"": "long"})))   # a rewrite: a new signature ...
    p.req("replace_on_read", path=str(gate_path), text=json.dumps(gate_doc({"": "short"})))  # ... and another
    res = p.submit(dict(job))                                      # while this job reads it
    assert f"tbl={VERSION}:0000005l " in res["job"]["admin_comment"], res["job"]
    assert res["rpc_calls"] == 0 and not [ln for ln in res["logs"] if ".gate" in ln], res["logs"]
    assert f"tbl={VERSION}:0000005s " in p.submit(dict(job))["job"]["admin_comment"]  # the next job: the new file
    fresh = make()   # a Lua state that has read no gate yet: it reads the replaced file once more
    fresh.req("replace_on_read", path=str(gate_path), text=json.dumps(gate_doc({"": "long"})))
    assert f"tbl={VERSION}:0000005l " in fresh.submit(dict(job))["job"]["admin_comment"]


def in_place(path: Path, text: str) -> None:
    """``path`` rewritten with ``text`` looking the same to stat: same inode, same size (``text``
    is the old file's length), mtime put back (two rewrites within one second on a reused inode)."""
    st = path.stat()
    assert len(text.encode()) == st.st_size
    with open(path, "r+") as f:
        f.write(text)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_gate_rewritten_with_the_signature_of_the_one_read_is_read_anew(setup):
    """The publisher rewrites the gate after every queue poll: one rewritten within the same second
    on a reused inode, of the same size, has the same (inode, size, mtime) as the one read before,
    and is read all the same (CI run 25: the older state served until the next rewrite)."""
    make, table = setup
    p = make()
    job = gpu_job()
    entry = {"long": decision(13, "l", shards=1), "short": decision(13, "s", shards=8)}
    doc = gate_doc({"": "long"})
    publish(p, table, [(job, entry)], gate=doc)
    gate = table.with_name(table.name + ".gate")
    assert f"tbl={VERSION}:0000013l " in p.submit(dict(job))["job"]["admin_comment"]
    text = json.dumps(dict(doc, views={"": "short"}), separators=(",", ":"))    # shorter: padded to the size
    in_place(gate, text + " " * (gate.stat().st_size - len(text)))
    res = p.submit(dict(job))
    assert res["job"] == expected(job, entry["short"], decision_id(res["job"])) and res["rpc_calls"] == 0


def test_a_table_rewritten_with_the_signature_of_the_one_read_is_read_anew(setup):
    """Two class tables of one size written within one second on a reused inode look the same to
    stat: their heads (the header names the version) tell them apart."""
    make, table = setup
    p = make()
    job = gpu_job()
    now = time.time()
    times = {"generated_at": now, "valid_until": now + 300}
    publish(p, table, [(job, {"*": decision(3, "a", site_factor=7)})], gate=gate_doc({"": "normal"}), **times)
    first = p.submit(dict(job))["job"]
    assert f"tbl={VERSION}:0000003a " in first["admin_comment"] and first["site_factor"] == 7
    other = "fedcba9876543210"
    later = decision(3, "a", site_factor=8)
    later["set"]["admin_comment"] = later["set"]["admin_comment"].replace(VERSION, other)
    in_place(table, render_table(table_doc({p.key(job): {"*": later}}, version=other, **times)).decode())
    res = p.submit(dict(job))
    assert f"tbl={other}:0000003a " in res["job"]["admin_comment"] and res["job"]["site_factor"] == 8, res["job"]
    assert res["rpc_calls"] == 0


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


def test_the_gate_state_remembered_between_checks_follows_the_view_and_the_gates_expiry(setup):
    """Between two checks of the gate file (table_check_ms) a hit takes the gate state worked out
    for the last job (T.decide's ``seen``): only while the job's view and the gate's valid_until
    would give the same state."""
    make, table = setup
    p = make(check_ms=600_000)     # the files are checked once in this test
    high, plain = gpu_job(qos="high"), gpu_job(qos="")
    entry = {"short": decision(13, "s", shards=8), "long": decision(13, "l", shards=1),
             "unknown": decision(13, "u", shards=4)}
    gate = gate_doc({"high": "short", "": "long"}, other="long", valid_s=2.0)
    publish(p, table, [(high, entry), (plain, entry)], gate=gate, per_qos=True)
    letters = []
    for job in (high, plain, high, high, plain):
        letters.append(p.submit(dict(job))["job"]["admin_comment"].split(f"tbl={VERSION}:")[1][7])
    assert letters == ["s", "l", "s", "s", "l"]   # each job its own view's state
    wait_for(lambda: time.time() > gate["valid_until"] + 0.05, 10, "the gate's valid_until to pass")
    res = p.submit(dict(plain))     # the view of the last job, within the check period, past valid_until
    assert res["job"] == expected(plain, entry["unknown"], decision_id(res["job"]))
