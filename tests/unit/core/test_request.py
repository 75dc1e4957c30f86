import pytest

from policy_service.config import AccessClass
from policy_service.core.request import (
    RequestError,
    gpu_request,
    history_keys,
    job_request,
    legacy_spelling,
    parse_gres_entries,
    parse_hints,
    parse_size_bytes,
    script_fingerprint,
    shard_rewrite,
)
from policy_service.core.dialect import DIALECTS
from policy_service.core.types import GresKind, KeyLevel

D22, D24, D26 = DIALECTS[(22, 5)], DIALECTS[(24, 11)], DIALECTS[(26, 5)]

GIB = 1024**3


@pytest.mark.parametrize("text,expected", [
    ("12G", 12 * GIB), ("12GiB", 12 * GIB), ("800M", 800 * 1024**2), ("1.5T", int(1.5 * 1024**4)),
    ("4096", 4096), (" 2g ", 2 * GIB),
])
def test_parse_size(text, expected):
    assert parse_size_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "12X", "-1G", "G12"])
def test_parse_size_rejects(text):
    with pytest.raises(RequestError):
        parse_size_bytes(text)


@pytest.mark.parametrize("fields,kind,count,gpu_type,source", [
    # 22.05 spelling
    ({"tres_per_node": "gres:gpu:1"}, GresKind.GPU, 1, "", "tres_per_node"),
    ({"tres_per_node": "gres:gpu:a100:2"}, GresKind.GPU, 2, "a100", "tres_per_node"),
    ({"tres_per_node": "gres:gpu:h100:2"}, GresKind.GPU, 2, "h100", "tres_per_node"),
    ({"tres_per_job": "gres:gpu:1"}, GresKind.GPU, 1, "", "tres_per_job"),
    ({"tres_per_task": "gres:gpu:1"}, GresKind.GPU, 1, "", "tres_per_task"),
    ({"tres_per_node": "gres:shard:3"}, GresKind.SHARD, 3, "", "tres_per_node"),
    ({"tres_per_node": "gres:nvme:1"}, GresKind.NONE, 0, "", ""),
    ({}, GresKind.NONE, 0, "", ""),
    ({"tres_per_node": "gres:mps:50"}, GresKind.OTHER, 50, "", "tres_per_node"),
    ({"tres_per_node": "gres:gpu:1", "tres_per_task": "gres:gpu:1"}, GresKind.OTHER, 0, "", "tres_per_node"),
    # 24.11+ spelling: gres/..., and name=count in tres_per_task beside other TRES
    ({"tres_per_node": "gres/gpu:1"}, GresKind.GPU, 1, "", "tres_per_node"),
    ({"tres_per_node": "gres/gpu:a100:1"}, GresKind.GPU, 1, "a100", "tres_per_node"),
    ({"tres_per_job": "gres/gpu:2"}, GresKind.GPU, 2, "", "tres_per_job"),
    ({"tres_per_task": "gres/gpu=1"}, GresKind.GPU, 1, "", "tres_per_task"),
    ({"tres_per_task": "cpu=2,gres/gpu=1"}, GresKind.GPU, 1, "", "tres_per_task"),
    ({"tres_per_task": "gres/gpu:a100=1"}, GresKind.GPU, 1, "a100", "tres_per_task"),
    ({"tres_per_task": "cpu=2"}, GresKind.NONE, 0, "", ""),  # not a GRES named "cpu=2"
    ({"tres_per_node": "gres/shard:2"}, GresKind.SHARD, 2, "", "tres_per_node"),
    ({"tres_per_node": "gres/nvme:1"}, GresKind.NONE, 0, "", ""),
    # a count of 0 asks for no GPU
    ({"tres_per_node": "gpu:0"}, GresKind.NONE, 0, "", ""),
    ({"tres_per_node": "gres:gpu:0"}, GresKind.NONE, 0, "", ""),
    ({"tres_per_node": "gres/gpu:0"}, GresKind.NONE, 0, "", ""),
    ({"tres_per_task": "gres/gpu=0"}, GresKind.NONE, 0, "", ""),
    ({"tres_per_task": "cpu=2,gres/gpu=0"}, GresKind.NONE, 0, "", ""),
    ({"tres_per_node": "gres/gpu:0", "tres_per_job": "gres/gpu:1"}, GresKind.GPU, 1, "", "tres_per_job"),
])
def test_gpu_request(fields, kind, count, gpu_type, source):
    g = gpu_request(fields)
    assert (g.kind, g.per_node, g.gpu_type, g.source_field) == (kind, count, gpu_type, source)


@pytest.mark.parametrize("text,expected", [
    ("gres:gpu:a100:2,gres:nvme", [("gpu", "a100", 2, True), ("nvme", "", 1, True)]),
    ("gres/gpu:a100:1", [("gpu", "a100", 1, True)]),
    ("gres/gpu=1", [("gpu", "", 1, True)]),
    ("cpu=2,gres/gpu=1", [("cpu", "", 0, False), ("gpu", "", 1, True)]),
    ("gres/gpu:a100=3", [("gpu", "a100", 3, True)]),
    ("mem=4G,license/matlab=1,gres/gpu:1", [("mem", "", 0, False), ("license/matlab", "", 0, False),
                                            ("gpu", "", 1, True)]),
    ("gpu:1", [("gpu", "", 1, True)]),
    ("", []),
])
def test_gres_entries(text, expected):
    got = parse_gres_entries(text)
    assert [(e.name, e.gres_type, e.count, e.gres) for e in got] == expected
    assert ",".join(e.text for e in got) == text  # every entry kept exactly as written


@pytest.mark.parametrize("text", ["gres:gpu:a:b:c", "gres/gpu=x", "gres/gpu=4k", "gres:gpu:4k", "gres/:1",
                                  "gres/gpu:a:b=1", "gres:gpu::1"])
def test_gres_entries_reject(text):
    with pytest.raises(RequestError):
        parse_gres_entries(text)


@pytest.mark.parametrize("fields,source,dialect,expected", [
    ({"tres_per_node": "gres:gpu:1,gres:nvme:1"}, "tres_per_node", D22,
     {"tres_per_node": "gres:nvme:1,gres:shard:3"}),
    ({"tres_per_job": "gres:gpu:1"}, "tres_per_job", D22, {"tres_per_node": "gres:shard:3", "tres_per_job": ""}),
    ({"tres_per_node": "gres/gpu:1"}, "tres_per_node", D24, {"tres_per_node": "gres/shard:3"}),
    ({"tres_per_node": "gres/gpu:1,gres/nvme:1"}, "tres_per_node", D26,
     {"tres_per_node": "gres/nvme:1,gres/shard:3"}),
    ({"tres_per_job": "gres/gpu:1"}, "tres_per_job", D24, {"tres_per_node": "gres/shard:3", "tres_per_job": ""}),
    # tres_per_task: the gpu entry goes, the cpu entry stays as written
    ({"tres_per_task": "cpu=2,gres/gpu=1"}, "tres_per_task", D24,
     {"tres_per_node": "gres/shard:3", "tres_per_task": "cpu=2"}),
    ({"tres_per_task": "gres/gpu=1"}, "tres_per_task", D26, {"tres_per_node": "gres/shard:3", "tres_per_task": ""}),
    # every gpu entry of every field is cleared (a zero one too)
    ({"tres_per_node": "gres/gpu:0", "tres_per_job": "gres/gpu:1", "tres_per_socket": "gres/gpu:1"},
     "tres_per_job", D24, {"tres_per_node": "gres/shard:3", "tres_per_job": "", "tres_per_socket": ""}),
    # the running release's spelling, whatever the job was written in
    ({"tres_per_node": "gres:gpu:1"}, "tres_per_node", D26, {"tres_per_node": "gres/shard:3"}),
])
def test_shard_rewrite(fields, source, dialect, expected):
    assert shard_rewrite(fields, source, 3, dialect) == expected


@pytest.mark.parametrize("dialect", [D22, D24, D26])
@pytest.mark.parametrize("fields,source", [
    ({"tres_per_node": "gres:gpu:1,gres:nvme:1"}, "tres_per_node"),
    ({"tres_per_node": "gres/gpu:1"}, "tres_per_node"),
    ({"tres_per_job": "gres/gpu:1"}, "tres_per_job"),
    ({"tres_per_task": "cpu=2,gres/gpu=1"}, "tres_per_task"),
])
def test_shard_rewrite_round_trip(dialect, fields, source):
    out = shard_rewrite(fields, source, 5, dialect)
    g = gpu_request({**fields, **out})
    assert (g.kind, g.per_node, g.source_field) == (GresKind.SHARD, 5, "tres_per_node")
    assert out["tres_per_node"].endswith(dialect.gres("shard", 5))
    others = [e.text for f in fields for e in parse_gres_entries(fields[f]) if not (e.gres and e.name == "gpu")]
    kept = [e.text for f in out for e in parse_gres_entries(out[f]) if not (e.gres and e.name == "shard")]
    assert sorted(kept) == sorted(others)


@pytest.mark.parametrize("text,expected", [
    ("gres:gpu:1", "gres:gpu:1"), ("gres/gpu:1", "gres:gpu:1"), ("gres/gpu=1", "gres:gpu:1"),
    ("gres/gpu:a100:2", "gres:gpu:a100:2"), ("gres/gpu:a100=2", "gres:gpu:a100:2"),
    ("tres_per_node=gres/gpu:1;tres_per_task=gres/gpu=1", "tres_per_node=gres:gpu:1;tres_per_task=gres:gpu:1"),
    ("", ""),
])
def test_legacy_spelling(text, expected):
    assert legacy_spelling(text) == expected


def test_history_keys_do_not_depend_on_the_release_spelling():
    def keys(gres_fields):
        req, _ = job_request(user="u", account="a", partition="p", job_name="n", script_fingerprint="fp",
                             gres_fields=gres_fields)
        return history_keys(req)
    old = keys({"tres_per_node": "gres:gpu:1"})
    assert keys({"tres_per_node": "gres/gpu:1"}) == old
    assert keys({"tres_per_task": "gres/gpu=1"}) == keys({"tres_per_task": "gres:gpu:1"})
    assert keys({"tres_per_node": "gres/gpu:a100:1"})[KeyLevel.CLASS] != old[KeyLevel.CLASS]


def test_job_request_is_batch():
    base = dict(user="u", account="", partition="", job_name="", script_fingerprint="",
                gres_fields={"tres_per_node": "gres/gpu:1"})
    assert job_request(**base)[0].is_batch is True
    assert job_request(**base, is_batch=False)[0].is_batch is False


@pytest.mark.parametrize("comment,env,mem,access,bad", [
    ("swapaware:mem=12G", "", 12 * GIB, None, ""),
    ("run 3; swapaware:mem=2G swapaware:access=random", "", 2 * GIB, AccessClass.RANDOM, ""),
    ("swapaware:mem=2G", "5G", 5 * GIB, None, ""),
    ("swapaware:mem=lots", "", None, None, "mem=lots"),
    ("swapaware:access=sometimes", "", None, None, "access=sometimes"),
    ("swapaware:colour=red", "", None, None, "colour=red"),
    ("nothing here", "", None, None, ""),
])
def test_hints(comment, env, mem, access, bad):
    assert parse_hints(comment, env) == (mem, access, bad)


def test_job_request_unset_numbers_and_keys():
    req, _ = job_request(user="u", account="acct", partition="gpu", job_name="train", script_fingerprint="fp",
                         gres_fields={"tres_per_node": "gres:gpu:1"}, min_nodes=4294967294, time_limit_min=4294967294)
    assert req.min_nodes == 1 and req.time_limit_s == 0
    keys = history_keys(req)
    assert keys[KeyLevel.USER_NAME] == "u/train" and keys[KeyLevel.ACCOUNT] == "acct"
    other, _ = job_request(user="u", account="acct", partition="gpu", job_name="train", script_fingerprint="fp2",
                           gres_fields={"tres_per_node": "gres:gpu:1"})
    assert history_keys(other)[KeyLevel.CLASS] != keys[KeyLevel.CLASS]
    assert history_keys(other)[KeyLevel.USER_NAME] == keys[KeyLevel.USER_NAME]


def test_job_request_needs_user():
    with pytest.raises(RequestError):
        job_request(user="", account="", partition="", job_name="", script_fingerprint="", gres_fields={})


def test_fingerprint_known_values():
    assert script_fingerprint(b"") == ""
    assert script_fingerprint(b"a") == f"{97:08x}{97:08x}"
    assert script_fingerprint(b"#!/bin/sh\necho 1\n") != script_fingerprint(b"#!/bin/sh\necho 2\n")
