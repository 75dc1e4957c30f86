"""The report's "Interference: predicted vs observed": ``compare`` on hand-built shared runs and
models, every figure computed by hand from s(u, v) = 1 + a v + b max(0, u + v - 1); the table,
JSON, CSV, HTML and the plot built from it."""
from __future__ import annotations

import csv
import io
import json

import pytest

from policy_service.config import InterferenceConfig
from policy_service.core.interference import KneeParams
from policy_service.core.interference_learn import LearnedModel, Prior, SharedRun, Source
from policy_service.core.interference_rule import InterferenceView
from policy_service.report import build_report
from policy_service.report.formats import format_csv, format_json, format_table
from policy_service.report.html import format_html
from policy_service.report.interference import ALL, compare, no_runs_line
from policy_service.report.model import InterferenceSection
from policy_service.report.plots import write_plots

PRIOR = Prior("testprior", KneeParams(0.5, 2.0))
CFG = InterferenceConfig()  # max_others_util 7


def model(gpu_type: str, source: Source, a: float, b: float, runs: int = 0, users: int = 0) -> LearnedModel:
    return LearnedModel(gpu_type, source, KneeParams(a, b), PRIOR, runs, users, float(runs), 25.0, None,
                        f"{source.value} {gpu_type}")


PRIOR_MODEL = model("*", Source.PRIOR, 0.5, 2.0)
# a100 has a learned model (a 1, b 0); h100 and untyped runs are judged by the pooled one, the prior
VIEW = InterferenceView(PRIOR_MODEL, (("a100", model("a100", Source.LEARNED, 1.0, 0.0, 30, 4)),
                                      ("h100", model("h100", Source.PRIOR, 0.5, 2.0, 1, 1))))


def run(gpu_type: str, user: str, runtime: float, solo: float, u_self: float, others: tuple, exit_code: int = 0):
    return SharedRun(gpu_type=gpu_type, user=user, job_class=f"c-{user}", runtime_s=runtime, exit_code=exit_code,
                     solo_runtime_s=solo, solo_runs=3, u_self=u_self, u_others=others)


RUNS = (
    ("d1", run("A100", "ann", 300, 200, 0.5, (0.3, 0.2))),  # v 0.5: observed 1.5, model 1.5, prior 1.25
    ("d2", run("a100", "bob", 240, 100, 0.8, (0.4,))),  # observed 2.4, model 1.4, prior 1 + .2 + 2 x .2 = 1.6
    ("d3", run("h100", "ann", 110, 100, 0.2, (0.2,))),  # observed 1.1, prior (both) 1.1
    ("d4", run("", "cyd", 150, 100, 0.6, (0.6,))),  # untyped: observed 1.5, prior (both) 1 + .3 + 2 x .2 = 1.7
    ("d5", run("a100", "dee", 300, 100, 0.5, (None,))),  # a co-runner not learned
    ("d6", run("a100", "dee", 300, 100, 0.5, (0.5,), exit_code=1)),  # failed
    ("d7", run("a100", "dee", 300, 100, 0.5, (4.0, 4.0))),  # co-runners' 8.0 > max_others_util 7
)


def test_each_run_is_predicted_by_its_types_model_and_by_the_prior():
    sec = compare(RUNS, VIEW, PRIOR_MODEL, CFG)
    got = {r.decision_id: (r.gpu_type, r.u_self, r.u_others, r.observed, r.predicted_learned, r.predicted_prior,
                           r.model_type) for r in sec.runs}
    assert got == {
        "d1": ("a100", 0.5, pytest.approx(0.5), pytest.approx(1.5), pytest.approx(1.5), pytest.approx(1.25), "a100"),
        "d2": ("a100", 0.8, 0.4, pytest.approx(2.4), pytest.approx(1.4), pytest.approx(1.6), "a100"),
        "d3": ("h100", 0.2, 0.2, pytest.approx(1.1), pytest.approx(1.1), pytest.approx(1.1), "*"),
        "d4": ("", 0.6, 0.6, pytest.approx(1.5), pytest.approx(1.7), pytest.approx(1.7), "*"),
    }
    assert dict(sec.refused) == {"a co-runner's solo utilisation is not learned yet": 1,
                                 "failed, or no runtime": 1, "refused (util_range)": 1}
    assert sec.prior == "testprior: a 0.500, b 2.000" and sec.learn


def test_the_summary_per_gpu_type_and_over_all():
    sec = compare(RUNS, VIEW, PRIOR_MODEL, CFG)
    by = {x.gpu_type: x for x in sec.summary}
    assert [x.gpu_type for x in sec.summary] == ["", "a100", "h100", ALL]
    a100 = by["a100"]
    assert (a100.runs, a100.users, a100.model_type, a100.model_source, a100.model_runs) == (2, 2, "a100", "learned", 30)
    assert a100.mae_learned == pytest.approx((0.0 + 1.0) / 2)  # |1.5 - 1.5|, |1.4 - 2.4|
    assert a100.mae_prior == pytest.approx((0.25 + 0.8) / 2)  # |1.25 - 1.5|, |1.6 - 2.4|
    h100 = by["h100"]  # its own model is not learned: the pooled one (the prior) judges it
    assert (h100.runs, h100.model_type, h100.model_source, h100.mae_learned, h100.mae_prior) == (
        1, "*", "prior", pytest.approx(0.0), pytest.approx(0.0))
    assert by[""].mae_learned == pytest.approx(0.2) and by[""].model_type == "*"
    total = by[ALL]
    assert (total.runs, total.users, total.model_type) == (4, 3, "*")
    assert total.mae_learned == pytest.approx((0 + 1.0 + 0 + 0.2) / 4)
    assert total.mae_prior == pytest.approx((0.25 + 0.8 + 0 + 0.2) / 4)
    assert (total.model_base, total.model_slope) == (0.5, 2.0)


def test_no_shared_run_says_so_in_one_line():
    sec = compare([RUNS[4]], VIEW, PRIOR_MODEL, CFG)
    assert sec.runs == () and sec.summary[-1].runs == 0 and sec.summary[-1].mae_learned is None
    line = no_runs_line(sec)
    assert line.startswith("interference: no shared run in the history") and "\n" not in line
    assert "a co-runner's solo utilisation is not learned yet 1" in line
    assert no_runs_line(compare(RUNS, VIEW, PRIOR_MODEL, CFG)) == ""
    assert no_runs_line(InterferenceSection(error="no history")) == "interference: not read (no history)"
    assert no_runs_line(None) == ""


def _report(sec):
    from tests.unit.report.test_report import T0  # noqa: F401  (only the epoch the report tests use)

    return build_report([], _empty_history(), by="user", shards_per_gpu=8, now=float(T0), interference=sec)


def _empty_history():
    from policy_service.report.model import HistorySnapshot

    return HistorySnapshot()


def test_the_formats_carry_the_section():
    rep = _report(compare(RUNS, VIEW, PRIOR_MODEL, CFG))
    table = format_table(rep)
    assert "Interference: predicted vs observed slowdowns (4 shared runs)" in table
    (a100,) = [line for line in table.splitlines() if line.startswith("a100 ")]
    assert a100.split()[:4] == ["a100", "2", "2", "0.50"]
    assert float(a100.split()[4]) == pytest.approx((0.25 + 0.8) / 2, abs=0.006)  # 0.525, to two places
    assert "learned (a100, 30 runs, 4 users): a 1.000, b 0.000" in a100
    assert "d2" not in table and "d2 " in format_table(rep, with_runs=True)

    doc = json.loads(format_json(rep))
    assert doc["interference"]["summary"][1]["gpu_type"] == "a100" and "runs" not in doc["interference"]
    runs = json.loads(format_json(rep, with_runs=True))["interference"]["runs"]
    assert [r["decision_id"] for r in runs] == ["d1", "d2", "d3", "d4"] and runs[1]["predicted_learned"] == 1.4

    rows = list(csv.DictReader(io.StringIO(format_csv(rep, with_runs=True))))
    assert [(r["decision_id"], r["observed"], r["predicted_prior"]) for r in rows][1] == ("d2", "2.4", "1.6")
    assert list(csv.DictReader(io.StringIO(format_csv(rep))))[0]["by"] == "user"  # the groups, as before

    page = format_html(rep, with_runs=True)
    assert "<h2>Interference: predicted vs observed</h2>" in page and "<td>d4</td>" in page


def test_the_plot_is_drawn_with_shared_runs_and_skipped_without(tmp_path):
    with_runs = write_plots(tmp_path / "a", _report(compare(RUNS, VIEW, PRIOR_MODEL, CFG)))
    assert [p.name for p in with_runs][-1] == "interference.png" and with_runs[-1].stat().st_size > 10_000
    without = write_plots(tmp_path / "b", _report(compare([RUNS[4]], VIEW, PRIOR_MODEL, CFG)))
    assert "interference.png" not in [p.name for p in without] and len(without) == 4
    assert "interference.png" not in [p.name for p in write_plots(tmp_path / "c", _report(None))]
