"""A site's sacct export as a simulator workload, joined with the service's history."""
from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from policy_service.sim.loaders import DataNotFound, SchemaError
from policy_service.sim.site import load_sacct_export
from tests.unit.report.test_report import GIB, T0, sacct_record, sacct_text, world  # noqa: F401  (the fixture)


def export(w, path):
    """What `sacct --json` wrote on the site (the real 22.05 record shape with these jobs)."""
    path.write_text(sacct_text(w.slurm.records))
    return path


def test_export_with_history_says_which_memory_is_observed(world, tmp_path):  # noqa: F811
    world.job(1, submit=T0, wait_s=60, run_s=3600, peak=3 * GIB)
    world.job(2, submit=T0 + 100, wait_s=0, run_s=1800)  # ran, nothing observed
    world.job(3, submit=T0 + 200, run_s=600, peak=GIB, alloc={"shard": 2})
    world.job(4, submit=T0 + 300, state="PENDING")  # never ran
    world.slurm.records.append(sacct_record(5, user="carol", alloc={}, submit=T0 + 400, start=T0 + 401,
                                            end=T0 + 450))  # no GPU
    world.flush()
    f = export(world, tmp_path / "site.json")
    loaded = load_sacct_export(f, world.db, shards_per_gpu=8)
    jobs = {j.job_id: j for j in loaded.jobs}
    assert set(jobs) == {"1", "2", "3"}
    assert jobs["1"].measured_peak_bytes == 3 * GIB and jobs["2"].measured_peak_bytes is None
    assert jobs["1"].num_gpu == 1 and jobs["1"].gpu_milli == 1000 and jobs["1"].duration_s == 3600
    assert jobs["3"].gpu_milli == 250 and jobs["3"].measured_peak_bytes == GIB  # 2 of 8 shards
    assert jobs["2"].submit_s == 100 and jobs["1"].submit_s == 0
    assert jobs["1"].class_key == "alice/train"
    assert loaded.source["memory"]["observed_jobs"] == 2 and loaded.source["memory"]["model_jobs"] == 1
    assert loaded.skipped == {"never ran, or still running": 1, "no GPU": 1}

    gz = tmp_path / "site.json.gz"
    gz.write_bytes(gzip.compress(f.read_bytes()))
    without = load_sacct_export(gz, None, shards_per_gpu=8)
    assert [j.job_id for j in without.jobs] == ["1", "2", "3"]
    assert without.source["memory"]["observed_jobs"] == 0  # no history: all from the model


def test_bad_exports_are_clear_errors(tmp_path):
    with pytest.raises(DataNotFound, match="sacct --json"):
        load_sacct_export(tmp_path / "none.json", None, shards_per_gpu=8)
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(SchemaError, match="not the output of sacct --json"):
        load_sacct_export(bad, None, shards_per_gpu=8)
    bad.write_text('{"jobs": 3}')
    with pytest.raises(SchemaError, match="no 'jobs' list"):
        load_sacct_export(bad, None, shards_per_gpu=8)


def test_simulate_replays_a_site_export_with_its_recorded_arrivals(world, tmp_path):  # noqa: F811
    """`swapaware simulate --workload sacct` through B0 / swapaware / oracle, saying which memory
    figures are observed and which come from the model."""
    import json

    from click.testing import CliRunner

    from policy_service.sim.cli import simulate_command

    world.job(1, submit=T0, wait_s=60, run_s=3600, peak=3 * GIB)
    world.job(2, submit=T0 + 50, run_s=1800, peak=5 * GIB)
    for i in range(3, 60):  # the rest ran before the service observed anything
        world.slurm.records.append(sacct_record(i, user=f"u{i % 4}", name=f"n{i % 6}", alloc={"gpu": 1},
                                                submit=T0 + 60 * i, start=T0 + 60 * i + 5, end=T0 + 60 * i + 900))
    world.flush()
    f = export(world, tmp_path / "site.json")
    out = tmp_path / "out"
    res = CliRunner().invoke(simulate_command, [
        "--workload", "sacct", "--sacct-json", str(f), "--history", str(world.db), "--gpus", "4",
        "--policies", "b0,swapaware,oracle", "--arrivals", "recorded", "--noise", "none", "--out", str(out),
        "--no-progress"])
    assert res.exit_code == 0, res.output
    doc = json.loads((out / "results.json").read_text())
    src = doc["meta"]["data_source"]
    assert src["name"] == "sacct" and src["memory"]["observed_jobs"] == 2 and src["memory"]["model_jobs"] == 57
    assert sorted(r["policy"] for r in doc["runs"]) == ["b0", "oracle", "swapaware"]
    assert all(r["jobs"] == 59 for r in doc["runs"]), [r.get("jobs") for r in doc["runs"]]

    missing = CliRunner().invoke(simulate_command, ["--workload", "sacct", "--sacct-json", str(f), "--out",
                                                    str(out), "--no-progress"])
    assert missing.exit_code != 0 and "give --gpus" in missing.output



CAPTURE = Path(__file__).resolve().parents[2] / "golden" / "22.05" / "sacct_capture.json.gz"


def test_a_captured_export_of_thousands_of_jobs_replays(tmp_path):
    """`sacct --json -X --allusers` of the dev cluster (Slurm 22.05) after arrays of short GPU jobs
    ran through the plugin (tests/golden/22.05/sacct_capture.md): every task that ran is a trace job,
    and the what-if runs on it (all memory from the model: the export comes without its history)."""
    import json

    from click.testing import CliRunner

    from policy_service.sim.cli import simulate_command

    loaded = load_sacct_export(CAPTURE, None, shards_per_gpu=8)
    assert len(loaded.jobs) == 2000 and not loaded.skipped, (len(loaded.jobs), loaded.skipped)
    assert all(j.num_gpu == 1 and j.gpu_milli == 1000 and j.duration_s >= 0 for j in loaded.jobs)
    assert {j.class_key for j in loaded.jobs} >= {"root/cap-a", "root/cap-b"}
    out = tmp_path / "out"
    res = CliRunner().invoke(simulate_command, [
        "--workload", "sacct", "--sacct-json", str(CAPTURE), "--gpus", "4", "--arrivals", "recorded",
        "--policies", "b0,swapaware,oracle", "--noise", "none", "--out", str(out), "--no-progress"])
    assert res.exit_code == 0, res.output
    doc = json.loads((out / "results.json").read_text())
    assert doc["meta"]["data_source"]["memory"] == {**doc["meta"]["data_source"]["memory"], "observed_jobs": 0,
                                                    "model_jobs": len(loaded.jobs)}
    assert {r["policy"]: r["jobs"] for r in doc["runs"]} == dict.fromkeys(("b0", "swapaware", "oracle"),
                                                                         len(loaded.jobs))
