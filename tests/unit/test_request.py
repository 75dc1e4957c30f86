import pytest

from policy_service.config import AccessClass
from policy_service.core.request import (
    RequestError,
    gpu_request,
    history_keys,
    job_request,
    parse_gres_entries,
    parse_hints,
    parse_size_bytes,
    script_fingerprint,
    shard_rewrite,
)
from policy_service.core.types import GresKind, KeyLevel

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


@pytest.mark.parametrize("fields,kind,count,source", [
    ({"tres_per_node": "gres:gpu:1"}, GresKind.GPU, 1, "tres_per_node"),
    ({"tres_per_node": "gres:gpu:h100:2"}, GresKind.GPU, 2, "tres_per_node"),
    ({"tres_per_job": "gres:gpu:1"}, GresKind.GPU, 1, "tres_per_job"),
    ({"tres_per_node": "gres:shard:3"}, GresKind.SHARD, 3, "tres_per_node"),
    ({"tres_per_node": "gres:nvme:1"}, GresKind.NONE, 0, ""),
    ({}, GresKind.NONE, 0, ""),
    ({"tres_per_node": "gres:mps:50"}, GresKind.OTHER, 50, "tres_per_node"),
    ({"tres_per_node": "gres:gpu:1", "tres_per_task": "gres:gpu:1"}, GresKind.OTHER, 0, "tres_per_node"),
])
def test_gpu_request(fields, kind, count, source):
    g = gpu_request(fields)
    assert (g.kind, g.per_node, g.source_field) == (kind, count, source)


def test_gres_entry_with_type_and_default_count():
    (a, b) = parse_gres_entries("gres:gpu:a100:2,gres:nvme")
    assert (a.name, a.gres_type, a.count) == ("gpu", "a100", 2)
    assert (b.name, b.count) == ("nvme", 1)


def test_shard_rewrite_keeps_other_gres_and_clears_gpu_fields():
    out = shard_rewrite({"tres_per_node": "gres:gpu:1,gres:nvme:1"}, "tres_per_node", 3)
    assert out == {"tres_per_node": "gres:nvme:1,gres:shard:3"}
    out = shard_rewrite({"tres_per_job": "gres:gpu:1"}, "tres_per_job", 2)
    assert out == {"tres_per_node": "gres:shard:2", "tres_per_job": ""}


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
