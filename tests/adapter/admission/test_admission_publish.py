"""The admission table publisher through the real service (real gRPC, real SQLite, real files),
with the Slurm stand-in holding the pending queue: the table's decision for a key is what Admit
answers for the same facts in the gate state the gate file names.

This module holds the fixtures and helpers the other publisher tests import (env, svc, table,
gate_state, plain, rpc_set...) and the table itself: its decisions, archived templates, its files
(replaced whole, readable by slurmctld alone), its version, policy.mode, keys it leaves out. Split by
subject: test_admission_publish_learning.py (what an observation does to the table),
test_admission_publish_gate.py (the gate file, and the publisher as the service starts and stops)."""
import json
import logging
import os
import pwd
import shutil
import sqlite3
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.admission.archive import archive_path
from policy_service.slurm.slurm import PendingJob
from policy_service.config import PolicyMode
from policy_service.core import admission
from policy_service.core.admission_format import read_table
from policy_service.core.policy import parse_admin_comment
from tests.adapter.conftest import served
from tests.waiting import wait_for

from tests.adapter.serving.test_service import GIB, facts, run_job


def queued(n):
    """n pending jobs asking for one GPU each (of the stand-in's 4)."""
    return [PendingJob(900 + i, "gres:gpu:1", "", "", 1, 1, "Resources", "") for i in range(n)]


@pytest.fixture
def env(service_env, tmp_path):
    return dict(service_env, SWAPAWARE_ADMISSION__TABLE_PATH=str(tmp_path / "run" / "admission.json"),
                SWAPAWARE_ADMISSION__REFRESH_S="1000", SWAPAWARE_ADMISSION__VALID_S="3000",
                SWAPAWARE_POLICY__SHARE_MIN_QUEUE="0.25", SWAPAWARE_POLICY__OVERCOMMIT_COMPUTE_MIN_QUEUE="0.75",
                SWAPAWARE_POLICY__QUEUE_POLL_S="0.2")


@pytest.fixture
def svc(env, slurm_jobs, tmp_path):
    (tmp_path / "run").mkdir()
    with served(env, slurm_jobs) as sc:
        yield sc


def table(s):
    return read_table(s.admission_publisher.table.read_bytes())


def current_table(s):
    """The class table as it stands, None while there is none (it may go between two looks)."""
    try:
        return table(s)
    except FileNotFoundError:
        return None


def gate_state(s, qos=""):
    g = json.loads(s.admission_publisher.gate.read_text())
    return g["views"].get(qos, g["other"]) if s.admission_publisher.cfg.policy.queue_per_qos else g["views"][""]


def plain(comment):
    """An AdminComment without its id and table token (what the RPC path and the table share)."""
    fields = parse_admin_comment(comment)
    fields.pop("id", None)
    fields.pop("tbl", None)
    return fields


def rpc_set(d: pb.Decision) -> dict:
    """The job_desc assignments swapaware.lua's M.validate makes of an Admit reply."""
    rw = d.rewrite
    out = {f: getattr(rw, f) for f in ("tres_per_node", "tres_per_job", "tres_per_task", "tres_per_socket",
                                       "tres_bind") if rw.HasField(f)}
    if rw.HasField("site_factor"):
        out["site_factor"] = rw.site_factor
    if rw.HasField("admin_comment"):
        out["admin_comment"] = plain(rw.admin_comment)
    return out


def table_set(decision: dict) -> dict:
    out = dict(decision["set"])
    if "admin_comment" in out:
        out["admin_comment"] = plain(out["admin_comment"])
    return out


JOBS = [
    facts(name="learned"),  # shares once learned (2 GiB of 8 shards), the queue gate decides
    facts(name="learned", qos="high"),
    facts(name="new"),  # no history: whole GPU in every state
    facts(name="learned", gres="", tres_per_task="gres:gpu:1", num_tasks=1),
    facts(name="learned", gres="", tres_per_task="gres:gpu:1", num_tasks=2),
    facts(name="learned", exclusive="node"),
    facts(name="learned", is_batch=False),
    facts(name="learned", comment="swapaware:mem=3G"),
    facts(name="other", user="bob"),
]


def test_the_tables_decision_is_admits_in_each_gate_state(svc, slurm_jobs):
    s, client = svc
    for n in range(3):
        run_job(client, slurm_jobs, 100 + n, facts(name="learned"), peak=2 * GIB, start=1000.0 + n, end=1100.0 + n)
    for i, job in enumerate(JOBS):
        client.admit(job)
    pub = s.admission_publisher.publish("test")
    t = table(s)
    assert t["version"] == pub.version and t["format"] == admission.TABLE_FORMAT and t["mode"] == "enforce"
    assert set(t["entries"]) >= {admission.table_key(j) for j in JOBS}
    seen_states, actions = set(), set()
    for pending, want in ((queued(0), "short"), (queued(2), "normal"), (queued(4), "long"), (None, "unknown")):
        slurm_jobs.pending = pending
        wait_for(lambda: s.admission_publisher.gate.exists() and gate_state(s) == want, 30.0, f"gate {want}")
        for job in JOBS:
            entry = t["entries"][admission.table_key(job)]
            decision = entry.get(want, entry.get("*"))
            assert decision is not None, (job, entry)
            rpc = client.admit(job, dry_run=True).decision
            assert gate_state(s) == want  # the state did not move while Admit decided
            assert table_set(decision) == rpc_set(rpc), (want, job)
            assert decision.get("message") == (rpc.rewrite.user_message if rpc.rewrite.HasField("user_message")
                                               else None)
            actions.add((want, parse_admin_comment(decision["set"]["admin_comment"])["action"]))
        seen_states.add(want)
    assert seen_states == {"short", "normal", "long", "unknown"}
    # the states made a difference: kept whole while nothing waits, shared otherwise
    assert ("short", "whole_gpu") in actions and ("normal", "share") in actions and ("unknown", "share") in actions


def test_templates_are_archived_and_name_their_entry(svc, slurm_jobs):
    s, client = svc
    run_job(client, slurm_jobs, 100, facts(name="learned"), peak=2 * GIB)
    client.admit(facts(name="learned"))
    pub = s.admission_publisher.publish("test")
    entry = table(s)["entries"][admission.table_key(facts(name="learned"))]
    for state, decision in entry.items():
        if state == "i":
            continue
        comment = decision["set"]["admin_comment"]
        ref = admission.parse_table_ref(comment)
        assert ref == admission.TableRef(pub.version, entry["i"], state)
        rec = s.admission_archive.lookup(pub.version, entry["i"], state)
        assert rec is not None and rec.decision_id == admission.PLACEHOLDER_ID and rec.decided_at == 0
        d = pb.Decision.FromString(rec.decision_pb)
        assert d.decision_id == admission.PLACEHOLDER_ID and d.rewrite.admin_comment == comment
        got = pb.JobFacts.FromString(rec.facts_pb)
        assert admission.table_key(got) == admission.table_key(facts(name="learned")) and got.uid == 0
        if state == "short":  # the queue gate's reason says the state, not the made-up queue's figures
            why = next(r.message for r in d.reasons if r.code == "queue_short")
            assert why.startswith("queue gate 'short'") and "GPUs (" not in why, why
    assert s.admission_archive.lookup(pub.version, entry["i"] + 10_000, "short") is None
    assert s.admission_archive.lookup("0" * 16, entry["i"], "short") is None


def test_files_are_replaced_whole_and_readable_by_slurmctld_alone(svc, slurm_jobs):
    s, client = svc
    client.admit(facts(name="a"))
    p = s.admission_publisher
    p.publish("test")
    first = p.table.stat()
    with open(p.table, "rb") as old:
        client.admit(facts(name="b"))
        second = p.publish("test")
        assert read_table(old.read())["version"] != second.version  # the old file, whole, to its reader
    assert p.table.stat().st_ino != first.st_ino
    slurm_gid = pwd.getpwuid(s.handler.authorizer.trust.slurm_uid).pw_gid
    for path in (p.table, p.gate):  # they name every class's user, job name and comment
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == 0o640 and path.stat().st_gid == slurm_gid, (path, oct(mode), path.stat().st_gid, slurm_gid)
    assert sorted(os.listdir(p.table.parent)) == ["admission.json", "admission.json.gate"]  # no temporary left


def test_an_unchanged_table_keeps_its_version_and_a_change_adds_only_its_templates(svc, slurm_jobs, env):
    s, client = svc
    client.admit(facts(name="a"))
    p = s.admission_publisher
    one = p.publish("test")
    again = p.publish("test")
    assert again.version == one.version and again.reused
    db = sqlite3.connect(str(archive_path(env["SWAPAWARE_SERVICE__DB_PATH"])))
    blobs = db.execute("SELECT COUNT(*) FROM blobs").fetchone()[0]
    client.admit(facts(name="b"))
    two = p.publish("test")
    assert two.version != one.version and not two.reused and two.entries == one.entries + 1
    new_blobs = db.execute("SELECT COUNT(*) FROM blobs").fetchone()[0] - blobs
    assert new_blobs == 1  # the new entry's, its states together
    assert [v for v, _ in s.admission_archive.versions()][:2] == [two.version, one.version]


def test_mode_off_removes_the_table_and_enforce_brings_it_back(svc, slurm_jobs, caplog):
    s, client = svc
    caplog.set_level(logging.INFO, logger="swapaware.admission")
    client.admit(facts(name="a"))
    p = s.admission_publisher
    wait_for(lambda: p.table.exists(), 30.0, "first publication")
    s.handler.set_mode(PolicyMode.OFF)
    wait_for(lambda: not p.table.exists(), 30.0, "table removed")
    s.handler.set_mode(PolicyMode.SHADOW)
    wait_for(lambda: (current_table(s) or {}).get("mode") == "shadow", 30.0, "shadow table")
    entry = table(s)["entries"][admission.table_key(facts(name="a"))]
    for state, decision in entry.items():
        if state != "i":
            assert set(decision["set"]) == {"admin_comment"} and "mode=shadow" in decision["set"]["admin_comment"]
    s.handler.set_mode(PolicyMode.ENFORCE)

    def logged(text):
        return next((i for i, r in enumerate(list(caplog.records))
                     if r.name == "swapaware.admission" and text in r.getMessage()), None)

    # the log line of a publication follows its file: wait for both
    wait_for(lambda: (current_table(s) or {}).get("mode") == "enforce"
             and logged("published (policy.mode is enforce)") is not None, 30.0, "enforce table")
    gone = logged("removed (policy.mode is now enforce)")
    assert gone is not None and gone < logged("published (policy.mode is enforce)")  # shadow's went first


def test_a_key_whose_strings_hold_the_separator_is_not_published(svc, slurm_jobs):
    s, client = svc
    odd = facts(name="a", comment="x\x1fy")
    client.admit(odd)
    client.admit(facts(name="a"))
    s.admission_publisher.publish("test")
    keys = table(s)["entries"]
    assert admission.table_key(facts(name="a")) in keys and admission.table_key(odd) not in keys


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the writer as another user")
def test_a_group_the_service_cannot_give_is_refused_naming_it():
    """A service that is neither root nor in SlurmUser's group writes no table (slurmctld could not
    read it, or every user could): the error says what to change, and no file is left."""
    d = Path(tempfile.mkdtemp(prefix="swapaware-table-"))
    try:
        os.chmod(d, 0o777)
        code = ("import os, sys; from pathlib import Path; "
                "from policy_service.atomic_file import write_atomically as w\n"
                "os.setgroups([]); os.setgid(65534); os.setuid(65534)\n"
                "try:\n    w(Path(sys.argv[1]) / 'admission.json', b'{}', 0o640, int(sys.argv[2]))\n"
                "except PermissionError as e:\n    print(e)\nelse:\n    print('written')")
        gid = pwd.getpwnam("root").pw_gid
        r = subprocess.run([sys.executable, "-c", code, str(d), str(gid)], capture_output=True, text=True, timeout=60,
                           cwd=str(Path(__file__).resolve().parents[3]))
        assert "cannot be given group 0, SlurmUser's" in r.stdout and "run the service as root" in r.stdout, r
        assert os.listdir(d) == []
    finally:
        shutil.rmtree(d)


def body(table_bytes: bytes) -> bytes:
    """A table file less its header (the header names its version and times)."""
    return table_bytes.split(b"\n", 2)[2]


def keys_epoch(p) -> int:
    """What a build depends on of the decisions recorded (the publisher's inputs, as its thread reads them)."""
    p.handler.flush()
    with p._lock:
        return p._depends()[4]


def test_a_class_the_table_holds_decided_again_makes_no_build_due_and_moves_nothing(svc, slurm_jobs):
    """Each table hit's decision comes back as a recorded decision of a class the table holds
    (catch-up): no build is due for it, and a build then writes the same entries under the same
    version, though which class was decided last changed."""
    s, client = svc
    client.admit(facts(name="a"))
    client.admit(facts(name="b"))
    p = s.admission_publisher
    one = p.publish("test")
    first = p.table.read_bytes()
    epoch = keys_epoch(p)
    client.admit(facts(name="a"))  # a is now the class decided last
    assert keys_epoch(p) == epoch
    again = p.publish("test")
    assert (again.version, again.reused, again.entries) == (one.version, True, one.entries)
    assert body(p.table.read_bytes()) == body(first)
    client.admit(facts(name="c"))  # a class the table does not hold
    assert keys_epoch(p) > epoch
    assert p.publish("test").entries == one.entries + 1


def test_classes_past_the_horizon_leave_the_keys_to_publish(svc, slurm_jobs):
    s, client = svc
    client.admit(facts(name="a"))
    p = s.admission_publisher
    p.publish("test")
    epoch = keys_epoch(p)
    now = p.clock()
    p.clock = lambda: now + p.cfg.admission.horizon_s + 60
    assert keys_epoch(p) > epoch
    assert p.publish("test").entries == 0
    assert admission.table_key(facts(name="a")) not in table(s)["entries"]
