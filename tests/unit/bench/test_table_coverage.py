"""bench/table_coverage.py and bench/table_stream.py (issue 33 item 5): the table's coverage of a
submission stream and each key field's share of the misses, checked by hand on a made-up stream,
then run on a small slice of each real stream (the sacct capture in tests/golden, the
alibaba-v2023 trace in ../shared/data)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from policy_service.core.admission import KEY_FIELDS, SEP

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "bench"))
import table_stream  # noqa: E402
from table_stream import Sub, covered  # noqa: E402

NAMES = tuple(name for name, _ in KEY_FIELDS)
DATA = ROOT.parent / "shared" / "data"
LAG, HORIZON = 31.0, 1000.0


def key(**fields: str) -> str:
    base = {n: "" for n in NAMES}
    base.update(user="alice", account="proj", partition="gpu", job_name="train", tres_per_node="gres:gpu:1",
                script_fingerprint="f1", is_batch="1")
    base.update(fields)
    return SEP.join(base[n] for n in NAMES)


def has_lua() -> bool:
    return shutil.which("lua5.1") is not None and subprocess.run(
        ["lua5.1", "-e", 'require("cjson")'], capture_output=True).returncode == 0


def test_hand_made_stream_arithmetic(capsys):
    a, b = key(), key(qos="high")
    stream = [
        Sub(0, a),                          # new
        Sub(10, a),                         # lag: decided 10 s before, the table lags 31 s
        Sub(100, a, ends=(150,)),           # hit; its observation at 150
        Sub(160, a),                        # dropped: the class learned at 150, within the lag
        Sub(200, a),                        # hit (150 + 31 <= 200)
        Sub(210, b),                        # new key; a key without qos would hit
        Sub(215, key(user="bob", job_name="eval")),  # new, two fields differ: no single field
        Sub(2000, a),                       # horizon: last decided at 200, 1800 s > HORIZON before
        Sub(2100, a),                       # hit
        Sub(2100, key(comment="lr=3e-4")),  # new; without the comment it would hit
    ]
    cov = covered(stream, NAMES, LAG, HORIZON)
    assert (cov.n, cov.hits, cov.misses) == (10, 3, 7)
    assert cov.causes == {"new": 4, "lag": 1, "dropped": 1, "horizon": 1, "no single field": 4}
    # the lag, horizon and bob's misses: no single field helps (the same key did not hit either)
    assert cov.fields == {"qos": 1, "comment": 1}
    table_stream.report("hand", cov)
    out = capsys.readouterr().out
    assert "decided by the table 3/10 (30.0 %), misses 7" in out
    assert "qos 1 (14.3 %)" in out and "no single field: 4 (57.1 %)" in out
    # the order the stream is given in does not matter; the lag 0 s decides the second at once
    assert covered(list(reversed(stream)), NAMES, LAG, HORIZON) == cov
    assert covered(stream[:2], NAMES, 0.0, HORIZON).hits == 1


def test_key_of_another_width_matches_nothing_and_blames_no_field():
    bad = key(comment="a" + SEP + "b")
    cov = covered([Sub(0, bad), Sub(100, bad)], NAMES, LAG, HORIZON)
    assert (cov.hits, cov.fields, cov.causes["no single field"]) == (1, {}, 1)


def _invariants(cov, keys: list[str]) -> None:
    assert cov.hits + cov.misses == cov.n == len(keys)
    assert sum(v for k, v in cov.causes.items() if k != "no single field") == cov.misses
    assert cov.causes["new"] == len(set(keys))
    assert all(v <= cov.misses for v in cov.fields.values())


@pytest.mark.skipif(not has_lua(), reason="lua5.1 with lua-cjson not installed")
def test_sacct_capture_slice():
    import table_coverage
    jobs = table_coverage.sacct_jobs(ROOT / "tests" / "golden" / "22.05" / "sacct_capture.json.gz")
    calls = table_coverage.submissions(jobs[:50] + jobs[-50:])
    outs = table_coverage.lua_facts([c[2] for c in calls])
    tasks = [Sub(c[0], o["key"], (end,)) for c, o in zip(calls, outs) if o["wants_gpu"] for end in c[4]]
    assert len(tasks) == 100
    cov = covered(tasks, NAMES, LAG, 604800.0)
    _invariants(cov, [s.key for s in tasks])
    assert cov.hits == 0  # every task submitted within one second of its array's first: the lag
    assert covered(tasks, NAMES, 0.0, 604800.0).hits == 100 - len({s.key for s in tasks})


@pytest.mark.skipif(not (DATA / table_stream.ALIBABA_FILE).exists(),
                    reason=f"the public traces are not at {DATA} (../shared/data/README.md)")
@pytest.mark.skipif(not has_lua(), reason="lua5.1 with lua-cjson not installed")
def test_alibaba_slice():
    import table_coverage
    rows = table_stream.alibaba_rows(DATA, limit=300)
    assert len(rows) == 300
    for mode in ("none", "runtime"):
        jobs = [(t, (end,) if end is not None else (), d) for t, end, d in table_stream.alibaba_jobs(rows, mode)]
        outs = table_coverage.lua_facts([d for _, _, d in jobs])
        keys = [o["key"] for o in outs if o["wants_gpu"]]
        assert len(keys) == sum(1 for r in rows if r["num_gpu"] not in ("", "0"))
        assert all(len(k.split(SEP)) == len(NAMES) for k in keys)
        cov = table_coverage.stream_coverage(jobs, LAG, 604800.0)
        _invariants(cov, keys)
        # only the time limit varies within a request shape (in mode runtime), and it is no part of the key
        assert not cov.fields


def test_alibaba_schema_is_checked(tmp_path):
    (tmp_path / "alibaba-v2023").mkdir()
    (tmp_path / table_stream.ALIBABA_FILE).write_text("name,num_gpu\nx,1\n")
    with pytest.raises(ValueError, match="columns"):
        table_stream.alibaba_rows(tmp_path)


def test_an_observation_drops_its_class_not_others():
    a, a_low, bob = key(), key(qos="low"), key(user="bob")
    # a_low is of a's class (user, name, script, GRES): its observation at 150 drops a's entry;
    # bob's observation at 150 is another class's
    base = [Sub(0, a), Sub(0, bob), Sub(1, a_low)]
    cov = covered(base + [Sub(100, a_low, ends=(150,)), Sub(160, a), Sub(170, bob)], NAMES, LAG, HORIZON)
    assert (cov.hits, cov.causes["dropped"]) == (2, 1)  # a_low at 100 and bob at 170; a at 160 dropped
    cov = covered(base + [Sub(100, bob, ends=(150,)), Sub(160, a), Sub(170, bob)], NAMES, LAG, HORIZON)
    assert (cov.hits, cov.causes["dropped"]) == (2, 1)  # bob at 100 and a at 160; bob at 170 dropped
