"""PNG plots of a report (matplotlib, optional: ``pip install 'swapaware[plots]'``)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from policy_service.report.model import GIB, InterferenceSection, Report, ReportError

class PlotsUnavailable(ReportError):
    pass


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, or PlotsUnavailable saying how to install it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise PlotsUnavailable(f"--plot needs matplotlib, which is not installed ({exc}); "
                               "install it with: pip install 'swapaware[plots]'") from None
    return plt


def write_plots(out_dir: Path, rep: Report) -> list[Path]:
    """PNG plots: GPU-hours per group, job outcomes per group, predicted vs observed peak per job,
    queue wait per group, and predicted vs observed slowdown per shared run where the report has
    any (``interference.png``). Needs matplotlib (``pip install 'swapaware[plots]'``)."""
    plt = pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    keys = [g.key for g in rep.groups]
    note = (f"swapaware report {rep.start or '?'} .. {rep.end or 'now'}, by {rep.by}, "
            f"{rep.total.jobs} GPU jobs, {rep.shards_per_gpu} shards/GPU")
    meta = {"Software": "swapaware report", "Description": note}
    written: list[Path] = []

    def save(fig: Any, name: str) -> None:
        fig.text(0.01, 0.005, note, fontsize=6)
        fig.tight_layout(rect=(0, 0.03, 1, 1))
        p = out_dir / name
        fig.savefig(p, dpi=110, metadata=meta)
        plt.close(fig)
        written.append(p)

    x = range(len(keys))
    width = max(6.0, 0.6 * len(keys) + 2)
    # 1. GPU-hours per group
    fig, ax = plt.subplots(figsize=(width, 4.5))
    shared = [g.gpu_hours_shared for g in rep.groups]
    whole = [g.gpu_hours_used - g.gpu_hours_shared for g in rep.groups]
    saved = [g.gpu_hours_saved for g in rep.groups]
    ax.bar(x, whole, label="used, whole GPUs")
    ax.bar(x, shared, bottom=whole, label="used, shards")
    ax.bar(x, saved, bottom=[a + b for a, b in zip(whole, shared)], label="saved (vs a whole GPU)", hatch="//",
           alpha=0.5)
    ax.set_xticks(list(x), keys, rotation=30, ha="right")
    ax.set_ylabel("GPU-hours")
    ax.set_title(f"GPU-hours by {rep.by}")
    ax.legend(fontsize=8)
    save(fig, "gpu_hours.png")
    # 2. job outcomes per group
    fig, ax = plt.subplots(figsize=(width, 4.5))
    series = (("shared", [g.shared_jobs for g in rep.groups]), ("whole GPU", [g.whole_gpu_jobs for g in rep.groups]),
              ("never started", [g.not_started for g in rep.groups]))
    n = len(series) + 2
    bw = 0.8 / n
    extra = (("no swapaware record", [g.no_record for g in rep.groups]),
             ("overridden", [g.overridden for g in rep.groups]))
    for i, (label, ys) in enumerate((*series, *extra)):
        ax.bar([xi - 0.4 + bw * (i + 0.5) for xi in x], ys, bw, label=label)
    ax.set_xticks(list(x), keys, rotation=30, ha="right")
    ax.set_ylabel("jobs")
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.set_title(f"GPU jobs by {rep.by}")
    ax.legend(fontsize=8)
    save(fig, "jobs.png")
    # 3. predicted vs observed peak per job
    fig, ax = plt.subplots(figsize=(5.5, 5.5))
    pts = [j for j in rep.jobs if j.predicted_peak_bytes is not None and j.observed_peak_bytes is not None]
    if pts:
        for flag, label, marker in ((False, "within margin", "o"), (True, "under-predicted, no OOM", "x")):
            sel = [j for j in pts if bool(j.under_predicted) is flag and not j.oom]
            ax.scatter([j.observed_peak_bytes / GIB for j in sel], [j.predicted_peak_bytes / GIB for j in sel],
                       marker=marker, label=f"{label} ({len(sel)})")
        ooms = [j for j in pts if j.oom]
        if ooms:
            ax.scatter([j.observed_peak_bytes / GIB for j in ooms], [j.predicted_peak_bytes / GIB for j in ooms],
                       marker="s", facecolors="none", edgecolors="red", label=f"OOM ({len(ooms)})")
        hi = max(max(j.observed_peak_bytes, j.predicted_peak_bytes) for j in pts) / GIB * 1.05
        ax.plot([0, hi], [0, hi], color="grey", lw=0.8, label="predicted = observed")
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no job with both a prediction and an observed peak", ha="center", va="center",
                transform=ax.transAxes, fontsize=9)
    ax.set_xlabel("observed peak GPU memory (GiB)")
    ax.set_ylabel("predicted peak GPU memory (GiB)")
    ax.set_title("predicted vs observed peak")
    save(fig, "memory_pred_vs_obs.png")
    # 4. queue wait per group
    fig, ax = plt.subplots(figsize=(width, 4.5))
    waits = [[j.wait_s / 60 for j in rep.jobs if (getattr(j, rep.by) or "(none)") == k and j.wait_s is not None]
             for k in keys]
    if any(waits):
        ax.boxplot([w or [0.0] for w in waits])
        ax.set_xticks([i + 1 for i in x], keys, rotation=30, ha="right")
    else:
        ax.text(0.5, 0.5, "no started job", ha="center", va="center", transform=ax.transAxes)
    ax.set_ylabel("queue wait, submit to start (min)")
    ax.set_title(f"queue wait by {rep.by}")
    save(fig, "queue_wait.png")
    # 5. predicted vs observed slowdown per shared run (none drawn without shared runs)
    if rep.interference is not None and rep.interference.runs:
        fig, ax = plt.subplots(figsize=(5.5, 5.5))
        interference_scatter(ax, rep.interference)
        save(fig, "interference.png")
    return written


def interference_scatter(ax: Any, sec: InterferenceSection) -> None:
    """Observed slowdown (x) against the site's model's and the prior's predictions (y), the diagonal."""
    runs = sec.runs
    observed = [r.observed for r in runs]
    total = sec.summary[-1]  # every run's
    learned = sorted({"all types" if x.model_type == "*" else x.model_type
                      for x in sec.summary[:-1] if x.model_source == "learned"})
    ax.scatter(observed, [r.predicted_learned for r in runs], marker="o", color="tab:blue",
               label=f"site's model ({'learned: ' + ', '.join(learned) if learned else 'not learned yet: the prior'};"
                     f" MAE {total.mae_learned:.2f})")
    ax.scatter(observed, [r.predicted_prior for r in runs], marker="x", color="tab:orange",
               label=f"prior {sec.prior.split(':')[0]} (MAE {total.mae_prior:.2f})")
    lo = min(1.0, *observed, *(r.predicted_prior for r in runs), *(r.predicted_learned for r in runs)) * 0.95
    hi = max(*observed, *(r.predicted_prior for r in runs), *(r.predicted_learned for r in runs)) * 1.05
    ax.plot([lo, hi], [lo, hi], color="grey", lw=0.8, label="predicted = observed")
    ax.set_xlabel("observed slowdown (runtime / class's solo runtime)")
    ax.set_ylabel("predicted slowdown")
    ax.set_title(f"interference: predicted vs observed ({len(runs)} shared runs)")
    ax.legend(fontsize=8)


# ============================================================================ command
