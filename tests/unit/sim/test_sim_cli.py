"""``swapaware simulate`` end to end on a small synthetic workload."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from policy_service.sim.cli import simulate_command

DATA = Path(__file__).parents[3].parent / "shared" / "data"

SMALL = ["--workload", "synthetic", "--jobs", "150", "--gpus", "16", "--load", "0.6,0.9", "--noise", "0.25",
         "--noise-load", "0.9", "--seed", "4", "--no-progress"]


def _run(args, tmp_path):
    return CliRunner().invoke(simulate_command, [*args, "--out", str(tmp_path / "out")], catch_exceptions=False)


def test_simulate_writes_comparison_and_results(tmp_path):
    res = _run(SMALL, tmp_path)
    assert res.exit_code == 0, res.output
    for name in ("b0", "b1", "b2", "swapaware", "oracle"):
        assert name in res.output
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    meta = doc["meta"]
    assert meta["seed"] == 4 and meta["workload"] == "synthetic"
    assert meta["config"]["gpu"]["shards_per_gpu"] == 8 and "memory" in meta["sim_config"]
    assert meta["data_source"]["name"] == "synthetic"
    assert len(doc["runs"]) == 5 * 3  # two loads + one noise level
    assert {r["block"] for r in doc["runs"]} == {"load", "noise"}
    lines = (tmp_path / "out" / "results.csv").read_text().splitlines()
    comments = [ln for ln in lines if ln.startswith("#")]
    assert any(ln.startswith("# seed=4") for ln in comments)
    assert any(ln.startswith("# data_source=") for ln in comments)
    assert any(ln.startswith("# config=") for ln in comments)
    rows = list(csv.DictReader(ln for ln in lines if not ln.startswith("#")))
    assert len(rows) == 15 and float(rows[0]["jct_mean_s"]) > 0


def test_simulate_is_reproducible(tmp_path):
    a = _run(SMALL + ["--policies", "b2,swapaware", "--noise", "none"], tmp_path / "a")
    b = _run(SMALL + ["--policies", "b2,swapaware", "--noise", "none", "--workers", "2"], tmp_path / "b")
    assert a.exit_code == 0 and b.exit_code == 0
    ra = json.loads((tmp_path / "a" / "out" / "results.json").read_text())["runs"]
    rb = json.loads((tmp_path / "b" / "out" / "results.json").read_text())["runs"]
    strip = lambda rows: [{k: v for k, v in r.items() if k != "wall_s"} for r in rows]  # noqa: E731
    assert strip(ra) == strip(rb)


def test_simulate_plots(tmp_path):
    pytest.importorskip("matplotlib")
    res = _run(SMALL + ["--policies", "b0,swapaware", "--noise", "none", "--load", "0.8", "--plots"], tmp_path)
    assert res.exit_code == 0, res.output
    assert (tmp_path / "out" / "jct_cdf_load80.png").stat().st_size > 1000
    assert (tmp_path / "out" / "utilisation_load80.png").stat().st_size > 1000


@pytest.mark.parametrize("args, message", [
    (["--policies", "b0,b9"], "b9"),
    (["--load", "0"], "load > 0"),
    (["--noise", "1.5"], "noise levels"),
])
def test_simulate_rejects_bad_options(tmp_path, args, message):
    res = CliRunner().invoke(simulate_command, [*SMALL, *args, "--out", str(tmp_path)])
    assert res.exit_code != 0 and message in res.output


def test_simulate_reports_wrong_headers_cleanly(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    (d / "openb_pod_list_default.csv").write_text("name,cpu,gpu\np,1,1\n")
    res = CliRunner().invoke(simulate_command, ["--workload", "alibaba-v2023", "--data-dir", str(d), "--no-progress",
                                                "--out", str(tmp_path / "out")])
    assert res.exit_code == 1
    assert "header does not match" in res.output and "missing: cpu_milli" in res.output


@pytest.mark.skipif(not DATA.is_dir(), reason=f"shared workload data not found at {DATA}")
def test_simulate_alibaba_trace_subset(tmp_path):
    res = _run(["--workload", "alibaba-v2023", "--data-dir", str(DATA), "--jobs", "300", "--gpus", "16",
                "--load", "0.8", "--noise", "none", "--no-progress"], tmp_path)
    assert res.exit_code == 0, res.output
    meta = json.loads((tmp_path / "out" / "results.json").read_text())["meta"]
    assert meta["data_source"]["name"] == "alibaba-v2023" and meta["data_source"]["jobs"] == 300
    assert "Gavel" in meta["interference"]["method"]
    assert len(meta["data_source"]["files"][0]["sha256"]) == 64
