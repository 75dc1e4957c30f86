"""Output formats of a report: JSON, CSV and the terminal table."""
from __future__ import annotations

import csv
import dataclasses
import enum
import io
import json
import time
from typing import Any

from policy_service.report.interference import no_runs_line
from policy_service.report.model import (GIB, HOUR_S, GroupSummary, InterferenceRun, InterferenceSection,
                                         InterferenceSummary, JobReport, Report)

def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, float):
        return round(value, 6)
    return value


def _row(obj: Any) -> dict[str, Any]:
    return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}


GROUP_COLUMNS = tuple(f.name for f in dataclasses.fields(GroupSummary))
JOB_COLUMNS = tuple(f.name for f in dataclasses.fields(JobReport))
RUN_COLUMNS = tuple(f.name for f in dataclasses.fields(InterferenceRun))


def interference_to_dict(sec: InterferenceSection | None, *, with_runs: bool = False) -> dict[str, Any] | None:
    """The "interference" object of the JSON (None: not read at all)."""
    if sec is None:
        return None
    out: dict[str, Any] = {"available": not sec.error, "error": sec.error or None, "learn": sec.learn,
                           "prior": sec.prior, "summary": [_row(x) for x in sec.summary],
                           "refused": dict(sec.refused)}
    if with_runs:
        out["runs"] = [_row(r) for r in sec.runs]
    return out


def report_to_dict(rep: Report, *, with_jobs: bool = False, with_runs: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {
        "meta": {
            "by": rep.by, "start": rep.start, "end": rep.end, "generated_at": rep.generated_at,
            "generated_at_iso": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(rep.generated_at)),
            "shards_per_gpu": rep.shards_per_gpu, "slurm_backend": rep.slurm_backend,
            "history": {"path": rep.history_path, "available": not rep.history_error,
                        "error": rep.history_error or None},
            "non_gpu_jobs_skipped": rep.non_gpu_jobs, "definitions": "docs/reporting.md",
        },
        "groups": [_row(g) for g in rep.groups],
        "total": _row(rep.total),
    }
    if with_jobs:
        out["jobs"] = [_row(j) for j in rep.jobs]
    out["interference"] = interference_to_dict(rep.interference, with_runs=with_runs)
    return out


def format_json(rep: Report, *, with_jobs: bool = False, with_runs: bool = False) -> str:
    return json.dumps(report_to_dict(rep, with_jobs=with_jobs, with_runs=with_runs), indent=2, sort_keys=False)


def format_csv(rep: Report, *, with_jobs: bool = False, with_runs: bool = False) -> str:
    """Groups plus a '(total)' row; with ``with_jobs``, one row per job instead; with
    ``with_runs``, one row per shared run (predicted vs observed slowdown) instead."""
    buf = io.StringIO()
    if with_runs:
        w = csv.DictWriter(buf, fieldnames=RUN_COLUMNS, lineterminator="\n")
        w.writeheader()
        for r in rep.interference.runs if rep.interference is not None else ():
            w.writerow({k: _csv(v) for k, v in _row(r).items()})
    elif with_jobs:
        w = csv.DictWriter(buf, fieldnames=("group", *JOB_COLUMNS), lineterminator="\n")
        w.writeheader()
        for j in rep.jobs:
            w.writerow({"group": getattr(j, rep.by) or "(none)", **{k: _csv(v) for k, v in _row(j).items()}})
    else:
        w = csv.DictWriter(buf, fieldnames=("by", *GROUP_COLUMNS), lineterminator="\n")
        w.writeheader()
        for g in (*rep.groups, rep.total):
            w.writerow({"by": rep.by, **{k: _csv(v) for k, v in _row(g).items()}})
    return buf.getvalue()


def _csv(v: Any) -> Any:
    return "" if v is None else v


def fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 2 * HOUR_S:
        return f"{seconds / 60:.1f}m"
    if seconds < 48 * HOUR_S:
        return f"{seconds / HOUR_S:.1f}h"
    return f"{seconds / 86400:.1f}d"


def _gib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / GIB:.1f}G"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}%"


def _hours(x: float) -> str:
    return f"{x:.3f}" if x < 10 else f"{x:.1f}" if x < 1000 else f"{x:.0f}"


_TABLE = (  # header, width, cell
    ("jobs", 5, lambda g: str(g.jobs)),
    ("shared", 6, lambda g: str(g.shared_jobs)),
    ("whole", 5, lambda g: str(g.whole_gpu_jobs)),
    ("pend", 4, lambda g: str(g.not_started)),
    ("norec", 5, lambda g: str(g.no_record)),
    ("overr", 5, lambda g: str(g.overridden)),
    ("gpu_h", 8, lambda g: _hours(g.gpu_hours_used)),
    ("saved_h", 8, lambda g: _hours(g.gpu_hours_saved)),
    ("wait50", 6, lambda g: fmt_duration(g.wait_median_s)),
    ("waitmax", 7, lambda g: fmt_duration(g.wait_max_s)),
    ("obs", 4, lambda g: str(g.observed_jobs)),
    ("peakmax", 7, lambda g: _gib(g.observed_peak_max_bytes)),
    ("err50", 5, lambda g: _pct(g.abs_pct_error_median)),
    ("under", 5, lambda g: f"{g.under_predicted}/{g.predicted_jobs}"),
    ("oom", 3, lambda g: str(g.ooms)),
)


def notes(rep: Report) -> list[str]:
    """The lines under the summary table (terminal and HTML)."""
    t = rep.total
    lines = []
    if t.whole_because:
        lines.append("whole-GPU decisions by reason: " + ", ".join(
            item.replace("=", " ") for item in t.whole_because.split(";")))
    if t.shadow_jobs:
        lines.append(f"shadow mode: {t.shadow_jobs} decision(s), {t.shadow_would_share} would have shared, "
                     f"{t.shadow_gpu_hours_freed:.2f} GPU-h freed, {t.shadow_would_oom} observed peak(s) above the "
                     "shards they would have had")
    return lines


def _slowdown(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def model_cell(x: InterferenceSummary) -> str:
    """The model that judges a GPU type's runs, in a few words."""
    where = "all types" if x.model_type == "*" else x.model_type
    return (f"{x.model_source} ({where}, {x.model_runs} runs, {x.model_users} users): "
            f"a {x.model_base:.3f}, b {x.model_slope:.3f}")


# The interference summary: header, cell (terminal and HTML)
INTERFERENCE_TABLE = (
    ("gpu_type", lambda x: x.gpu_type or "(untyped)"),
    ("runs", lambda x: str(x.runs)),
    ("users", lambda x: str(x.users)),
    ("mae_model", lambda x: _slowdown(x.mae_learned)),
    ("mae_prior", lambda x: _slowdown(x.mae_prior)),
    ("model", model_cell),
)
RUN_TABLE = (  # header, cell (the runs listed with --interference)
    ("decision", lambda r: r.decision_id), ("gpu_type", lambda r: r.gpu_type or "-"), ("user", lambda r: r.user),
    ("u_self", lambda r: f"{r.u_self:.2f}"), ("u_others", lambda r: f"{r.u_others:.2f}"),
    ("observed", lambda r: _slowdown(r.observed)), ("model", lambda r: _slowdown(r.predicted_learned)),
    ("prior", lambda r: _slowdown(r.predicted_prior)), ("by", lambda r: r.model_type),
)


def interference_notes(sec: InterferenceSection) -> list[str]:
    """The lines under the interference table (terminal and HTML)."""
    lines = [no_runs_line(sec)] if no_runs_line(sec) else []
    if not sec.error:
        lines += ["observed: runtime / the class's solo runtime; predicted: s(u, v) = 1 + a v + b max(0, u + v - 1),",
                  f"u the class's solo utilisation, v the co-runners' summed (as the classes' figures are now); "
                  f"prior {sec.prior}" + ("" if sec.learn else "; interference.learn is off: the prior decides")]
    if sec.refused and sec.runs:
        lines.append("shared runs that could not teach the model: " +
                     ", ".join(f"{why} {n}" for why, n in sec.refused))
    return lines


def _columns(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    """Left-aligned first and last column, the rest right-aligned, each as wide as it needs."""
    widths = [max(len(c) for c in col) for col in zip(header, *rows)]
    last = len(header) - 1
    return ["  ".join(c.ljust(w) if i in (0, last) else c.rjust(w)
                      for i, (c, w) in enumerate(zip(cells, widths))).rstrip() for cells in (header, *rows)]


def format_interference(sec: InterferenceSection, *, with_runs: bool = False) -> list[str]:
    """The "Interference: predicted vs observed" part of the terminal table."""
    lines = ["", f"Interference: predicted vs observed slowdowns ({len(sec.runs)} shared runs)"]
    if sec.summary and sec.runs:
        lines += _columns(tuple(h for h, _ in INTERFERENCE_TABLE),
                          [tuple(f(x) for _, f in INTERFERENCE_TABLE) for x in sec.summary])
    lines += interference_notes(sec)
    if with_runs and sec.runs:
        lines += [""] + _columns(tuple(h for h, _ in RUN_TABLE), [tuple(f(r) for _, f in RUN_TABLE) for r in sec.runs])
    return lines


def format_table(rep: Report, *, with_jobs: bool = False, with_runs: bool = False) -> str:
    rows = [*rep.groups, rep.total]
    kw = max([len(rep.by), 9, *(len(g.key) for g in rows)])
    head = rep.by.upper().ljust(kw) + "  " + " ".join(h.rjust(w) for h, w, _ in _TABLE)
    lines = [f"swapaware report  {rep.start or '?'} .. {rep.end or 'now'}  by {rep.by}  "
             f"({rep.total.jobs} GPU jobs, {rep.non_gpu_jobs} non-GPU jobs skipped, "
             f"{rep.shards_per_gpu} shards/GPU)", head, "-" * len(head)]
    for g in rows:
        if g is rep.total:
            lines.append("-" * len(head))
        lines.append(g.key.ljust(kw) + "  " + " ".join(cell(g).rjust(w) for _, w, cell in _TABLE))
    lines += ["shared: < 1 GPU of shards; whole: gpu or all shards of one; pend: never started; norec: no decision;",
              "overr: allocation or AdminComment disagrees with the decision; gpu_h/saved_h: GPU-hours used/saved;",
              "wait: submit to start; err50: median |predicted-observed|/observed peak; under: observed > predicted",
              "+ margin / jobs compared; oom: OOMs observed. Definitions: swapaware report --help, docs/reporting.md"]
    lines.extend(notes(rep))
    if rep.history_error:
        lines.append(f"WARNING: history not read ({rep.history_error}): accounting columns only")
    if rep.interference is not None:
        lines += format_interference(rep.interference, with_runs=with_runs)
    if with_jobs and rep.jobs:
        lines += ["", _format_jobs(rep)]
    return "\n".join(lines)


def _format_jobs(rep: Report) -> str:
    cols = (("job", 8), (rep.by, 10), ("state", 10), ("alloc", 9), ("action", 22), ("status", 35),
            ("gpu_h", 7), ("saved_h", 7), ("wait", 6), ("pred", 6), ("obs", 6), ("oom", 3))
    out = [" ".join(n.ljust(w) if i < 6 else n.rjust(w) for i, (n, w) in enumerate(cols))]
    for j in rep.jobs:
        alloc = f"shard:{j.shards}" if j.shards else (f"gpu:{j.gpus}" if j.gpus else "-")
        action = j.action + (f":{j.decided_shards}" if j.decided_shards else "") if j.action else "-"
        status = j.status.value + (f" {j.override_reason.value}" if j.override_reason else "")
        oom = "-" if j.oom is None else "yes" if j.oom else "no"
        cells = (str(j.job_id), getattr(j, rep.by) or "(none)", j.state[:10], alloc, action, status,
                 f"{j.gpu_hours_used:.3f}", f"{j.gpu_hours_saved:.3f}", fmt_duration(j.wait_s),
                 _gib(j.predicted_peak_bytes), _gib(j.observed_peak_bytes), oom)
        out.append(" ".join(c.ljust(w) if i < 6 else c.rjust(w) for i, (c, (_, w)) in enumerate(zip(cells, cols))))
    return "\n".join(out)
