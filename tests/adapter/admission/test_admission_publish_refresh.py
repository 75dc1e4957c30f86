"""The admission table publisher's refresh: every valid_s / 2 the table is published again under
a new valid_until. When nothing a build depends on changed, no key is decided again and the file's
body is written as it was; when something changed, when the last build could not decide a key, or
when the file was removed since, the refresh is a build. And builds: spaced by refresh_s, or by
what the last one cost.

The fixtures and helpers (env, svc, table...) are test_admission_publish.py's."""
import pytest

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.core import admission
from policy_service.core.admission_format import read_table

from tests.adapter.conftest import served
from tests.adapter.serving.test_service import GIB, facts, run_job
from tests.adapter.admission.test_admission_publish import body, env, svc, table  # noqa: F401 (env, svc: fixtures)


def counting(p, monkeypatch) -> list:
    """The keys the publisher decides from now on (each call of its _decisions)."""
    decided, decide = [], p._decisions

    def count(key, *args):
        decided.append(key)
        return decide(key, *args)
    monkeypatch.setattr(p, "_decisions", count)
    return decided


def built(p):
    """A build now, the decisions handed out so far in the history first (as the thread's ticks
    find them: what the build depends on is read before it)."""
    p.handler.flush()
    with p._lock:
        return p.publish("test")


def refresh_due(p) -> None:
    """One tick of the publisher's thread once valid_s / 2 has passed since its last publication
    (under its lock: the thread's own ticks wait)."""
    p.handler.flush()  # the decisions handed out so far are in the history
    with p._lock:
        p._published_at -= p.cfg.admission.valid_s
        p.tick()


def test_a_refresh_with_nothing_changed_decides_no_key_and_writes_the_same_body(svc, slurm_jobs, monkeypatch):
    s, client = svc
    client.admit(facts(name="a"))
    client.admit(facts(name="b"))
    p = s.admission_publisher
    one = built(p)
    first = p.table.read_bytes()
    decided = counting(p, monkeypatch)
    refresh_due(p)
    again = p.table.read_bytes()
    assert decided == [] and (p.last.version, p.last.reused, p.last.entries) == (one.version, True, one.entries)
    assert body(again) == body(first) and p.last.bytes == len(again)
    assert read_table(again)["valid_until"] > read_table(first)["valid_until"]
    client.admit(facts(name="c"))  # a class the table does not hold: the next refresh is a build
    refresh_due(p)
    assert decided and p.last.entries == one.entries + 1 and p.last.version != one.version


def test_a_refresh_after_a_key_was_left_out_or_the_file_removed_is_a_build(svc, slurm_jobs, monkeypatch):
    s, client = svc
    client.admit(facts(name="a"))
    client.admit(facts(name="odd"))
    p = s.admission_publisher
    decide, odd = p.handler._decide, facts(name="odd")

    def failing_once(f, **kw):
        if f.job_name == "odd" and not failed:
            failed.append(1)
            raise RuntimeError("one odd record")
        return decide(f, **kw)
    failed: list = []
    p.handler.flush()
    with p._lock:  # (the thread's ticks wait)
        monkeypatch.setattr(p.handler, "_decide", failing_once)
        p._known.clear()
        p.publish("test")
    assert failed and admission.table_key(odd) not in table(s)["entries"]
    decided = counting(p, monkeypatch)
    refresh_due(p)  # the key left out is decided again
    assert admission.table_key(odd) in decided and admission.table_key(odd) in table(s)["entries"]
    decided.clear()
    refresh_due(p)
    assert decided == []
    with p._lock, p._file_lock:  # as a drop whose write failed leaves it
        p._unlink_table()
    refresh_due(p)
    assert decided and admission.table_key(odd) in table(s)["entries"]


def test_a_refresh_leaves_out_a_class_that_learned_while_it_ran(svc, slurm_jobs, monkeypatch):
    """An observation acknowledged after the refresh found nothing changed, before it wrote: the
    class's entry is not in the file it writes."""
    s, client = svc
    job = facts(name="racing")
    # bob's job reads no key of alice's (another account and partition): her run leaves it in
    other = pb.JobFacts(user="bob", account="bobs", partition="gpu2", job_name="bystander",
                        tres_per_node="gres:gpu:1", script_fingerprint="00000001deadbeef")
    client.admit(job)
    client.admit(other)
    p = s.admission_publisher
    version = built(p).version
    touch, learned = p.archive.touch, []

    def touch_then_learn(v):
        touch(v)
        if not learned:
            learned.append(run_job(client, slurm_jobs, 8, job, peak=2 * GIB)[1].applied)
    monkeypatch.setattr(p.archive, "touch", touch_then_learn)
    decided = counting(p, monkeypatch)
    refresh_due(p)
    entries = table(s)["entries"]
    assert learned == [True] and decided == [] and p.last.version == version
    assert admission.table_key(job) not in entries and admission.table_key(other) in entries


def test_builds_are_spaced_by_refresh_s_or_by_what_the_last_cost():
    """A cheap build may follow the last after refresh_s; a costly one waits until builds take
    BUILD_SHARE of the time, never more than BUILD_WAIT_MAX_S (or refresh_s, where longer)."""
    import types

    from policy_service.admission.publish import BUILD_SHARE, BUILD_WAIT_MAX_S, AdmissionPublisher
    from policy_service.config import load_config

    def every(refresh_s, cpu):
        cfg = load_config(env={"SWAPAWARE_ADMISSION__REFRESH_S": str(refresh_s)})
        return AdmissionPublisher._build_every(types.SimpleNamespace(cfg=cfg, _build_cpu=cpu))
    assert load_config(env={}).admission.refresh_s == 5.0
    assert every(5, 0.01) == 5.0                        # a small table: refresh_s
    assert every(5, 0.2) == pytest.approx(0.2 / BUILD_SHARE) == pytest.approx(10.0)  # 10,000 keys
    assert every(5, 2.6) == BUILD_WAIT_MAX_S == 30.0    # 100,000 keys: no longer than before
    assert every(60, 2.6) == 60.0                       # a site's longer refresh_s stands


def test_a_build_records_its_cpu_time(svc, slurm_jobs):
    s, client = svc
    client.admit(facts(name="a"))
    p = s.admission_publisher
    p._build_cpu = -1.0
    built(p)
    assert 0.0 < p._build_cpu < 30.0
    cpu = p._build_cpu
    refresh_due(p)  # a refresh is no build: it leaves the figure
    assert p._build_cpu == cpu


@pytest.fixture
def svc_whole3(env, slurm_jobs, tmp_path):
    """The service with estimator.min_samples 3 (the default): a class stays whole for its first 3 runs."""
    (tmp_path / "run").mkdir()
    with served(dict(env, SWAPAWARE_ESTIMATOR__MIN_SAMPLES="3"), slurm_jobs) as sc:
        yield sc


def test_an_entry_decided_again_alike_but_for_its_reasons_is_another_version(svc_whole3, slurm_jobs):
    """A class's first observed run leaves it whole ("1 so far" where it said "0 so far"): the file's
    decision is the same, its archived template is not. The build publishes another version, and
    the template a table-made decision is recorded from says what the run taught."""
    s, client = svc_whole3
    job = facts(name="stays-whole")
    client.admit(job)
    p = s.admission_publisher
    key = admission.table_key(job)
    one = built(p)
    before = table(s)["entries"][key]
    run_job(client, slurm_jobs, 7, job, peak=2 * GIB)  # observed: the class learned one run
    two = built(p)
    after = table(s)["entries"][key]
    assert two.version != one.version and not two.reused
    assert repr(after).replace(two.version, "V") == repr(before).replace(one.version, "V")  # the same decision
    for state in (st for st in after if st != "i"):
        tpl = s.admission_archive.lookup(two.version, after["i"], state)
        said = " ".join(r.message for r in pb.Decision.FromString(tpl.decision_pb).reasons)
        assert "(1 so far)" in said and "(0 so far)" not in said, said
