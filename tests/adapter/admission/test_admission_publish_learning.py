"""The admission table publisher, learning: a key decided again once its class learned (others kept),
an acknowledged observation dropping its class from the file at once, a table this process did not
write going at the first observation, and a build leaving out what was learned while it decided.

The fixtures and helpers (env, svc, table...) are test_admission_publish.py's."""
from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.core import admission
from policy_service.core.policy import parse_admin_comment
from tests.waiting import wait_for

from tests.adapter.serving.test_service import GIB, facts, run_job
from tests.adapter.admission.test_admission_publish import (env, gate_state, queued, rpc_set, svc,  # noqa: F401
                                                            table, table_set)  # (env, svc: fixtures)


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
