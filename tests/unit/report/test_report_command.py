"""``swapaware report``, the command: its options and config (format, grouping, window, backend and
release), the warning without a history, the plots (and without matplotlib), the one self-contained
HTML page, and its place in the CLI.

The small world comes from test_report.py."""
from __future__ import annotations

import csv
import io
import json
import sys

import pytest
from click.testing import CliRunner

from policy_service import report as R
from policy_service.report import command as report_cli
from policy_service.slurm.slurm import ClusterRelease
from policy_service.core.dialect import parse_release
from tests.unit.report.test_report import GIB, T0, build, scenario, world  # noqa: F401  (the fixture)


# ----------------------------------------------------------------------------- the command
@pytest.fixture
def cli_world(world, tmp_path, monkeypatch):
    scenario(world)
    world.flush()
    conf = tmp_path / "swapaware.toml"
    conf.write_text(f'[service]\ndb_path = "{world.db}"\nslurm_backend = "cli"\nslurm_release = "24.11"\n'
                    '[gpu]\nshards_per_gpu = 8\n')
    opened = []

    def fake_release(configured, timeout_s):  # never this host's scontrol
        return ClusterRelease(parse_release(configured) if configured else None, "test")

    def fake_open(backend, timeout_s, release):
        opened.append((backend, timeout_s))
        world.release = release
        return world.slurm

    monkeypatch.setattr(report_cli, "cluster_release", fake_release)
    monkeypatch.setattr(report_cli, "open_slurm", fake_open)
    monkeypatch.delenv("SWAPAWARE_CONFIG", raising=False)
    world.conf, world.opened = conf, opened
    world.slurm.lookups.clear()
    return world


def _invoke(w, *args):
    return CliRunner().invoke(R.report_command, [*args, "--config", str(w.conf)],
                                              catch_exceptions=False)


def test_command_json(cli_world):
    res = _invoke(cli_world, "--format", "json", "--by", "account", "--start", "2026-11-01", "--end", "now")
    assert res.exit_code == 0, res.output + res.stderr
    doc = json.loads(res.stdout)
    assert cli_world.slurm.queries == [("2026-11-01", "now")]
    assert cli_world.opened[0][0].value == "cli" and cli_world.opened[0][1] == 120.0
    assert cli_world.release.dialect.sacct_json_arg == "--json=v0.0.42"  # service.slurm_release = "24.11"
    assert doc["meta"]["start"] == "2026-11-01" and doc["meta"]["slurm_backend"] == "FakeSlurm"
    assert [g["key"] for g in doc["groups"]] == ["proj"] and doc["total"]["shared_jobs"] == 2
    assert doc["total"]["gpu_hours_saved"] > 0 and doc["total"]["observed_jobs"] == 5
    assert cli_world.slurm.lookups == [106]  # the pending GPU job's comment, read live


def test_command_defaults_table_and_csv(cli_world):
    res = _invoke(cli_world)
    assert res.exit_code == 0, res.stderr
    assert cli_world.slurm.queries == [("now-7days", "now")]
    assert res.stdout.splitlines()[1].startswith("USER")
    res = _invoke(cli_world, "--format", "csv", "--jobs")
    rows = list(csv.DictReader(io.StringIO(res.stdout)))
    assert {int(r["job_id"]) for r in rows} == {101, 102, 103, 104, 105, 106, 108}
    assert next(r for r in rows if r["job_id"] == "106")["status"] == "no_record"  # read live: none


def test_command_warns_without_history(cli_world, tmp_path):
    cli_world.conf.write_text(f'[service]\ndb_path = "{tmp_path / "gone.sqlite3"}"\n')
    res = _invoke(cli_world, "--format", "json")
    assert res.exit_code == 0
    assert "WARNING: no history database" in res.stderr
    assert json.loads(res.stdout)["meta"]["history"]["available"] is False


def test_command_plots(cli_world, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "plots"
    res = _invoke(cli_world, "--plot", str(out))
    assert res.exit_code == 0, res.stderr
    for name in ("gpu_hours.png", "jobs.png", "memory_pred_vs_obs.png", "queue_wait.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name
    assert "wrote" in res.stderr


def test_command_plots_without_matplotlib(cli_world, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    res = _invoke(cli_world, "--plot", str(tmp_path / "plots"))
    assert res.exit_code != 0
    assert "pip install 'swapaware[plots]'" in res.stderr
    assert cli_world.slurm.queries == []  # failed before asking accounting


def test_command_is_registered_in_the_cli():
    from policy_service.cli import main

    assert "report" in main.commands


# ----------------------------------------------------------------------------- the HTML page
def test_command_writes_one_self_contained_html_page(cli_world, tmp_path):
    out = tmp_path / "site" / "report.html"
    res = _invoke(cli_world, "--html", str(out), "--jobs")
    assert res.exit_code == 0, res.output
    page = out.read_text()
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert page.count('src="data:image/png;base64,') == 4  # the four plots, inline
    assert "src=\"http" not in page and "<link" not in page and "<script" not in page  # nothing fetched
    rep = build(cli_world)
    for g in (*rep.groups, rep.total):
        assert f"<td>{g.key}</td>" in page
    assert page.count("<tr") == 1 + len(rep.groups) + 1 + 1 + len(rep.jobs)  # summary header+rows, jobs header+rows


def test_html_page_escapes_what_users_typed_and_says_when_plots_are_missing(world, monkeypatch, tmp_path):
    from policy_service.report.command import write_html

    world.job(301, name="<script>alert(1)</script>", submit=T0, run_s=60, peak=GIB)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    out = tmp_path / "r.html"
    write_html(out, build(world), with_jobs=True)
    page = out.read_text()
    assert "<script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "plots not drawn" in page and "pip install" in page and "data:image/png" not in page
