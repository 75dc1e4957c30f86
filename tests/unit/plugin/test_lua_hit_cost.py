"""What a table hit costs slurmctld and what the plugin remembers to keep it low
(slurm_plugin/swapaware_facts.lua key_facts, swapaware_table.lua T.decide), run by the real Lua 5.1
as tests/unit/plugin/test_lua_table.py runs it: each job_desc accessor called once per job, and a job that
differs from one remembered in any field of its class key decided by its own key."""
from __future__ import annotations

from tests.unit.plugin.test_lua_table import (VERSION, decision, decision_id, expected, gate_doc, gpu_job, publish,  # noqa: F401
                                       setup)

# One change per field of the class key (the snapshot's key part) and of SWAPAWARE_GPU_MEM: each
# makes a key of its own.
VARIANTS = {
    "user_name": "bob", "account": "other", "partition": "gpu2", "tres_per_node": "gres:gpu:2",
    "tres_per_job": "gres:gpu:1", "tres_per_task": "gres:gpu:1", "tres_per_socket": "gres:gpu:1",
    "script": "#!/bin/bash\npython other.py\n", "comment": "swapaware:mem=8G",
    "environment": {"SWAPAWARE_GPU_MEM": "8G"}, "min_nodes": 2, "num_tasks": 2, "het_job_offset": 0,
    "qos": "high", "cpus_per_tres": "gres:gpu:4", "mem_per_tres": "gres:gpu:1G", "ntasks_per_tres": 2,
    "tres_bind": "gres:gpu:closest", "tres_freq": "gpu:high", "shared": 0,
}


def test_a_job_like_one_remembered_but_in_one_key_field_gets_its_own_decision(setup):
    """Jobs of one name, each with one key field (or its environment's SWAPAWARE_GPU_MEM) changed,
    each submitted right after the job it differs from: each is decided by its own entry, never by
    what was remembered of the job before it."""
    make, table = setup
    p = make()
    base = gpu_job(environment={"PATH": "/usr/bin"})
    jobs = [base] + [{**base, field: value} for field, value in VARIANTS.items()]
    keys = [p.key(job) for job in jobs]
    assert len(set(keys)) == len(jobs)
    publish(p, table, [(job, {"*": decision(100 + n, "a", shards=n + 1)}) for n, job in enumerate(jobs)],
            gate=gate_doc({"": "normal", "high": "normal"}))
    for n in [n for k in range(1, len(jobs)) for n in (0, k)]:
        job = jobs[n]
        res = p.submit(dict(job))
        assert res["job"] == expected(job, decision(100 + n, "a", shards=n + 1), decision_id(res["job"])), n
        assert f"tbl={VERSION}:{100 + n:07d}a " in res["job"]["admin_comment"]
    assert res["rpc_calls"] == 0 and res["counters"]["table_hit"] == 2 * (len(jobs) - 1)
    # the time limit is no part of the key: a job that differs in it alone gets the remembered job's entry
    res = p.submit({**base, "time_limit": 120})
    assert f"tbl={VERSION}:{100:07d}a " in res["job"]["admin_comment"] and res["rpc_calls"] == 0


def test_more_job_names_in_turn_than_the_plugin_remembers(setup):
    """Twice as many names as key_facts keeps (KEY_MEMO_N, 32), in turn: every job decided by its
    own entry as entries are made again in place."""
    make, table = setup
    p = make()
    jobs = [gpu_job(name=f"sweep-{n}") for n in range(64)]
    publish(p, table, [(job, {"*": decision(200 + n, "a")}) for n, job in enumerate(jobs)])
    for _ in range(2):
        for n, job in enumerate(jobs):
            res = p.submit(dict(job))
            assert f"tbl={VERSION}:{200 + n:07d}a " in res["job"]["admin_comment"], n
    assert res["rpc_calls"] == 0


def test_a_hit_and_a_miss_call_each_accessor_once(setup):
    """slurmctld's job_desc: each field read once, the environment's SWAPAWARE_GPU_MEM looked up
    once (each lookup scans the job's environment), on the table path and on the RPC path after it;
    a hit writes each assignment of the decision once, a repeat of the same job costs the same."""
    make, table = setup
    p = make()
    for hint in (None, "12G"):
        env = {"PATH": "/usr/bin", **({"SWAPAWARE_GPU_MEM": hint} if hint else {})}
        known, other = gpu_job(environment=env), gpu_job(name="other", environment=env)
        entry = {"*": decision(300, "a")}
        publish(p, table, [(known, entry)], gate=gate_doc({"": "normal"}))
        for _ in range(2):
            hit = p.req("submit_counted", job=dict(known))
            assert hit["job"] == expected(known, entry["*"], decision_id(hit["job"])) and hit["rpc_calls"] >= 0
            assert {k: n for k, n in hit["reads"].items() if n > 1} == {} and hit["env_lookups"] == 1
            assert hit["writes"] == dict.fromkeys(entry["*"]["set"], 1)
            miss = p.req("submit_counted", job=dict(other))
            assert miss["job"] == other and "admin_comment" not in miss["writes"]
            assert {k: n for k, n in miss["reads"].items() if n > 1} == {} and miss["env_lookups"] == 1


def test_the_bench_counts_what_slurmctld_would_be_called_for(setup):
    """bench/lua_table.py's "as inside slurmctld" hits: every job decided by the table, the calls
    into the job_desc counted per hit (21 field reads, 1 environment lookup, the 4 assignments)."""
    make, table = setup
    p = make()
    job = gpu_job(environment={"PATH": "/usr/bin"})
    publish(p, table, [(job, {"*": decision(400, "a")})], gate=gate_doc({"": "normal"}))
    out = p.req("bench_slurm", jobs=[job], n=50, queue=10)
    assert out["hits"] == 50 and out["rpc_calls"] == 0
    assert out["calls"] == {"read": 21 * 50, "env": 50, "write": 4 * 50}
    assert set(out["phases"]) == {"gres", "key", "facts", "table"} and all(v > 0 for v in out["phases"].values())
    assert " tbl=" in out["job"]["admin_comment"]


def test_the_admin_comment_is_the_decisions_text_byte_for_byte(setup):
    """The AdminComment is formatted per job from text prepared once per table version: a '%' or a
    NUL around the id comes out as the decision has it."""
    make, table = setup
    p = make()
    job = gpu_job()
    comment = ("50% swapaware:v1 id=IDIDIDIDIDIDIDID tbl=0123456789abcdef:0000500a action=share "
               "why=p%d%s\x00tail%")
    d = {"set": {"tres_per_node": "gres:shard:2", "admin_comment": comment}, "message": "m%s"}
    publish(p, table, [(job, {"*": d})], gate=gate_doc({"": "normal"}))
    for _ in range(2):
        res = p.submit(dict(job))
        got = res["job"]["admin_comment"]
        assert res["job"] == expected(job, d, got[got.index("id=") + 3:][:16]) and res["user"] == ["m%s"]
