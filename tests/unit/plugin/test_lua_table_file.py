"""The job_submit plugin's admission table, the file: a table that may not be used (missing,
corrupt, truncated, unknown format or version, expired, writable by others, foreign owner...) never is
and says so once; where the table is looked for and the settings read; a new version read once the
check interval passed; the swapaware-admission/2 format (escaped keys, shared decision lines, line
counts, digests that only find a line).

The harness (Plugin, ``setup``, publish...) is test_lua_table.py's."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from policy_service.core.admission_format import read_table, render_table
from tests.unit.plugin.test_lua_table import (VERSION, Plugin, decision, decision_id, expected,  # noqa: F401
                                              gate_doc, gpu_job, publish, setup, write_atomic)  # (setup: the fixture)


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


def plugin_with_conf(tmp_path: Path, text: str) -> Plugin:
    """A Lua state reading this swapaware_plugin.conf (not the ``setup`` fixture's)."""
    conf = tmp_path / "etc"
    conf.mkdir()
    (conf / "swapaware_plugin.conf").write_text(text)
    return Plugin(conf)


def test_an_empty_table_setting_never_looks_for_one(tmp_path):
    p = plugin_with_conf(tmp_path, f"socket={tmp_path}/none.sock\ntable=\n")
    try:
        assert p.req("settings")["settings"]["table"] == ""
        res = p.submit(gpu_job())
        assert res["rpc_calls"] == 1 and res["logs"] == [] and res["counters"] == {"table_hit": 0, "table_miss": 0}
    finally:
        p.close()


def test_by_default_the_table_is_looked_for_beside_the_socket(tmp_path):
    """No table= line: "auto", admission.json beside socket= (where the service publishes it with its
    default [admission] table_path); none there: the round trip, and one log line that says why."""
    p = plugin_with_conf(tmp_path, f"socket={tmp_path}/run/none.sock\n")
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
