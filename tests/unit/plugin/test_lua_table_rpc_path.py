"""The job_submit plugin's admission table, what it does not decide: a job the table does not hold or
a decision the plugin cannot apply takes the RPC path; without lua-posix the table is never used;
without lua-cjson or swapaware_facts.lua jobs pass unchanged; an error inside the table path takes
the RPC path. Each said once in the log.

The harness (Plugin, ``setup``, publish...) is test_lua_table.py's."""
from __future__ import annotations

from tests.unit.plugin.test_lua_table import (decision, gate_doc, gpu_job, publish, setup,  # noqa: F401 (fixture)
                                              template)


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
