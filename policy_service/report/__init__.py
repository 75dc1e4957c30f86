"""``swapaware report``: the admins' view of what swapaware did.

Accounting (``SlurmAccess.accounting_jobs``: pyslurm's db API where its version matches the
cluster, else ``sacct --json``) joined with the service's history (read-only SQLite): per user /
account / partition, jobs shared vs whole-GPU, GPU-hours used and saved, queue wait, predicted vs
observed GPU memory, OOMs and decisions that were overridden; shared runs' predicted vs observed
slowdowns (the site's interference model and the prior). Every definition is written down in
docs/reporting.md.

  model.py      the records and the report (frozen dataclasses), errors
  join.py       the accounting join (pure ``join_job``/``judge``; ``read_history`` reads SQLite)
  aggregate.py  per-group sums (``summarize``, ``build_report``) and ``load_report``
  interference.py  shared runs' predicted vs observed slowdowns (pure ``compare``; ``load_interference``)
  formats.py    JSON, CSV, the terminal table
  plots.py      PNG plots (matplotlib, optional)
  command.py    the click command
"""
from policy_service.report.aggregate import build_report, load_report, summarize
from policy_service.report.command import report_command
from policy_service.report.formats import fmt_duration, format_csv, format_json, format_table, report_to_dict
from policy_service.report.join import (
    allocated_anything,
    decision_from_row,
    join_job,
    judge,
    live_admin_comments,
    parse_tres,
    read_history,
    whole_because,
)
from policy_service.report.interference import compare as compare_interference, load_interference
from policy_service.report.model import (
    GROUP_KEYS,
    SHARED_ACTIONS,
    GroupSummary,
    HistoryDecision,
    HistoryObservation,
    HistorySnapshot,
    HistoryUnavailable,
    InterferenceRun,
    InterferenceSection,
    InterferenceSummary,
    JobReport,
    OverrideReason,
    RecordStatus,
    Report,
    ReportError,
    TresCounts,
)
from policy_service.report.plots import PlotsUnavailable, write_plots

__all__ = [
    "GROUP_KEYS", "SHARED_ACTIONS", "GroupSummary", "HistoryDecision", "HistoryObservation", "HistorySnapshot",
    "HistoryUnavailable", "InterferenceRun", "InterferenceSection", "InterferenceSummary", "JobReport",
    "OverrideReason", "PlotsUnavailable", "RecordStatus", "Report", "ReportError", "TresCounts",
    "allocated_anything", "build_report", "compare_interference", "decision_from_row", "fmt_duration", "format_csv",
    "format_json", "format_table", "join_job", "judge", "live_admin_comments", "load_interference", "load_report",
    "parse_tres", "read_history", "report_command", "report_to_dict", "summarize", "whole_because", "write_plots",
]
