import pytest

from policy_service.core.dialect import DIALECTS, NEWEST, SLURM_22_05, dialect_for, parse_release

# release -> (gres prefix, sacct flag, gpu-beside-shard bug, MULTIPLE_SHARING_GRES_PJ, SLUID)
EXPECTED = [
    ((21, 8), "gres:", "--json", True, False, False),  # older than any entry: 22.05's values
    ((22, 5), "gres:", "--json", True, False, False),
    ((23, 2), "gres/", "--json", True, False, False),
    ((23, 11), "gres/", "--json", False, True, False),
    ((24, 5), "gres/", "--json", False, True, False),
    ((24, 11), "gres/", "--json=v0.0.42", False, True, False),
    ((25, 5), "gres/", "--json=v0.0.42", False, True, False),
    ((25, 11), "gres/", "--json=v0.0.42", False, True, True),
    ((26, 5), "gres/", "--json=v0.0.44", False, True, True),
    ((27, 11), "gres/", "--json=v0.0.44", False, True, True),  # newer than any entry: the newest's
]


@pytest.mark.parametrize("release,prefix,sacct,bug,multi,sluid", EXPECTED)
def test_dialect_for(release, prefix, sacct, bug, multi, sluid):
    d = dialect_for(release)
    assert d.release == release
    assert (d.gres_prefix, d.sacct_json_arg, d.gpu_beside_shard_bug, d.multiple_sharing_gres_pj, d.has_sluid) == (
        prefix, sacct, bug, multi, sluid)


def test_unknown_release_is_the_newest_known():
    assert dialect_for(None) == DIALECTS[NEWEST] == dialect_for((26, 5))
    assert SLURM_22_05 == dialect_for((22, 5))


@pytest.mark.parametrize("release,args,expected", [
    ((22, 5), ("shard", 2), "gres:shard:2"),
    ((22, 5), ("gpu", 1, "a100"), "gres:gpu:a100:1"),
    ((24, 11), ("shard", 2), "gres/shard:2"),
    ((24, 11), ("gpu", 1, "a100"), "gres/gpu:a100:1"),
    ((26, 5), ("shard", 8), "gres/shard:8"),
])
def test_gres_spelling(release, args, expected):
    assert dialect_for(release).gres(*args) == expected


def test_describe_names_the_release_and_its_choices():
    text = dialect_for((24, 11)).describe()
    assert text.startswith("24.11 (gres/ spelling, sacct --json=v0.0.42,")
    assert "gpu-beside-shard bug: no" in text
    assert dialect_for((22, 5)).describe().startswith("22.05 (gres: spelling, sacct --json,")


@pytest.mark.parametrize("text,expected", [("24.11", (24, 11)), ("22.05.8", (22, 5)), (" 26.05 ", (26, 5))])
def test_parse_release(text, expected):
    assert parse_release(text) == expected


@pytest.mark.parametrize("text", ["", "24", "v24.11", "24.x", "slurm 24.11"])
def test_parse_release_rejects(text):
    with pytest.raises(ValueError):
        parse_release(text)
