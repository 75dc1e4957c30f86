"""Bad input gets a clear error and changes nothing: hypothesis fuzzes, each with a fixed budget,
the local socket's line protocol, the gRPC messages (through the same Method table both
transports use, with a real SQLite history), the hints parser and the Lua side's facts (real Lua
5.1). The property everywhere: no exception escapes, and no input earns INTERNAL (a traceback in
the service's log) where INVALID_ARGUMENT is the honest answer."""
from __future__ import annotations

import json
import logging
import string

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.history.store import HistoryStore
from policy_service.serving.local_socket import handle_line
from policy_service.config import load_config
from policy_service.core.request import RequestError, parse_hints, parse_size_bytes
from policy_service.serving.handler import Method, PolicyHandler
from policy_service.serving.handler_error import HandlerError

from tests.adapter.plugin.test_lua_plugin import run_lua, valid_utf8

BUDGET = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                          HealthCheck.too_slow])
METHODS = [m.value[0] for m in Method] + ["Nope", ""]
U32, U64 = 2**32 - 1, 2**64 - 1


@pytest.fixture(scope="module")
def handler(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    cfg = load_config(env={"SWAPAWARE_SERVICE__DB_PATH": str(d / "history.sqlite3")})
    store = HistoryStore(cfg.service.db_path)
    h = PolicyHandler(cfg, store, None)
    quiet = logging.getLogger("swapaware")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    yield h
    quiet.setLevel(level)  # the tests after this module see the service's log again
    h.close()
    store.close()


def reply_of(line: bytes) -> dict:
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    body = json.loads(line)
    assert ("response" in body) != ("error" in body), body
    if "error" in body:
        assert body["error"]["code"] != "INTERNAL", body
    return body


json_leaf = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                      st.floats(allow_nan=False), st.text(max_size=40))
json_value = st.recursive(json_leaf, lambda kids: st.lists(kids, max_size=4)
                          | st.dictionaries(st.text(max_size=12), kids, max_size=4), max_leaves=20)
FACT_KEYS = ["user", "uid", "account", "partition", "jobName", "tresPerNode", "tresPerJob", "comment", "workDir",
             "envMemHint", "minNodes", "numTasks", "isBatch", "timeLimitMin", "scriptFingerprint", "qos", "hetJob"]
facts_like = st.dictionaries(st.sampled_from(FACT_KEYS), json_value | st.text(string.printable, max_size=30),
                             max_size=8)
request_like = st.one_of(
    json_value,
    st.fixed_dictionaries({"job": facts_like}, optional={"dryRun": json_value, "brief": json_value}),
    st.fixed_dictionaries({}, optional={"jobId": json_value, "decisionId": json_value, "job": facts_like}),
    st.fixed_dictionaries({}, optional={"jobId": json_value, "node": json_value, "eventId": json_value,
                                        "finishedAt": json_value, "peakGpuBytes": json_value,
                                        "gpuIndices": json_value, "gpus": json_value}))


@BUDGET
@given(st.one_of(
    st.binary(max_size=300),
    st.builds(lambda m, r: json.dumps({"method": m, "request": r}).encode(), st.sampled_from(METHODS), request_like),
    st.builds(lambda v: json.dumps(v).encode(), json_value)))
def test_local_socket_lines(handler, line):
    reply_of(handle_line(handler, line, 0, 0))


@pytest.mark.parametrize("line", [
    b'{"method":"Admit","request":{"job":{"user":"u","tresPerNode":"gres:gpu:1","comment":"swapaware:mem=1'
    + b"0" * 400 + b'"}}}',
    b'{"method":"Admit","request":5}',
    b"[" * 100_000,
    b'{"method":"Admit","request":{"job":{"uid":' + b"9" * 5000 + b"}}}",
    b'{"method":"Admit","request":{"job":{"comment":"\xff"}}}',
    b'{"method":"Admit","request":{"job":{"uid":NaN}}}',
])
def test_the_inputs_that_once_gave_a_traceback(handler, line):
    body = reply_of(handle_line(handler, line, 0, 0))
    assert "error" not in body or body["error"]["code"] == "INVALID_ARGUMENT", body


texts = st.text(max_size=60) | st.sampled_from(["gres:gpu:1", "gres/gpu=2", "gres:shard:3,gres:gpu:a100:1",
                                                "gpu:0", "gres:gpu:99999999999999999999", "license/x=1"])
job_facts = st.builds(
    pb.JobFacts, user=texts, uid=st.integers(0, U32), account=texts, partition=texts, job_name=texts,
    tres_per_node=texts, tres_per_job=texts, tres_per_task=texts, tres_per_socket=texts,
    time_limit_min=st.integers(0, U32), script_fingerprint=st.text(string.hexdigits, max_size=20),
    work_dir=texts, comment=texts | st.builds(lambda v: f"swapaware:mem={v} swapaware:access={v}", texts),
    env_mem_hint=st.text(max_size=20), min_nodes=st.integers(0, U32), num_tasks=st.integers(0, U32),
    qos=texts, het_job=st.booleans())
finished = st.builds(
    pb.JobFinishedRequest, job_id=st.integers(0, U64), node=texts, gpu_indices=st.lists(st.integers(0, U32), max_size=5),
    finished_at=st.floats(allow_nan=True, allow_infinity=True), exit_code=st.integers(-2**31, 2**31 - 1),
    exit_signal=st.integers(-2**31, 2**31 - 1), event_id=st.text(max_size=20),
    started_at=st.floats(allow_nan=True, allow_infinity=True), telemetry_source=texts)
started = st.builds(pb.JobStartedRequest, job_id=st.integers(0, U64), node=texts,
                    gpu_indices=st.lists(st.integers(0, U32), max_size=5),
                    started_at=st.floats(allow_nan=True, allow_infinity=True), event_id=st.text(max_size=20))
grpc_calls = st.one_of(
    st.builds(lambda j, dry: (Method.ADMIT, pb.AdmitRequest(job=j, dry_run=dry)), job_facts, st.booleans()),
    st.builds(lambda j: (Method.EXPLAIN, pb.ExplainRequest(job=j)), job_facts),
    st.builds(lambda i: (Method.EXPLAIN, pb.ExplainRequest(job_id=i)), st.integers(0, U64)),
    st.builds(lambda r: (Method.JOB_FINISHED, r), finished),
    st.builds(lambda r: (Method.JOB_STARTED, r), started),
    st.builds(lambda fs: (Method.REPORT_EVENTS, pb.ReportEventsRequest(
        events=[pb.JobEvent(finished=f) for f in fs])), st.lists(finished, max_size=4)))


@BUDGET
@given(grpc_calls)
def test_grpc_messages(handler, call):
    method, request = call
    request = type(request).FromString(request.SerializeToString())  # what the wire would carry
    try:
        method.call(handler, request)
    except HandlerError as exc:
        assert exc.code != grpc.StatusCode.INTERNAL, exc.message


@BUDGET
@given(st.text(max_size=200), st.text(max_size=64))
def test_hints_parser(comment, env):
    mem, _access, bad = parse_hints(comment, env)
    assert mem is None or 0 <= mem <= 1 << 60
    assert isinstance(bad, str)


@BUDGET
@given(st.from_regex(r"\A\s*[0-9]{0,400}(\.[0-9]{0,50})?(e[0-9]{1,4})?\s*[kKmMgGtTpPeE]?[iI]?[bB]?\s*\Z")
       | st.text(max_size=30))
def test_size_parser_raises_only_its_own_error(text):
    try:
        assert 0 <= parse_size_bytes(text) <= 1 << 60
    except RequestError:
        pass


raw_field = st.binary(max_size=80) | st.builds(lambda b, n: b * n, st.binary(min_size=1, max_size=40),
                                                st.integers(100, 400))  # past the limits


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.fixed_dictionaries({k: raw_field for k in ("comment", "name", "work_dir", "account", "qos")}),
                min_size=1, max_size=12))
def test_lua_facts_are_bounded_valid_utf8(tmp_path_factory, jobs):
    """The facts job_submit.lua would send, for jobs whose fields hold any bytes at all."""
    d = tmp_path_factory.mktemp("lua")
    descs = [{"tres_per_node": "gres:gpu:1", "user_name": "u", **{k: {"hex": v.hex()} for k, v in j.items()}}
             for j in jobs]
    out = run_lua(d, descs, d / "none.sock")
    limits = {"comment": 4096, "jobName": 1024, "workDir": 4096, "account": 1024, "qos": 1024}
    for res in out["results"]:
        for key, limit in limits.items():
            value = res["facts"][key].encode()
            assert len(value) <= limit and valid_utf8(value)
