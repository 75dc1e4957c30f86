"""``swapaware report``, rendering: the JSON, CSV and table formats (groups, total, per-job rows) and
how durations are written.

The small world comes from test_report.py."""
from __future__ import annotations

import csv
import io
import json

import pytest

from policy_service import report as R
from tests.unit.report.test_report import build, scenario, world  # noqa: F401  (the fixture)


# ----------------------------------------------------------------------------- rendering
def test_json_csv_and_table(world):
    scenario(world)
    rep = build(world)
    doc = json.loads(R.format_json(rep, with_jobs=True))
    assert doc["meta"]["by"] == "user" and doc["meta"]["shards_per_gpu"] == 8
    assert doc["meta"]["history"]["available"] is True and doc["meta"]["non_gpu_jobs_skipped"] == 1
    assert [g["key"] for g in doc["groups"]] == ["alice", "bob"] and doc["total"]["jobs"] == 7
    j104 = next(j for j in doc["jobs"] if j["job_id"] == 104)
    assert j104["status"] == "overridden" and j104["override_reason"] == "ran_whole_gpu_not_shards"
    assert "jobs" not in json.loads(R.format_json(rep))

    rows = list(csv.DictReader(io.StringIO(R.format_csv(rep))))
    assert [r["key"] for r in rows] == ["alice", "bob", "(total)"]
    assert float(rows[0]["gpu_hours_saved"]) == pytest.approx(rep.groups[0].gpu_hours_saved, abs=1e-6)
    assert rows[1]["abs_pct_error_median"] == ""  # None -> empty cell
    job_rows = list(csv.DictReader(io.StringIO(R.format_csv(rep, with_jobs=True))))
    assert len(job_rows) == 7 and job_rows[0]["group"] == "alice"

    table = R.format_table(rep, with_jobs=True)
    lines = table.splitlines()
    assert lines[0].startswith("swapaware report  now-7days .. now  by user  (7 GPU jobs, 1 non-GPU")
    assert lines[1].split()[:4] == ["USER", "jobs", "shared", "whole"]
    alice = next(ln for ln in lines if ln.startswith("alice "))
    assert alice.split()[1:7] == ["5", "2", "3", "0", "0", "2"]
    assert any(ln.startswith("(total)") for ln in lines)
    assert any(ln.startswith("104 ") and "ran_whole_gpu_not_shards" in ln for ln in lines)


@pytest.mark.parametrize("seconds, text", [(None, "-"), (0, "0s"), (119, "119s"), (600, "10.0m"),
                                           (3 * 3600, "3.0h"), (3 * 86400, "3.0d")])
def test_fmt_duration(seconds, text):
    assert R.fmt_duration(seconds) == text
