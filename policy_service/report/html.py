"""One self-contained HTML page of a report: the summary table, the notes under it, the jobs
(optional) and the PNG plots inline (data URIs): one file an admin can open or publish."""
from __future__ import annotations

import base64
import html
import time
from pathlib import Path
from typing import Iterable

from policy_service.report.formats import INTERFERENCE_TABLE, RUN_TABLE, _TABLE, fmt_duration, interference_notes, notes
from policy_service.report.model import GIB, InterferenceSection, Report

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.1em; margin-top: 2em; }
table { border-collapse: collapse; font-size: 0.85em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; }
th:first-child, td:first-child { text-align: left; }
tr.total td { font-weight: bold; background: #f4f4f4; }
p.note { font-size: 0.9em; } p.warn { color: #a00; font-weight: bold; }
figure { display: inline-block; margin: 1em 1em 0 0; } figure img { max-width: 100%; border: 1px solid #ddd; }
"""
_JOB_COLUMNS = (
    ("job", lambda j: str(j.job_id)), ("user", lambda j: j.user), ("account", lambda j: j.account),
    ("partition", lambda j: j.partition), ("name", lambda j: j.job_name), ("state", lambda j: j.state),
    ("gpus", lambda j: str(j.gpus)), ("shards", lambda j: str(j.shards)), ("action", lambda j: j.action or "-"),
    ("status", lambda j: j.status.value), ("elapsed", lambda j: fmt_duration(j.elapsed_s)),
    ("wait", lambda j: fmt_duration(j.wait_s)),
    ("pred", lambda j: "-" if j.predicted_peak_bytes is None else f"{j.predicted_peak_bytes / GIB:.1f}G"),
    ("obs", lambda j: "-" if j.observed_peak_bytes is None else f"{j.observed_peak_bytes / GIB:.1f}G"),
    ("oom", lambda j: "-" if j.oom is None else ("yes" if j.oom else "no")),
    ("shadow", lambda j: "yes" if j.shadow else ""),
)


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _table(header: Iterable[str], rows: Iterable[tuple[str, list[str]]]) -> str:
    out = ["<table>", "<tr>" + "".join(f"<th>{_e(h)}</th>" for h in header) + "</tr>"]
    for css, cells in rows:
        out.append(f'<tr class="{css}">' + "".join(f"<td>{_e(c)}</td>" for c in cells) + "</tr>")
    out.append("</table>")
    return "\n".join(out)


def _interference(sec: InterferenceSection, *, with_runs: bool) -> list[str]:
    """The "Interference: predicted vs observed" section: per GPU type, the notes, the runs (optional)."""
    parts = ["<h2>Interference: predicted vs observed</h2>"]
    if sec.runs:
        parts.append(_table([h for h, _f in INTERFERENCE_TABLE],
                            [("total" if x is sec.summary[-1] else "", [f(x) for _h, f in INTERFERENCE_TABLE])
                             for x in sec.summary]))
    parts += [f'<p class="note">{_e(n)}</p>' for n in interference_notes(sec)]
    if with_runs and sec.runs:
        parts.append(_table([h for h, _f in RUN_TABLE], [("", [f(r) for _h, f in RUN_TABLE]) for r in sec.runs]))
    return parts


def format_html(rep: Report, *, with_jobs: bool = False, plots: Iterable[Path] = (), plots_note: str = "",
                with_runs: bool = False) -> str:
    title = f"swapaware report {rep.start or '?'} .. {rep.end or 'now'}"
    generated = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(rep.generated_at))
    summary = _table([rep.by, *(h for h, _w, _f in _TABLE)],
                     [("total" if g is rep.total else "", [g.key, *(f(g) for _h, _w, f in _TABLE)])
                      for g in (*rep.groups, rep.total)])
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">', f"<title>{_e(title)}</title>",
        f"<style>{_CSS}</style></head><body>", f"<h1>{_e(title)}</h1>",
        f'<p class="note">{rep.total.jobs} GPU jobs by {_e(rep.by)}, {rep.shards_per_gpu} shards per GPU; '
        f"generated {_e(generated)}; accounting via {_e(rep.slurm_backend or '?')}, history {_e(rep.history_path)}. "
        "Definitions: docs/reporting.md.</p>",
    ]
    if rep.history_error:
        parts.append(f'<p class="warn">history not read ({_e(rep.history_error)}): accounting columns only</p>')
    parts += ["<h2>Summary</h2>", summary, *(f'<p class="note">{_e(n)}</p>' for n in notes(rep))]
    if rep.interference is not None:
        parts += _interference(rep.interference, with_runs=with_runs)
    figures = []
    for p in plots:
        data = base64.b64encode(Path(p).read_bytes()).decode()
        figures.append(f'<figure><img alt="{_e(Path(p).stem)}" src="data:image/png;base64,{data}">'
                       f"<figcaption>{_e(Path(p).stem.replace('_', ' '))}</figcaption></figure>")
    if figures or plots_note:
        parts += ["<h2>Plots</h2>", *figures]
        if plots_note:
            parts.append(f'<p class="note">{_e(plots_note)}</p>')
    if with_jobs and rep.jobs:
        parts += ["<h2>Jobs</h2>", _table([h for h, _f in _JOB_COLUMNS],
                                          [("", [f(j) for _h, f in _JOB_COLUMNS]) for j in rep.jobs])]
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"
