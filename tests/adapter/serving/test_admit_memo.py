"""What Admit remembers between calls (issue 33, item 6) decides exactly as deciding afresh does.

PolicyHandler remembers per job facts the request it builds and, from their second job on, the
decision it last made (with a placeholder id, handed out with the real id put in), HistoryStore the checked statistics per stored
text, and the decision's record reuses the template's message. Each is compared here with what
the code without them gives: ``policy.decide`` called directly with the snapshot itself, the
record's message built field by field, ``checked_stats`` of the text."""
from __future__ import annotations

import dataclasses
import itertools
import json
import random

import pytest

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.history.store import HistoryStore
from policy_service.history.schema import checked_stats
from policy_service.config import load_config
from policy_service.core import policy
from policy_service.core.types import ClassStats, KeyLevel, LiveShards, QueueState, UserFigure
from policy_service.history.journal_records import NoteText, RecordText
from policy_service.serving.decision_proto import decision_record, decision_to_proto, with_id_bytes
from policy_service.serving.handler import PolicyHandler

GIB = 1024 ** 3
SHAPES = ({"tres_per_node": "gres:gpu:1"}, {"tres_per_node": "gres:gpu:a100:1"}, {"tres_per_job": "gres:gpu:1"},
          {"tres_per_node": "gres:gpu:2"}, {"tres_per_node": "gres:shard:2"}, {"tres_per_node": ""},
          {"tres_per_task": "gres:gpu:1", "num_tasks": 1}, {"tres_per_node": "gres:gpu:1", "exclusive": "node"})


def facts(i: int) -> pb.JobFacts:
    job = pb.JobFacts(user=f"u{i % 3}", uid=1000 + i % 3, account="proj", partition="gpu", job_name=f"j{i % 4}",
                      script_fingerprint=f"{i % 5:016x}", time_limit_min=60, qos=("", "normal", "high")[i % 3],
                      comment="swapaware:mem=3G" if i % 7 == 0 else "", is_batch=i % 11 != 0, **SHAPES[i % len(SHAPES)])
    return job


def stats_for(rng: random.Random) -> dict[KeyLevel, ClassStats]:
    out = {}
    for level in KeyLevel:
        if rng.random() < 0.3:
            continue
        n = rng.randrange(0, 6)
        peaks = tuple(int(rng.uniform(1, 30) * GIB) for _ in range(n))
        out[level] = ClassStats(samples=n, runs=n, ewma_peak_bytes=float(sum(peaks) / n) if n else 0.0,
                                ewma_absdev_bytes=float(GIB / 4), max_peak_bytes=max(peaks, default=0),
                                last_peak_bytes=peaks[-1] if peaks else 0, oom_count=rng.randrange(2),
                                whole_gpu_runs_left=rng.choice((0, 0, 0, 2)), recent_ratios=(1.0, 1.1)[:n],
                                recent_peaks=peaks[-2:], util_runs=rng.randrange(3), ewma_solo_util=rng.random(),
                                users=(UserFigure("u0", n, max(peaks, default=0)),) if level in
                                (KeyLevel.ACCOUNT, KeyLevel.PARTITION) else ())
    return out


QUEUES = (None, QueueState(0.0, 8), QueueState(3.0, 8, age_s=1.0), QueueState(3.0, 8, age_s=100.0),
          QueueState(1.0, 8, ahead_by_qos=(("high", 0.0), ("normal", 1.0))),
          QueueState(9.0, 8, live_shards=LiveShards({"n1": {"a100": 0}})))


@pytest.fixture
def handler():
    cfg = load_config(env={"SWAPAWARE_POLICY__SHARE_MIN_QUEUE": "0.25", "SWAPAWARE_POLICY__COMPUTE_AWARE": "true",
                           "SWAPAWARE_POLICY__OVERCOMMIT_COMPUTE_MIN_QUEUE": "0.75",
                           "SWAPAWARE_ESTIMATOR__MIN_SAMPLES": "1"})
    ids = (f"{n:016x}" for n in itertools.count(1))
    h = PolicyHandler(cfg, HistoryStore(":memory:"), None, new_id=lambda: next(ids), clock=lambda: 1700000000.5)
    yield h
    h.close()


def direct(h: PolicyHandler, job: pb.JobFacts, stats, queue, d_id: str, replaces: str = ""):
    """What _decide gave before it remembered anything."""
    jr, access, fields, keys, _ = h._request(job, queue)
    return policy.decide(jr, stats, h.cfg, decision_id=d_id, now=h.clock(), job_class=keys[KeyLevel.CLASS],
                         gres_fields=fields, access=access, queue=queue, replaces=replaces, dialect=h.dialect,
                         enforcement=h.node_enforcement.view(h.clock(), h.cfg.policy.enforcement_max_age_s))


def test_a_remembered_decision_is_the_one_decided_afresh(handler):
    rng = random.Random(33)
    stats_pool = [stats_for(rng) for _ in range(6)]
    hits = 0
    for n in range(600):
        job, stats, queue = facts(rng.randrange(40)), rng.choice(stats_pool), rng.choice(QUEUES)
        replaces = rng.choice(("", "", "00000000000000ab"))
        slot = handler._request(job, queue)[4]
        hits += slot[0] is not None
        d, jr, keys, made = handler._decide_made(job, replaces, queue=queue, stats_of=lambda _k, s=stats: s)
        assert d == direct(handler, job, stats, queue, d.decision_id, replaces), n
        if made is not None:  # the record's message: the template's, id, time and comment put in
            pb_bytes = with_id_bytes(decision_to_proto(made[2]).SerializeToString(), d)
            assert pb_bytes == decision_to_proto(d).SerializeToString()
            text = RecordText(decision_record(made[2], jr, keys, job))  # and the journal's record
            assert text.usable
            assert text.encode(d.decision_id, d.decided_at, pb_bytes) == decision_record(d, jr, keys, job).encode()
    assert hits > 300  # most of them were remembered


def test_the_journal_holds_what_it_held_before(tmp_path):
    """Admits through the remembered path: every journal record is what encode() makes of the
    record, and the history holds each decision's own message."""
    cfg = load_config(env={"SWAPAWARE_SERVICE__DB_PATH": str(tmp_path / "h.sqlite3")})
    store = HistoryStore(tmp_path / "h.sqlite3", accept_empty=True)
    try:
        for clock in (lambda: 1700000000.25, lambda: 1700000000):  # a float, and an int from a test's clock
            h = PolicyHandler(cfg, store, None, clock=clock)
            seen = []
            record = h.decisions.record
            h.decisions.record = lambda rec, note=None, data=None: (seen.append((rec, note, data)),
                                                                    record(rec, note, data))
            try:
                replies = [h.admit(pb.AdmitRequest(job=facts(n % 3), brief=True)).decision for n in range(12)]
            finally:
                h.close()
            assert sum(data is not None for _, _, data in seen) >= 9  # the remembered path, mostly
            assert sum(type(note) is str for _, note, _ in seen) >= 9  # its log line's JSON made from the template's
            first = {n: seen[n][1] for n in range(3)}  # each facts' first note: a dict, decided afresh
            for n, ((rec, note, data), reply) in enumerate(zip(seen, replies)):
                assert data is None or data == rec.encode()
                logged = note if type(note) is str else json.dumps(note, sort_keys=True)  # what the writer logs
                assert logged == json.dumps({**first[n % 3], "decision_id": rec.decision_id}, sort_keys=True)
                assert json.loads(logged)["decision_id"] == rec.decision_id == reply.decision_id
                row = store.decision(rec.decision_id)
                assert row.decision.decision_id == rec.decision_id and row.decision.decided_at == clock()
                assert row.decision.rewrite.admin_comment == reply.rewrite.admin_comment
                assert f"id={rec.decision_id}" in reply.rewrite.admin_comment
    finally:
        store.close()


def test_an_id_the_template_cannot_take_is_decided_afresh(handler):
    job = facts(1)
    for d_id in ("short", "x" * 40, "0" * 16, "IDIDIDIDIDIDIDID"):
        d, *_ = handler._decide(job, decision_id=d_id, queue=None, stats_of=lambda _k: {})
        assert d == direct(handler, job, {}, None, d_id)
        assert d.decision_id == d_id


def test_a_comment_cut_inside_the_id_is_decided_afresh():
    cfg = load_config(env={})  # (a config refuses fewer than 80 characters: made here as one that did not)
    cfg = dataclasses.replace(cfg, policy=dataclasses.replace(cfg.policy, admin_comment_max_chars=20))
    h = PolicyHandler(cfg, HistoryStore(":memory:"), None, clock=lambda: 5.0)
    try:
        for _ in range(3):
            d, *_ = h._decide(facts(1), queue=None, stats_of=lambda _k: {})
            assert d.rewrite.admin_comment == f"swapaware:v1 id={d.decision_id}"[:20]
            assert d == direct(h, facts(1), {}, None, d.decision_id)
    finally:
        h.close()


@pytest.fixture
def decide_calls(monkeypatch):
    """The decision id of each policy.decide call the handler makes (the placeholder: a template)."""
    calls: list[str] = []
    decide = policy.decide

    def counted(*a, **k):
        calls.append(k["decision_id"])
        return decide(*a, **k)

    monkeypatch.setattr(policy, "decide", counted)
    return calls


def test_new_statistics_objects_are_decided_afresh(handler, decide_calls):
    job, calls = facts(2), decide_calls
    one = {KeyLevel.CLASS: ClassStats(samples=3, runs=3, ewma_peak_bytes=2.0 * GIB, max_peak_bytes=2 * GIB)}
    handler._decide(job, queue=None, stats_of=lambda _k: one)  # first seen: decided as it is
    handler._decide(job, queue=None, stats_of=lambda _k: one)  # seen again: the template made
    handler._decide(job, queue=None, stats_of=lambda _k: one)
    assert len(calls) == 2
    equal = {KeyLevel.CLASS: ClassStats(samples=3, runs=3, ewma_peak_bytes=2.0 * GIB, max_peak_bytes=2 * GIB)}
    handler._decide(job, queue=None, stats_of=lambda _k: equal)  # another object: not taken for the same
    assert len(calls) == 3
    handler._decide(job, queue=QueueState(0.0, 8), stats_of=lambda _k: equal)
    assert len(calls) == 4
    handler._decide(job, queue=QueueState(0.0, 8, age_s=2.0), stats_of=lambda _k: equal)  # same figures, fresh
    assert len(calls) == 4


def test_facts_seen_once_are_decided_as_they_are_and_remembered_from_their_second_job(handler, decide_calls):
    """A new class's first job is decided with its own id and time, no template made (most classes'
    later jobs meet the admission table); its second job makes the template, the third reuses it."""
    job, stats = facts(3), {}
    made_of = [handler._decide_made(job, queue=None, stats_of=lambda _k: stats) for _ in range(3)]
    assert [m is None for *_, m in made_of] == [True, False, False]
    assert decide_calls == [made_of[0][0].decision_id, "0" * 16]  # the first with its id, then the template
    for d, *_ in made_of:
        assert d == direct(handler, job, stats, None, d.decision_id)


def test_checked_statistics_are_remembered_per_text(tmp_path):
    store = HistoryStore(tmp_path / "h.sqlite3", accept_empty=True)
    try:
        good = '{"samples": 3, "runs": 3, "ewma_peak_bytes": 1000.0, "max_peak_bytes": 1000}'
        bad = '{"samples": -4, "ewma_peak_bytes": "x", "recent_peaks": [1, "y", 2]}'
        with store._lock:
            store._conn.execute("INSERT INTO class_stats VALUES ('class','a',?,0),('class','b',?,0)", (good, bad))
        for _ in range(2):
            a = store.stats({KeyLevel.CLASS: "a"})[KeyLevel.CLASS]
            assert a == checked_stats(good)[0]
            assert store.stats({KeyLevel.CLASS: "b"})[KeyLevel.CLASS] == checked_stats(bad)[0]
        assert store.stats({KeyLevel.CLASS: "a"})[KeyLevel.CLASS] is a  # one object per text
        with store._lock:
            store._conn.execute("UPDATE class_stats SET stats_json=? WHERE key='a'", ('{"samples": 5}',))
        assert store.stats({KeyLevel.CLASS: "a"})[KeyLevel.CLASS] == checked_stats('{"samples": 5}')[0]
    finally:
        store.close()


@pytest.mark.parametrize("note", [
    {"decision_id": "x", "user": "alice", "reasons": ["no_history"], "peak_bytes": 3, "site_factor": 1.5},
    {"decision_id": "x", "job_name": "tr\u00e4in \"q\" \\n", "request": "gres/gpu:1", "shards": None},
    {"decision_id": "x", "job_name": "swapaware-record-id-marker"},  # the marker itself: not usable
])
def test_a_note_text_is_the_json_of_its_note(note):
    text = NoteText(note)
    if "swapaware-record-id-marker" in note.values():
        assert not text.usable
        return
    assert text.usable
    for d_id in ("0123456789abcdef", "caf\u00e9", 'a"b'):
        assert text.text(d_id) == json.dumps({**note, "decision_id": d_id}, sort_keys=True)
