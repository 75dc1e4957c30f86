"""Comparison table, JSON/CSV result files and PNG plots of a simulation matrix.

Every file carries the seed, the data source and the full configuration: the JSON in its
``meta`` object, the CSV in ``#`` comment lines before the header (``pandas.read_csv(path,
comment="#")`` reads it), the PNGs in their text metadata and a footnote.
"""
from __future__ import annotations

import csv
import io
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Sequence, TextIO

from policy_service.sim.runner import MatrixResult

HOUR = 3600.0

# (column title, row key, format)
TABLE_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("policy", "policy", "{}"),
    ("load", "load", "{:.2f}"),
    ("noise", "noise", "{:.2f}"),
    ("makespan h", "makespan_s", "h"),
    ("JCT mean h", "jct_mean_s", "h"),
    ("JCT p95 h", "jct_p95_s", "h"),
    ("wait h", "wait_mean_s", "h"),
    ("GPU util", "gpu_util", "{:.2f}"),
    ("mem util", "mem_util", "{:.2f}"),
    ("OOM", "oom_events", "{}"),
    ("OOM nbr", "neighbour_oom_events", "{}"),
    ("failed", "failed", "{}"),
    (">2x", "slowdown_over_2x", "{}"),
    (">2x victim", "slowdown_over_2x_designated_victims", "{}"),
    ("hi-prio p95 slow", "high_prio_slowdown_p95", "{:.2f}"),
    ("shared", "shared_jobs", "{}"),
)

CSV_COLUMNS = ("block", "policy", "label", "load", "noise", "jobs", "completed", "failed", "makespan_s", "jct_mean_s",
               "jct_p50_s", "jct_p95_s", "wait_mean_s", "gpu_util", "mem_util", "oom_events", "oom_jobs", "oom_rate",
               "neighbour_oom_events", "slowdown_mean", "slowdown_p95", "slowdown_over_2x",
               "slowdown_over_2x_designated_victims", "slowdown_over_2x_swapped_not_designated",
               "slowdown_over_2x_compute_only", "high_prio_jobs", "high_prio_slowdown_p95",
               "high_prio_slowdown_mean", "high_prio_swapped", "swap_extra_p95_of_swapped", "swap_extra_over_budget",
               "swap_extra_over_budget_designated", "shared_jobs", "swapped_jobs", "designated_victim_jobs",
               "offered_load_declared", "offered_load_exclusive", "events", "gpus", "wall_s")


def _fmt(fmt: str, v: Any) -> str:
    if fmt == "h":
        return f"{v / HOUR:.2f}"
    return fmt.format(v)


def format_table(rows: Sequence[dict]) -> str:
    heads = [c[0] for c in TABLE_COLUMNS]
    body = [[_fmt(f, r[k]) for _, k, f in TABLE_COLUMNS] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(heads)]
    out = io.StringIO()
    out.write("  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(heads, widths))) + "\n")
    out.write("  ".join("-" * w for w in widths) + "\n")
    prev = None
    for r, b in zip(rows, body):
        group = (r["block"], r["load"], r["noise"])
        if prev is not None and group != prev:
            out.write("\n")
        prev = group
        out.write("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(b, widths))) + "\n")
    return out.getvalue()


def _interference_text(meta: dict) -> str:
    i = meta["interference"]
    knee = i.get("knee_used")
    if i.get("model") == "util" and knee:
        named = f"fit {knee['fit']}, " if knee.get("fit") else ""
        text = (f"interference=util knee {named}base {knee['base']:.3f} slope {knee['slope']:.2f} "
                f"(utilisation: {knee['util_source']}; Gavel refit {i['knee_fit']['base']:.2f}/"
                f"{i['knee_fit']['slope']:.2f})" if "knee_fit" in i else
                f"interference=util knee {named}base {knee['base']:.3f} slope {knee['slope']:.2f} "
                f"(utilisation: {knee['util_source']})")
    else:
        text = (f"interference/co-runner={i.get('per_corunner', 0):.3f} ({i.get('method', '')})")
    mf = meta.get("memory_fit") or {}
    used = (meta.get("sim_config") or {}).get("memory", {}).get("grow_prob", 1) > 0
    if "growth" in mf and not used:
        text += " memory: fixed growth model (grow_prob 0; fit recorded, not used)"
    elif "growth" in mf:
        g, v = mf["growth"], mf["variation"]
        text += (f" memory fit ({mf['source']['containers']} containers, {g['runs']} runs): grow "
                 f"{g['grow_prob']:.3f} x{math.exp(g['log_growth_median']):.2f}, run-to-run jumps "
                 f"{v['run_jump_prob']:.3f} sigma {v['run_sigma_jump']:.3f}")
    node = meta.get("node")
    if node is not None:
        text += f" hard_caps={'on' if node.get('hard_caps') else 'off'}"
    return text


def meta_line(meta: dict) -> str:
    src = meta.get("data_source", {})
    files = ", ".join(f["path"] for f in src.get("files", [])) or src.get("name", "")
    return (f"seed={meta['seed']} workload={meta['workload']} gpus={meta['gpus']} data={files} "
            + _interference_text(meta) + f" model={meta['model_version']}"
            + (f" memory: {src['memory']['observed_jobs']} jobs observed, {src['memory']['model_jobs']} from the model"
               if isinstance(src.get("memory"), dict) else ""))


def write_json(path: Path, result: MatrixResult) -> None:
    path.write_text(json.dumps({"meta": result.meta, "runs": result.rows}, indent=2, sort_keys=False, default=str))


def write_csv(path: Path, result: MatrixResult) -> None:
    with open(path, "w", newline="") as f:
        f.write("# swapaware simulate results; read with pandas.read_csv(path, comment='#')\n")
        f.write(f"# seed={result.meta['seed']}\n")
        f.write(f"# workload={result.meta['workload']}\n")
        f.write(f"# data_source={json.dumps(result.meta['data_source'], default=str)}\n")
        f.write(f"# interference={json.dumps(result.meta['interference'], default=str)}\n")
        f.write(f"# model_version={result.meta['model_version']}\n")
        f.write(f"# config={json.dumps(result.meta['config'], default=str)}\n")
        f.write(f"# sim_config={json.dumps(result.meta['sim_config'], default=str)}\n")
        f.write(f"# load_definition={result.meta['load_definition']}\n")
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in result.rows:
            w.writerow(r)


def write_plots(out_dir: Path, result: MatrixResult) -> list[Path]:
    """JCT CDF per policy and utilisation over time, one figure per load (needs matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError("--plots needs matplotlib (pip install 'swapaware[plots]')") from exc
    written = []
    note = meta_line(result.meta)
    pngmeta = {"Description": json.dumps({k: result.meta[k] for k in ("seed", "workload", "data_source",
                                                                     "interference", "model_version", "config",
                                                                     "sim_config")}, default=str),
               "Software": "swapaware simulate"}

    def save(fig, name: str, bottom: float) -> None:
        fig.subplots_adjust(bottom=bottom)
        fig.text(0.01, 0.005, note, fontsize=5)
        p = out_dir / name
        fig.savefig(p, dpi=120, metadata=pngmeta)
        plt.close(fig)
        written.append(p)

    loads = sorted({r["load"] for r in result.rows if r["block"] == "load"})
    for load in loads:
        rows = [r for r in result.rows if r["block"] == "load" and r["load"] == load]
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for r in rows:
            jct = result.curves[(r["policy"], r["load"], r["noise"])]["jct_s"]
            if not jct:
                continue
            ys = [(i + 1) / len(jct) for i in range(len(jct))]
            ax.plot([x / HOUR for x in jct], ys, label=r["label"])
        ax.set_xscale("log")
        ax.set_xlabel("job completion time (h, log)")
        ax.set_ylabel("fraction of completed jobs")
        ax.set_title(f"JCT CDF, offered load {load:.0%}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        save(fig, f"jct_cdf_load{int(round(load * 100))}.png", 0.15)
        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
        for r in rows:
            tl = result.curves[(r["policy"], r["load"], r["noise"])]["timeline"]
            if not tl:
                continue
            ts = [(p_[0] - tl[0][0]) / HOUR for p_ in tl]
            ax1.plot(ts, [p_[1] for p_ in tl], label=r["label"])
            ax2.plot(ts, [p_[2] for p_ in tl], label=r["label"])
        ax1.set_ylabel("GPUs allocated")
        ax2.set_ylabel("device memory used (true)")
        ax2.set_xlabel("time (h)")
        ax1.set_title(f"Utilisation over time, offered load {load:.0%}")
        for ax in (ax1, ax2):
            ax.set_ylim(0, 1.05)
            ax.grid(alpha=0.3)
        ax1.legend(fontsize=8)
        save(fig, f"utilisation_load{int(round(load * 100))}.png", 0.12)
    return written


class Progress:
    """A progress bar on stderr (tqdm when installed, else a plain one); silent when disabled."""

    def __init__(self, enabled: bool, label: str = "simulating", stream: TextIO | None = None):
        self.enabled = enabled
        self.label = label
        self.stream = stream or sys.stderr
        self._bar = None
        self._last = 0.0
        self._t0 = time.perf_counter()
        self._n = 0

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled or total <= 0:
            return
        if self._bar is None:
            try:
                from tqdm import tqdm  # optional
                self._bar = tqdm(total=total, desc=self.label, unit="job", file=self.stream, smoothing=0.1)
            except ImportError:
                self._bar = False
        if self._bar:
            self._bar.update(done - self._n)
            self._n = done
            return
        now = time.perf_counter()
        if now - self._last < 0.25 and done < total:
            return
        self._last = now
        frac = done / total
        width = 30
        fill = int(frac * width)
        el = now - self._t0
        eta = el / frac - el if frac > 0 else 0.0
        self.stream.write(f"\r{self.label} [{'#' * fill}{'.' * (width - fill)}] {frac:6.1%} "
                          f"{done}/{total} jobs, {el:5.0f}s elapsed, ~{eta:4.0f}s left")
        self.stream.flush()

    def close(self) -> None:
        if self._bar:
            self._bar.close()
        elif self._bar is False and self.enabled:
            self.stream.write("\n")
            self.stream.flush()
