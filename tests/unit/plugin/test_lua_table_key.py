"""The job_submit plugin's admission table, the class key: every fact decide reads in the published
order, read from the job_desc fields of the key alone, the same as the service's table key and
digest; Slurm's field limits split between the key's fields and the rest.

The harness (Plugin, ``setup``, publish...) is test_lua_table.py's."""
from __future__ import annotations

import pytest

from tests.unit.plugin.test_lua_table import decision, gate_doc, gpu_job, publish, setup  # noqa: F401  (the fixture)


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
