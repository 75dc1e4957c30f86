"""The local socket's fast proto3 JSON path gives exactly what json_format gives."""
from __future__ import annotations

import json

import pytest
from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.serving import json_codec

MESSAGES = [getattr(pb, name) for name in pb.DESCRIPTOR.message_types_by_name]
INTS = {F.TYPE_INT32: (-2**31, 2**31 - 1), F.TYPE_UINT32: (0, 2**32 - 1), F.TYPE_INT64: (-2**63, 2**63 - 1),
        F.TYPE_UINT64: (0, 2**64 - 1), F.TYPE_SINT32: (-2**31, 2**31 - 1), F.TYPE_SINT64: (-2**63, 2**63 - 1),
        F.TYPE_FIXED32: (0, 2**32 - 1), F.TYPE_FIXED64: (0, 2**64 - 1)}


def _repeated(f) -> bool:
    flag = getattr(f, "is_repeated", None)
    return bool(flag) if flag is not None else f.label == F.LABEL_REPEATED


def value_of(f, depth: int):
    if f.type == F.TYPE_MESSAGE:
        return message_of(f.message_type, depth + 1)
    if f.type in INTS:
        return st.integers(*INTS[f.type])
    if f.type == F.TYPE_ENUM:
        return st.sampled_from([v.number for v in f.enum_type.values])
    return {F.TYPE_STRING: st.text(max_size=12), F.TYPE_BOOL: st.booleans(), F.TYPE_BYTES: st.binary(max_size=8),
            F.TYPE_DOUBLE: st.floats(allow_nan=True, allow_infinity=True),
            F.TYPE_FLOAT: st.floats(width=32)}[f.type]


def message_of(desc, depth: int = 0):
    """Messages of type ``desc`` with any subset of their fields set to any value."""
    if depth > 3:
        return st.just(desc._concrete_class())

    def build(values: dict):
        msg = desc._concrete_class()
        for name, v in values.items():
            f = desc.fields_by_name[name]
            if _repeated(f):
                target = getattr(msg, name)
                target.extend(v) if f.type != F.TYPE_MESSAGE else [target.add().CopyFrom(x) for x in v]
            elif f.type == F.TYPE_MESSAGE:
                getattr(msg, name).CopyFrom(v)
            else:
                setattr(msg, name, v)
        return msg

    fields = {f.name: (st.lists(value_of(f, depth), max_size=3) if _repeated(f) else value_of(f, depth))
              for f in desc.fields}
    return st.fixed_dictionaries({}, optional=fields).map(build)


any_message = st.one_of([message_of(m.DESCRIPTOR) for m in MESSAGES])


def _same(a, b) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(any_message)
def test_to_dict_equals_json_format(msg):
    assert _same(json_codec.to_dict(msg), json_format.MessageToDict(msg))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(any_message)
def test_parse_round_trip_equals_json_format(msg):
    data = json.loads(json.dumps(json_format.MessageToDict(msg)))  # what a client would send
    fast = json_codec.parse(data, type(msg)())
    slow = json_format.ParseDict(data, type(msg)())
    # bytes: NaN == NaN (of the same payload: both parsed it from the text "NaN")
    assert fast.SerializeToString(deterministic=True) == slow.SerializeToString(deterministic=True)
    assert json_codec.parsed(data, type(msg)).SerializeToString(deterministic=True) == \
        slow.SerializeToString(deterministic=True)
    assert _same(json_format.MessageToDict(fast), json_format.MessageToDict(msg))  # NaN as "NaN" 


leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=8))
json_value = st.recursive(leaf, lambda kids: st.lists(kids, max_size=3)
                          | st.dictionaries(st.text(max_size=8), kids, max_size=3), max_leaves=10)


def _keys(desc) -> list[str]:
    return [k for f in desc.fields for k in {f.name, f.json_name}]


@st.composite
def malformed(draw):
    """A request for a message type with real keys (both spellings) and values of any JSON type."""
    cls = draw(st.sampled_from(MESSAGES))
    keys = _keys(cls.DESCRIPTOR) + ["noSuchField"]
    data = draw(st.dictionaries(st.sampled_from(keys), json_value, max_size=5))
    return cls, data


@settings(max_examples=600, deadline=None)
@given(malformed())
def test_malformed_input_parses_or_fails_as_json_format_does(case):
    cls, data = case
    try:
        slow = json_format.ParseDict(data, cls())
    except (json_format.ParseError, ValueError, TypeError) as exc:
        with pytest.raises(type(exc)):
            json_codec.parse(data, cls())
        with pytest.raises(type(exc)):
            json_codec.parsed(data, cls)
    else:
        fast = json_codec.parse(data, cls())
        assert fast.SerializeToString(deterministic=True) == slow.SerializeToString(deterministic=True)
        built = json_codec.parsed(data, cls)
        assert type(built) is cls
        assert built.SerializeToString(deterministic=True) == slow.SerializeToString(deterministic=True)


@pytest.mark.parametrize("data", [
    {"job": {"uid": 1.0}},  # an integral float: json_format takes it
    {"job": {"uid": "7"}},  # an integer as a string
    {"job": {"user": "a", "userName": "b"}},
    {"job": {"jobName": "a", "job_name": "b"}},  # one field named twice
    {"job": {"isBatch": None}},
    {"job": {"uid": True}},
    {"job": {"uid": 2**32}},
    {"job": {"timeLimitMin": -1}},
    {"job": None},
    {"dryRun": 1},
])
def test_edge_cases_match(data):
    try:
        slow = json_format.ParseDict(data, pb.AdmitRequest())
    except (json_format.ParseError, ValueError, TypeError) as exc:
        with pytest.raises(type(exc)):
            json_codec.parse(data, pb.AdmitRequest())
    else:
        assert json_codec.parse(data, pb.AdmitRequest()) == slow


def test_plain_admit_takes_the_fast_path(monkeypatch):
    """The Lua plugin's request and the service's reply never reach json_format."""
    def refuse(*_a, **_k):
        raise AssertionError("json_format used")

    monkeypatch.setattr(json_codec.json_format, "ParseDict", refuse)
    monkeypatch.setattr(json_codec.json_format, "MessageToDict", refuse)
    req = json_codec.parse({"job": {"user": "u", "uid": 5, "tresPerNode": "gres:gpu:1", "isBatch": True,
                                    "timeLimitMin": 60}, "brief": True}, pb.AdmitRequest())
    assert req.job.user == "u" and req.job.HasField("is_batch") and req.brief
    reply = pb.AdmitResponse(decision=pb.Decision(decision_id="d", action=pb.ACTION_SHARE, shards=2,
                                                  rewrite=pb.JobRewrite(tres_per_node="gres:shard:2")))
    assert json_codec.to_dict(reply) == {"decision": {"decisionId": "d", "action": "ACTION_SHARE", "shards": 2,
                                                      "rewrite": {"tresPerNode": "gres:shard:2"}}}
