"""``swapaware report``: the click command (reads accounting and the history, prints a format)."""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

import click

from policy_service.slurm.slurm import SlurmError, cluster_release, open_slurm
from policy_service.config import Config, ConfigError, load_config
from policy_service.history.config import history_source
from policy_service.slurm.partitions import SlurmConfWatch, slurm_conf_path
from policy_service.report.aggregate import load_report
from policy_service.report.formats import format_csv, format_json, format_table
from policy_service.report.html import format_html
from policy_service.report.interference import gpu_types, no_runs_line
from policy_service.report.join import live_admin_comments
from policy_service.report.model import GROUP_KEYS, LIVE_LOOKUP_MAX
from policy_service.report.plots import PlotsUnavailable, pyplot, write_plots

_HELP = """Accounting joined with swapaware's history, per user, account or partition.

\b
Reads accounting (pyslurm's db API where its version matches the cluster, else
`sacct --json -X --allusers`; run it as root or a Slurm operator to see every user's jobs)
and the service's history database (cfg service.db_path, opened read-only). Only GPU jobs
are counted: jobs whose requested or allocated TRES hold gres/gpu or gres/shard, or that
carry a swapaware decision.

\b
Definitions (docs/reporting.md has the details and the caveats):
  shared        allocated TRES hold k gres/shard, k < shards_per_gpu (part of one GPU)
  whole         allocated TRES hold gres/gpu, or all shards of a GPU (how swapaware holds
                a whole-GPU decision when policy.whole_gpu_as_shards is on)
  pend          the job never started (nothing allocated); not judged
  gpu_h         elapsed x (gpus + shards/shards_per_gpu); running jobs up to now;
                whole jobs that overlap the window, not clipped to it
  saved_h       jobs that asked for one whole GPU (the decision's recorded facts) but
                ran on k shards: elapsed x (1 - k/shards_per_gpu). An upper bound when
                sharing slowed the job down (the whole-GPU run might have been shorter)
  wait          start - submit, started jobs only
  err50         median of |predicted - observed| / observed over jobs that have both the
                decision's predicted peak and an observed peak (NVML)
  under         jobs whose observed peak exceeded predicted peak + margin / jobs compared
  oom           observations that detected an out-of-memory
  overr         swapaware decided, but the allocation disagrees with it (decided k
                shards, ran on a gpu or on another number of shards; decided a whole
                gpu, ran on shards) or the AdminComment was edited, replaced or removed
                after the decision
  norec         GPU job without a swapaware decision (service down: failed open; plugin
                disabled; submitted before swapaware)
  shadow        decisions made in shadow mode (policy.mode = shadow: the job ran as
                submitted): how many would have shared (a single whole-GPU request put on
                k shards), the GPU-hours that frees (elapsed x (1 - k/shards_per_gpu)) and
                how many had an observed peak above their k shards (would have hit the cap)
  whole_because whole-GPU decisions by the reason code that kept them whole (no_history,
                queue_short, compute_bound, protected_qos, oom_penalty, too_large_to_share,
                ...): the line under the table, and a column in JSON/CSV
  interference  the history's newest shared runs (interference.window): observed
                slowdown (runtime / the class's solo runtime) against the site's model
                (as the service fits it, per GPU type from gres.conf) and the prior; mean
                absolute errors per GPU type (--interference lists every run)
  not judged    slurmdbd stores AdminComment only when a job ends: for running and
                pending jobs it is read from slurmctld (--live-lookups); a job that never
                started is not compared with an allocation

\b
Time formats are sacct's: 2026-05-01, 2026-05-01T08:00, now-7days, now-12hours.
GPU-hours use shards_per_gpu = gpu.shards_per_gpu of the config (it must match gres.conf).
"""


@click.command("report", help=_HELP)
@click.option("--start", default="now-7days", show_default=True, help="Window start (sacct -S).")
@click.option("--end", default="now", show_default=True, help="Window end (sacct -E).")
@click.option("--by", type=click.Choice(GROUP_KEYS), default="user", show_default=True, help="Group rows by.")
@click.option("--format", "fmt", type=click.Choice(("table", "json", "csv")), default="table", show_default=True)
@click.option("--jobs", "with_jobs", is_flag=True,
              help="Also list every job (table), add a 'jobs' array (json), or one row per job (csv).")
@click.option("--plot", "plot_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Write PNG plots into this folder (needs matplotlib: pip install 'swapaware[plots]').")
@click.option("--html", "html_out", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write one self-contained HTML page (tables, and the plots inline where matplotlib "
                   "is installed) to this file.")
@click.option("--interference", "with_runs", is_flag=True,
              help="Also list every shared run's observed and predicted slowdown (table, HTML), add "
                   "'interference.runs' (json), or one row per shared run (csv) instead of the groups.")
@click.option("--slurm-timeout", type=float, default=120.0, show_default=True,
              help="Seconds allowed for the accounting query.")
@click.option("--live-lookups", type=int, default=LIVE_LOOKUP_MAX, show_default=True,
              help="Unfinished GPU jobs whose AdminComment is read from slurmctld (accounting has it "
                   "only once a job ends); the rest are not judged.")
@click.option("--config", type=click.Path(dir_okay=False), help="TOML config (default: $SWAPAWARE_CONFIG).")
def report_command(start: str, end: str, by: str, fmt: str, with_jobs: bool, plot_dir: Path | None,
                   html_out: Path | None, with_runs: bool, slurm_timeout: float, live_lookups: int,
                   config: str | None) -> None:
    try:
        cfg: Config = load_config(Path(config) if config else None)
    except ConfigError as exc:
        raise click.ClickException(f"configuration: {exc}") from None
    if plot_dir is not None:  # fail before the (possibly slow) accounting query
        try:
            pyplot()
        except PlotsUnavailable as exc:
            raise click.ClickException(str(exc)) from None
    try:
        slurm = open_slurm(cfg.service.slurm_backend, slurm_timeout,
                           cluster_release(cfg.service.slurm_release, slurm_timeout))
        accounting = slurm.accounting_jobs(start=start, end=end)
    except SlurmError as exc:
        raise click.ClickException(f"accounting: {exc}") from None
    live = live_admin_comments(slurm, accounting, live_lookups)
    conf = slurm_conf_path(cfg.service.slurm_conf)  # the GPUs' types: gres.conf beside it (none: untyped)
    gpu_type_of = gpu_types(SlurmConfWatch(conf).current().node_gpus) if conf.is_file() else None
    rep = load_report(accounting, history_source(cfg), by=by, shards_per_gpu=cfg.gpu.shards_per_gpu,
                      now=time.time(), start=start, end=end, slurm_backend=type(slurm).__name__,
                      live_comments=live, shard_bytes=cfg.gpu.shard_bytes, interference_cfg=cfg,
                      gpu_type_of=gpu_type_of)
    if rep.history_error:
        click.echo(f"swapaware report: WARNING: {rep.history_error}; showing accounting only", err=True)
    if fmt == "json":
        click.echo(format_json(rep, with_jobs=with_jobs, with_runs=with_runs))
    elif fmt == "csv":
        click.echo(format_csv(rep, with_jobs=with_jobs, with_runs=with_runs), nl=False)
    else:
        click.echo(format_table(rep, with_jobs=with_jobs, with_runs=with_runs))
    if plot_dir is not None:
        try:
            paths = write_plots(plot_dir, rep)
        except PlotsUnavailable as exc:
            raise click.ClickException(str(exc)) from None
        click.echo(f"wrote {', '.join(str(p) for p in paths)}", err=True)
        if no_runs_line(rep.interference):
            click.echo(f"interference.png not drawn: {no_runs_line(rep.interference)}", err=True)
    if html_out is not None:
        write_html(html_out, rep, with_jobs=with_jobs, with_runs=with_runs)
        click.echo(f"wrote {html_out}", err=True)


def write_html(out: Path, rep, *, with_jobs: bool, with_runs: bool = False) -> None:
    """The page, with the plots drawn into a scratch folder and inlined (without matplotlib the page
    says so and has the tables only)."""
    with tempfile.TemporaryDirectory(prefix="swapaware-report-") as tmp:
        try:
            plots, note = write_plots(Path(tmp), rep), ""
        except PlotsUnavailable as exc:
            plots, note = [], f"plots not drawn: {exc}"
        text = format_html(rep, with_jobs=with_jobs, plots=plots, plots_note=note, with_runs=with_runs)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")


if __name__ == "__main__":  # python -m policy_service.report
    report_command()
