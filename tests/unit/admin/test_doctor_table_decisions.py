"""doctor's table_decisions check (policy_service/admin/table_decisions.py): did slurmctld decide
recent jobs from the admission table? Slurm is the one stand-in: ``CommentsCli`` is the real
``CliSlurm`` (the catch-up's argv and parsers, slurm_comments.py) with its subprocess answering as
squeue -O and sacct -P print (24.11 shapes, as tests/adapter/admission/test_admission_catchup.py's). The
AdminComments are the service's own (policy.admin_comment), the table-made ones given their token
as the service builds a template (admission.with_table_ref) and their id as the plugin does."""
from __future__ import annotations

from pathlib import Path

import pytest

from policy_service.admin.host import host_checks
from policy_service.admin.table_decisions import recent_decisions, table_decisions_checks
from policy_service.admin.wiring import plugin_settings
from policy_service.slurm.slurm import CliSlurm
from policy_service.slurm.slurm_comments import CommentedJob, sacct_argv, squeue_argv
from policy_service.slurm.slurm_text import SlurmError
from policy_service.config import AdmissionConfig, Config, ServiceConfig
from policy_service.core.admission import PLACEHOLDER_ID, TableRef, with_table_ref
from policy_service.core.dialect import dialect_for
from policy_service.core.policy import admin_comment
from policy_service.core.types import Action, DemandEstimate, EstimateSource, Reason, ReasonCode

from tests.unit.doctor_layout import SUBMIT_FILES, install_lua, open_dir  # noqa: F401  (fixture)
from tests.commented_rows import commented_row
from tests.unit.admin.test_doctor import GOOD_SLURM_CONF

NOW = 1_796_418_925.0
DAY = 86400.0
VERSION, OLDER = "0123456789abcdef", "fedcba9876543210"
GIB = 1 << 30


def service_comment(n: int, action=Action.SHARE, shards=4) -> str:
    """The AdminComment the service gives decision ``n`` (the Admit round trip)."""
    est = DemandEstimate(9 * GIB, GIB, EstimateSource.CLASS, 5, 9 * GIB)
    return admin_comment(f"5e4a1c0d{n:08x}", "m12", action, shards, est, 120,
                         (Reason(ReasonCode.ESTIMATE_FROM_HISTORY, "fits"),), 400)


def table_comment(n: int, ref: TableRef) -> str:
    """The AdminComment the plugin gives a job from the table: the template (placeholder id, token
    after it), then the plugin's own id (8 random hex + an 8 hex counter)."""
    est = DemandEstimate(9 * GIB, GIB, EstimateSource.CLASS, 5, 9 * GIB)
    template = with_table_ref(admin_comment(PLACEHOLDER_ID, "m12", Action.SHARE, 4, est, 120,
                                            (Reason(ReasonCode.ESTIMATE_FROM_HISTORY, "fits"),), 400), ref, 400)
    return template.replace(f"id={PLACEHOLDER_ID}", f"id=a1b2c3d4{n:08x}")


def job(job_id: int, comment: str, age_s: float, state="RUNNING") -> CommentedJob:
    return CommentedJob(job_id, int(NOW - age_s), 1001, "alice", "proj", "gpu", state, comment, "squeue")


class CommentsCli(CliSlurm):
    """``CliSlurm`` whose squeue shows ``live`` and whose sacct shows ``accounted``; ``fail``: every
    command exits 1 with it."""

    def __init__(self, live=(), accounted=(), fail=""):
        super().__init__(dialect=dialect_for((24, 11)))
        self.live, self.accounted, self.fail = list(live), list(accounted), fail
        self.calls: list[list[str]] = []

    def _run(self, argv, env_extra=None):
        self.calls.append(list(argv))
        if self.fail:
            raise SlurmError(f"{' '.join(argv)} exited 1: {self.fail}")
        if argv == squeue_argv():
            return "".join(commented_row(j, "(null)") + "\n" for j in self.live)
        assert argv[:-10] == sacct_argv(0)[:-10], argv
        return "".join(commented_row(j, "") + "\n" for j in self.accounted)


CFG = Config()  # [admission] table_path = "auto": /run/swapaware/admission.json
SETTINGS = plugin_settings(None)  # the plugin's defaults: table=auto, the same file


def run(slurm, cfg=CFG, settings=SETTINGS):
    return table_decisions_checks(cfg, settings, "/etc/slurm", "slurm", 64030, slurm=slurm, clock=lambda: NOW)


def test_ok_counts_each_decision_once_within_the_window_and_names_the_newest_table_job():
    live = [job(501, table_comment(9, TableRef(VERSION, 12, "normal")), 60),
            job(502, service_comment(2), 30),  # newer, from the round trip
            job(503, "", 20),  # not a GPU job: no AdminComment
            job(504, "user's own note", 10)]
    accounted = [job(501, table_comment(9, TableRef(VERSION, 12, "normal")), 60),  # squeue shows it too
                 job(480, table_comment(3, TableRef(OLDER, 7, "*")), 3600, "COMPLETED"),
                 job(470, service_comment(1), 7200, "COMPLETED"),
                 job(400, table_comment(1, TableRef(OLDER, 1, "short")), DAY + 60, "COMPLETED")]  # before the window
    cli = CommentsCli(live, accounted)
    [check] = run(cli)
    assert (check.name, check.label) == ("table_decisions", " OK ")
    assert check.detail.startswith("2 of 4 recent swapaware decisions came from the table (newest job 501, "
                                   f"version {VERSION})"), check.detail
    assert "the last 24 h (service.reconcile_window_s)" in check.detail
    assert "the 1 newer one(s) took the round trip" in check.detail
    # the catch-up's two reads, the sacct from the window's start
    assert [a[0] for a in cli.calls] == ["squeue", "sacct"]
    assert cli.calls[1] == sacct_argv(NOW - DAY)


def test_decisions_but_none_from_the_table_warns_with_the_fix():
    cli = CommentsCli([job(601, service_comment(6, Action.WHOLE_GPU, 8), 100)],
                      [job(590, service_comment(5), 5000, "COMPLETED")])
    [check] = run(cli, settings=plugin_settings("table_uids=0,64030,990\n"))
    assert check.label == "WARN" and check.ok
    assert "none of the 2 swapaware decision(s)" in check.detail and "newest job 601" in check.detail
    assert "/run/swapaware/admission.json" in check.detail
    for cause in ("slurmctld.log", "admission file /run/swapaware/admission.json not used", "plugin_table",
                  "table_uids=0,990,64030", "lua-posix", "valid_until", "/etc/slurm/swapaware_plugin.conf"):
        assert cause in check.fix, cause


@pytest.mark.parametrize("slurm, words", [
    (CommentsCli(fail="sacct: error: Problem talking to the database: Connection refused"),
     ["not checked: Slurm could not be asked", "Problem talking to the database", "as slurm"]),
    (CommentsCli([job(701, "", 30)], [job(400, table_comment(1, TableRef(VERSION, 1, "short")), 2 * DAY)]),
     ["no swapaware decision in the last 24 h", "PrivateData=jobs"]),
])
def test_skips_where_slurm_cannot_be_asked_or_shows_no_recent_decision(slurm, words):
    [check] = run(slurm)
    assert check.label == "SKIP" and check.ok
    for w in words:
        assert w in check.detail, (w, check.detail)


def test_shown_only_where_the_service_and_the_plugin_both_have_a_table():
    cli = CommentsCli([job(501, table_comment(9, TableRef(VERSION, 12, "normal")), 60)])
    no_service_table = Config(admission=AdmissionConfig(table_path=""))
    assert run(cli, cfg=no_service_table) == []
    assert run(cli, settings=plugin_settings("table=\n")) == []
    assert cli.calls == []  # Slurm not asked
    assert [c.label for c in run(cli, settings=plugin_settings("table=/run/swapaware/admission.json\n"))] == [" OK "]


def test_a_re_decided_job_counts_by_its_current_decision():
    # the service re-decided a pending job the plugin had decided from the table: its AdminComment
    # now names the service's decision only
    ref = TableRef(VERSION, 3, "long")
    assert [d.ref for d in recent_decisions([job(801, table_comment(1, ref), 50)], NOW - DAY)] == [ref]
    assert [d.ref for d in recent_decisions([job(801, service_comment(8), 50, "PENDING")], NOW - DAY)] == [None]


def test_not_asked_without_probes(open_dir):  # noqa: F811
    etc = open_dir / "etc" / "slurm"
    install_lua(etc, SUBMIT_FILES)
    (etc / "slurm.conf").write_text(GOOD_SLURM_CONF)
    cfg = Config(service=ServiceConfig(socket_path=Path(open_dir / "run" / "policy.sock")))
    (etc / "swapaware_plugin.conf").write_text(f"socket={cfg.service.socket_path}\n")
    names = [c.name for c in host_checks(etc / "slurm.conf", GOOD_SLURM_CONF, cfg, "ctl01", probes=False)]
    assert "slurmuser_table" in names and "table_decisions" not in names
