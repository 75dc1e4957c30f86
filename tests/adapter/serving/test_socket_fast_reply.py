"""The local socket's fast path for repeated Admits (issue 33, item 6) answers and records exactly
what the path without it does.

``handle_line`` keeps the request of each Admit line it parsed (a hit skips reading JSON and the
size check), and a remembered brief decision's reply line is its template's line with the id put
in (decision_proto.brief_line). Each is compared here with the socket as it was: json.loads, ParseDict,
the handler's message reply, MessageToDict, json.dumps; the same ids and clock on both sides, the
journals' bytes and the history's rows too."""
from __future__ import annotations

import itertools
import json
import random

import grpc
import pytest
from google.protobuf import json_format

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.serving import local_socket
from policy_service.history.store import HistoryStore
from policy_service.serving.local_socket import handle_line
from policy_service.trust.authz import Caller, Verdict
from policy_service.config import PolicyMode, load_config
from policy_service.serving.decision_proto import brief_line
from policy_service.serving.handler import Method, PolicyHandler
from policy_service.serving.handler_error import HandlerError
from policy_service.trust.limits import MAX_REQUEST_BYTES

SLURMCTLD, OTHER = 0, 4242  # the peer uids the fake authorizer records, and answers as a dry run


class Authz:
    """Records slurmctld's Admits (uid 0), dry-runs others', shows a dry run to anyone."""

    def admit(self, caller: Caller) -> Verdict:
        return Verdict(caller.uid == SLURMCTLD, "only uid 0 here")

    def explain(self, caller: Caller, owner=None) -> Verdict:
        return Verdict(True, "all")


def old_handle_line(handler: PolicyHandler, line: bytes, uid: int | None, gid: int | None) -> bytes:
    """handle_line as it was before the fast path (errors aside: the tests send none)."""
    envelope = json.loads(line)
    method = Method.by_name(envelope["method"])
    msg = json_format.ParseDict(envelope.get("request") or {}, method.value[1]())
    reply = method.call(handler, msg, Caller.peer(uid, gid))
    return json.dumps({"response": json_format.MessageToDict(reply)}, separators=(",", ":")).encode() + b"\n"


def facts(i: int) -> dict:
    shapes = ({"tresPerNode": "gres/gpu:1"}, {"tresPerNode": "gres/gpu:a100:1"}, {"tresPerJob": "gres/gpu:1"},
              {"tresPerNode": "gres/gpu:2"}, {"tresPerNode": "gres/shard:2"}, {"tresPerNode": ""})
    return {"user": f"u{i % 3}", "uid": 1000 + i % 3, "account": "proj", "partition": "gpu", "jobName": f"j{i % 4}",
            "scriptFingerprint": f"{i % 5:016x}", "timeLimitMin": 60, "qos": ("", "normal", "high")[i % 3],
            "comment": "swapaware:mem=3G" if i % 7 == 0 else "", "isBatch": True, **shapes[i % len(shapes)]}


def line(i: int, brief: bool = True, dry_run: bool = False) -> bytes:
    req = {"job": facts(i), "brief": brief, "plugin": {"instance": "ctld", "breakerOpen": i % 2, "startedAt": 17}}
    if dry_run:
        req["dryRun"] = True
    return json.dumps({"method": "Admit", "request": req}, separators=(",", ":")).encode() + b"\n"


def handler_at(tmp_path, name: str, ids) -> PolicyHandler:
    cfg = load_config(env={"SWAPAWARE_SERVICE__DB_PATH": str(tmp_path / f"{name}.sqlite3"),
                           "SWAPAWARE_ESTIMATOR__MIN_SAMPLES": "1"})
    h = PolicyHandler(cfg, HistoryStore(tmp_path / f"{name}.sqlite3", accept_empty=True), None,
                      new_id=lambda: next(ids), clock=lambda: 1700000000.25, authorizer=Authz())
    return h


def ids(odd: bool):
    """Hex ids, with now and then one JSON escapes or one that is not letters and digits."""
    for n in itertools.count(1):
        if odd and n % 9 == 0:
            yield f'q"{n:014x}'
        elif odd and n % 13 == 0:
            yield f"-{n:015x}"
        else:
            yield f"{n:016x}"


def history(h: PolicyHandler) -> list:
    h.flush()
    return h.store._read("SELECT decision_id, decided_at, job_class, user, action, shards, keys_json, facts_pb, "
                         "decision_pb FROM decisions ORDER BY rowid")


@pytest.mark.parametrize("odd", [False, True])
def test_fast_replies_records_and_history_are_the_old_ones(tmp_path, odd):
    new, old = handler_at(tmp_path, "new", ids(odd)), handler_at(tmp_path, "old", ids(odd))
    rng = random.Random(6)
    journals = {id(h): [] for h in (new, old)}
    for h in (new, old):
        record = h.decisions.record
        h.decisions.record = lambda rec, note=None, data=None, h=h, record=record: (
            journals[id(h)].append((data or rec.encode(), note)), record(rec, note, data))
    try:
        for n in range(400):
            mode = {150: PolicyMode.SHADOW, 220: PolicyMode.OFF, 250: PolicyMode.ENFORCE}.get(n)
            if mode is not None:
                new.set_mode(mode), old.set_mode(mode)
            sent = line(rng.randrange(12), brief=rng.random() < 0.8, dry_run=rng.random() < 0.05)
            uid = OTHER if rng.random() < 0.05 else SLURMCTLD
            assert handle_line(new, sent, uid, 0) == old_handle_line(old, sent, uid, 0), n
        assert journals[id(new)] == journals[id(old)]
        assert history(new) == history(old)
        assert len(history(new)) > 280
    finally:
        new.close(), old.close()


def test_the_fast_path_is_taken(tmp_path, monkeypatch):
    """Repeated brief Admits are answered from the parsed line and the template's reply line (made
    by the second job of the same facts: the first is decided as it is)."""
    h = handler_at(tmp_path, "h", ids(False))
    try:
        sent = line(3)
        first = json.loads(handle_line(h, sent, SLURMCTLD, 0))["response"]["decision"]
        handle_line(h, sent, SLURMCTLD, 0)
        monkeypatch.setattr(local_socket.json_codec, "parse", lambda *a: pytest.fail("parsed again"))
        monkeypatch.setattr(local_socket.json_codec, "to_dict", lambda *a: pytest.fail("reply built again"))
        for _ in range(3):
            again = json.loads(handle_line(h, sent, SLURMCTLD, 0))["response"]["decision"]
            assert again["decisionId"] != first["decisionId"]
            assert f"id={again['decisionId']}" in again["rewrite"]["adminComment"]
            assert {**again, "decisionId": "", "rewrite": {}} == {**first, "decisionId": "", "rewrite": {}}
    finally:
        h.close()


def test_an_id_seen_elsewhere_in_the_reply_is_never_cut_there(tmp_path):
    h = handler_at(tmp_path, "h", ids(False))
    try:
        d, *_ = h._decide(json_format.ParseDict(facts(1), pb.JobFacts()), queue=None)
    finally:
        h.close()
    assert d.rewrite.admin_comment is not None
    slot, tag = [None], d.decision_id.encode()
    lines = iter([b'{"%s":"%s id=%s"}' % (tag, tag, tag), b'{"other"}'])
    assert brief_line(slot, d, lambda reply: next(lines)) == b'{"%s":"%s id=%s"}' % (tag, tag, tag)
    assert slot == [()]  # three places, not two: every later line is made afresh
    assert brief_line(slot, d, lambda reply: next(lines)) == b'{"other"}'


def test_a_line_is_kept_only_while_it_is_an_admit_within_its_limits(tmp_path, monkeypatch):
    h = handler_at(tmp_path, "h", ids(False))
    monkeypatch.setattr(local_socket, "_PARSED", {})
    try:
        big = json.dumps({"method": "Admit", "request": {"job": {**facts(1), "workDir": "w" * 5000}}}).encode()
        for _ in range(2):  # over its field's limit: refused each time, never kept
            out = json.loads(handle_line(h, big, SLURMCTLD, 0))
            assert out["error"]["code"] == "INVALID_ARGUMENT" and "work_dir is 5000 bytes" in out["error"]["message"]
        event = json.dumps({"method": "JobStarted", "request": {"jobId": 1, "eventId": "s1"}}).encode()
        handle_line(h, event, SLURMCTLD, 0)
        for _ in range(2):  # an event is never kept: another peer is refused it each time
            out = json.loads(handle_line(h, event, OTHER, 0))
            assert out["error"]["code"] == "PERMISSION_DENIED"
        long = json.dumps({"method": "Admit", "request": {"job": {**facts(2), "comment": "c" * 4000,
                                                                  "workDir": "w" * 4000}}}).encode()
        assert "response" in json.loads(handle_line(h, long, SLURMCTLD, 0))
        assert list(local_socket._PARSED) == []  # over PARSED_LINE_MAX bytes: not kept
        monkeypatch.setattr(local_socket, "PARSED_MAX", 3)
        for i in range(5):
            handle_line(h, line(i), SLURMCTLD, 0)
        assert list(local_socket._PARSED) == [line(3), line(4)]  # forgotten all at once when full
        assert len(big) < MAX_REQUEST_BYTES
    finally:
        h.close()


def test_a_kept_line_still_asks_who_sent_it(tmp_path):
    """The same line from another peer: a dry run, recorded nowhere (the authorizer asked each time)."""
    h = handler_at(tmp_path, "h", ids(False))
    try:
        sent = line(5)
        handle_line(h, sent, SLURMCTLD, 0)
        dry = json.loads(handle_line(h, sent, OTHER, 0))["response"]["decision"]
        assert [r["code"] for r in dry["reasons"]][-1] == "dry_run_not_slurmctld"
        h.authorizer.admit = lambda caller: Verdict(False, "refused", grpc.StatusCode.PERMISSION_DENIED)
        out = json.loads(handle_line(h, sent, SLURMCTLD, 0))
        assert out["error"] == {"code": "PERMISSION_DENIED", "message": "Admit refused: refused"}
        assert len(history(h)) == 1
    finally:
        h.close()


def test_a_request_not_checked_before_is_checked_for_size():
    big = pb.AdmitRequest(job=pb.JobFacts(work_dir="w" * 5000))
    with pytest.raises(HandlerError, match="work_dir"):
        Method.ADMIT.call(None, big, None)


def _decisions(rng: random.Random):
    """Decisions with every rewrite field absent, empty or set, and values a message refuses."""
    import dataclasses

    from policy_service.core.types import Action, Decision, DemandEstimate, EstimateSource, Rewrite
    texts = (None, None, "", "gres/shard:2", "caf\u00e9 \"q\" \\", "\ud800", "swapaware:v1 id=0123456789abcdef")
    ints = (None, 0, 7, -3, 2**31 - 1, 2**31, -2**31 - 1, True)
    base = Decision(decision_id="0123456789abcdef", model_version="m", action=Action.SHARE, shards=2, site_factor=0,
                    estimate=DemandEstimate(1, 2, EstimateSource.CLASS, 1, 0), swap_slowdown=1.0, offloaded_bytes=0,
                    risk=0.0, reasons=(), rewrite=Rewrite(), job_class="c", decided_at=1.5)
    for _ in range(3000):
        rewrite = Rewrite(**{f.name: rng.choice(ints if f.name == "site_factor" else texts)
                             for f in dataclasses.fields(Rewrite)})
        yield dataclasses.replace(base, rewrite=rewrite, action=rng.choice(list(Action)),
                                  shards=rng.choice((0, 1, 8, -1, 2**32, 2**32 - 1)),
                                  decision_id=rng.choice(("0123456789abcdef", "", "\udcff", "x")))


def test_a_brief_reply_made_from_the_decision_is_the_messages_json():
    """decision_proto.brief_reply_dict (a decision decided afresh) against the reply message's
    proto3 JSON; None exactly where the message refuses a value (the reply is then made through it)."""
    from policy_service.serving.decision_proto import brief_decision_to_proto, brief_reply_dict
    made = 0
    for d in _decisions(random.Random(5)):
        try:
            want = json_format.MessageToDict(pb.AdmitResponse(decision=brief_decision_to_proto(d)))
        except (ValueError, TypeError):
            want = None
        got = brief_reply_dict(d)
        if got is None:
            assert want is None or d.rewrite.site_factor is True, d  # (True: a bool the message takes as 1)
            continue
        made += 1
        assert want is not None, d
        assert json.dumps(got) == json.dumps(want), d  # the same keys, in the same order
    assert made > 300
