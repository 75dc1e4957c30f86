"""The admission table publisher through the real service (real gRPC, real SQLite, real files),
with the Slurm stand-in holding the pending queue: the table's decision for a key is what Admit
answers for the same facts in the gate state the gate file names."""
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
import time
from pathlib import Path

import pytest

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.admission.archive import archive_path
from policy_service.slurm.slurm import PendingJob
from policy_service.serving.client import PolicyClient
from policy_service.config import PolicyMode, load_config
from policy_service.core import admission
from policy_service.core.admission_format import read_table
from policy_service.core.policy import parse_admin_comment
from policy_service.serving.server import start_service
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
    s = start_service(load_config(env=env), slurm=slurm_jobs)
    try:
        with PolicyClient(f"127.0.0.1:{s.grpc_port}", 5.0) as c:
            yield s, c
    finally:
        s.stop(0)


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


def test_a_key_is_decided_again_once_its_class_learned_and_others_are_kept(svc, slurm_jobs):
    s, client = svc
    slurm_jobs.pending = queued(2)  # "normal": a learned class shares
    job = facts(name="fresh")
    # bob's job has no history at all: its decision read every key of his, none of them alice's
    other = pb.JobFacts(user="bob", account="bobs", partition="gpu2", job_name="bystander",
                        tres_per_node="gres:gpu:1", script_fingerprint="00000001deadbeef")
    same_account = facts(name="neighbour", user="carol")  # carol's read account "proj", which alice's run taught
    client.admit(job)
    client.admit(other)
    client.admit(same_account)
    p = s.admission_publisher
    p.publish("test")
    before = table(s)["entries"]
    assert parse_admin_comment(before[admission.table_key(job)]["*"]["set"]["admin_comment"])["action"] == "whole_gpu"
    kept = p._known[admission.table_key(other)]
    neighbour = p._known[admission.table_key(same_account)]
    run_job(client, slurm_jobs, 7, job, peak=2 * GIB)  # the class learns one run (min_samples 1 here)
    wait_for(lambda: gate_state(s) == "normal", 30.0, "gate normal")
    p.publish("test")
    entry = table(s)["entries"][admission.table_key(job)]
    decision = entry.get("normal", entry.get("*"))
    rpc = client.admit(job, dry_run=True).decision
    assert rpc.action == pb.ACTION_SHARE and table_set(decision) == rpc_set(rpc)
    assert p._known[admission.table_key(other)] is kept  # bob's key read nothing alice's run changed
    assert p._known[admission.table_key(same_account)] is not neighbour


def test_an_acknowledged_observation_drops_its_class_from_the_table_at_once(svc, slurm_jobs):
    """Between an observation and the next build (refresh_s, 1000 s here) the table answers nothing
    for the classes that learned: the moment JobFinished has answered, their entries are gone from
    the file and their jobs take the round trip; entries that read nothing it taught stay, under
    the same version."""
    s, client = svc
    job, other = facts(name="fresh"), pb.JobFacts(user="bob", account="bobs", partition="gpu2", job_name="bystander",
                                                   tres_per_node="gres:gpu:1", script_fingerprint="00000001deadbeef")
    client.admit(job)
    client.admit(other)
    p = s.admission_publisher
    version = p.publish("test").version
    key, other_key = admission.table_key(job), admission.table_key(other)
    assert {key, other_key} <= set(table(s)["entries"])
    _, finished = run_job(client, slurm_jobs, 7, job, peak=2 * GIB)  # answered: the drop is done
    assert finished.applied
    after = table(s)
    assert key not in after["entries"] and other_key in after["entries"] and after["version"] == version
    written = p.table.stat().st_ino
    with p.learning(()):  # nothing named: nothing rewritten
        pass
    assert p.table.stat().st_ino == written
    p.publish("test")  # the next build decides the class again, from what it learned
    assert key in table(s)["entries"]


def test_a_table_this_process_did_not_write_goes_at_the_first_observation(svc, slurm_jobs):
    """After a restart the file is the last process's (or, after a role change, the last
    writer's): nothing in this process says which of its entries an observation taught, so the
    first observation removes it; the next build publishes again."""
    s, client = svc
    job = facts(name="inherited")
    client.admit(job)
    p = s.admission_publisher
    # the publications here are the test's own: a background tick after became_writer would build
    # again ("this service is now the writer") between the observation and the check (a fresh-clone
    # run with the unit tests beside the suites saw the table back)
    p.stop()
    p.publish("test")
    p.became_writer(True)  # the file may be another writer's from now on
    assert p.table.exists()
    assert run_job(client, slurm_jobs, 9, job, peak=2 * GIB)[1].applied
    assert not p.table.exists()
    p.publish("test")
    assert admission.table_key(job) in table(s)["entries"]


def test_events_wait_until_the_table_and_its_catch_up_are_attached(env, slurm_jobs, tmp_path, monkeypatch):
    """The gRPC port serves before the catch-up is attached: an event taken then could miss its
    table-made decision or leave its class in the table. It is refused as a standby refuses one
    (the hooks spool it), and taken once the service has started."""
    import grpc

    from policy_service.serving import server
    from policy_service.serving.handler import Method
    from policy_service.serving.handler_error import HandlerError

    seen = []
    attach = server.attach_catchup

    def attach_after_an_event(handler, *args, **kwargs):
        fin = pb.JobFinishedRequest(job_id=77, node="n1", gpu_indices=[0], finished_at=1100.0, exit_code=0,
                                    event_id="f77", telemetry_source="none")
        try:
            Method.JOB_FINISHED.call(handler, fin)
        except HandlerError as exc:
            seen.append((exc.code, exc.message))
        return attach(handler, *args, **kwargs)

    monkeypatch.setattr(server, "attach_catchup", attach_after_an_event)
    (tmp_path / "run").mkdir()
    s = start_service(load_config(env=env), slurm=slurm_jobs)
    try:
        assert seen and seen[0][0] is grpc.StatusCode.UNAVAILABLE and "starting" in seen[0][1]
        assert s.handler.standby is None  # started: events are taken
    finally:
        s.stop(0)


def test_a_build_leaves_out_what_was_learned_while_it_decided(svc, slurm_jobs, monkeypatch):
    """An observation acknowledged while a build is deciding its keys (after it decided the class,
    before it writes) does not reach the file through that build."""
    s, client = svc
    job = facts(name="racing")
    client.admit(job)
    p = s.admission_publisher
    p.publish("test")
    key = admission.table_key(job)
    decide = p._decisions
    learned_during = []

    def decide_then_learn(k, *args):
        known = decide(k, *args)
        if k == key and not learned_during:
            learned_during.append(run_job(client, slurm_jobs, 8, job, peak=2 * GIB)[1].applied)
        return known
    monkeypatch.setattr(p, "_decisions", decide_then_learn)
    p.publish("test: a run of the class ends meanwhile")
    assert learned_during == [True] and key not in table(s)["entries"]


def test_the_gate_file_follows_each_queue_poll_at_once(env, slurm_jobs, tmp_path):
    (tmp_path / "run").mkdir()
    # the monitor's own polls 300 s apart: only the test's poll moves the snapshot
    s = start_service(load_config(env=dict(env, SWAPAWARE_POLICY__QUEUE_POLL_S="300")), slurm=slurm_jobs)
    try:
        p = s.admission_publisher
        wait_for(lambda: p.gate.exists(), 30.0, "first gate file")
        first = json.loads(p.gate.read_text())
        assert first["other"] == "short"  # the first snapshot: nothing waits
        slurm_jobs.pending = queued(2)
        s.queue_monitor.poll_once()  # returns once the gate file is written (on_poll)
        gate = json.loads(p.gate.read_text())
        assert gate["other"] == "normal" and gate["valid_until"] > first["valid_until"]
        assert gate["valid_until"] == pytest.approx(time.time() + 900.0, abs=2.0)
    finally:
        s.stop(0)


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


def test_the_gate_sends_jobs_to_the_rpc_path_while_the_controller_refuses_shards(env, slurm_jobs, tmp_path):
    """The table's decisions assume every GPU of the fleet takes shard jobs; while the controller in
    control refuses them somewhere (a 22.05 backup after scontrol takeover), the gate says so and
    the plugin asks the service, which reads the live counts."""
    (tmp_path / "run").mkdir()
    conf = Path(env["SWAPAWARE_SERVICE__SLURM_CONF"])
    conf.write_text("NodeName=n1 CPUs=8 Gres=gpu:a100:2,shard:16\nPartitionName=gpu Nodes=n1 Default=YES\n")
    (conf.parent / "gres.conf").write_text("Name=gpu Type=a100 File=/dev/nvidia[0-1]\n"
                                           "Name=shard Count=8 File=/dev/nvidia0\nName=shard Count=8 File=/dev/nvidia1\n")
    slurm_jobs.node_shards = {"n1": {"a100": 16}}
    s = start_service(load_config(env=dict(env, SWAPAWARE_POLICY__QUEUE_POLL_S="300")), slurm=slurm_jobs)
    try:
        p = s.admission_publisher
        wait_for(lambda: p.gate.exists(), 30.0, "first gate file")
        # a gate written while the service was starting may send jobs the round trip: a starting
        # service counts as standby, and on 22.05's dialect a standby has not read the shards of the
        # controller in control (so the table built meanwhile is not used); the first poll once
        # serving writes the gate as serving
        s.queue_monitor.poll_once()
        assert "rpc_only" not in json.loads(p.gate.read_text())
        assert "controller" not in json.loads(p.gate.read_text())  # [ha] off: one controller
        slurm_jobs.node_shards = {"n1": {"a100": 0}}
        s.queue_monitor.poll_once()  # returns once the gate file is written (on_poll)
        gate = json.loads(p.gate.read_text())
        assert gate["rpc_only"] == ("the controller refuses shards on 1 node(s): n1: the controller in control "
                                    "reports 0 a100 shards"), gate
        slurm_jobs.node_shards = {"n1": {"a100": 16}}
        s.queue_monitor.poll_once()
        assert "rpc_only" not in json.loads(p.gate.read_text())
        # after a slurmctld restart or reconfigure (24.11+): typed counts shown, State=UNKNOWN
        slurm_jobs.node_unregistered = {"n1"}
        s.queue_monitor.poll_once()
        assert "n1: the node has not registered with the controller" in json.loads(p.gate.read_text())["rpc_only"]
        slurm_jobs.node_unregistered = set()
        s.queue_monitor.poll_once()
        assert "rpc_only" not in json.loads(p.gate.read_text())
    finally:
        s.stop(0)


def test_a_stopped_publisher_writes_no_gate_after_the_queue_polls(env, slurm_jobs, tmp_path):
    """The queue monitor outlives the publisher while a service stops: its polls must not rewrite
    the gate file of a publisher that stopped (the plugin then ages it out by valid_until)."""
    (tmp_path / "run").mkdir()
    s = start_service(load_config(env=dict(env, SWAPAWARE_POLICY__QUEUE_POLL_S="300")), slurm=slurm_jobs)
    try:
        p = s.admission_publisher
        wait_for(lambda: p.gate.exists(), 30.0, "first gate file")
        p.stop()
        before = p.gate.read_bytes()
        slurm_jobs.pending = queued(2)
        s.queue_monitor.poll_once()  # a new snapshot (normal, no longer short): no gate file for it
        assert s.queue_monitor.snapshot().pending_gpus == 2.0
        assert p.gate.read_bytes() == before
    finally:
        s.stop(0)


def test_the_table_is_built_only_once_the_service_serves(env, slurm_jobs, tmp_path, monkeypatch):
    """A starting service counts as standby (events wait until the catch-up is attached), and on
    22.05's dialect a standby has not read the controller's shards: a table built then holds every
    shard refused (whole_gpu, shards_refused), which the plugin would use once the gate lets it. So
    the publisher starts building once the service serves. (A fresh-clone run whose first build fell
    in the starting window failed test_queue_rule: every job of a learned class kept whole.)"""
    from policy_service.admission.publish import AdmissionPublisher

    (tmp_path / "run").mkdir()
    seen: list = []
    started = AdmissionPublisher.start

    def start(self):
        seen.append(self.handler.standby() if self.handler.standby is not None else None)
        return started(self)
    monkeypatch.setattr(AdmissionPublisher, "start", start)
    s = start_service(load_config(env=env), slurm=slurm_jobs)
    try:
        assert s.handler.dialect.takeover_zero_shards  # (the tests' release: 22.05)
        assert seen == [None]  # serving, not "the service is starting ..."
        wait_for(lambda: s.admission_publisher.table.exists(), 30.0, "the first table")
    finally:
        s.stop(0)
