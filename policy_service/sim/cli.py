"""``swapaware simulate``: replay a workload through every policy and compare them.

``simulate_command`` is a click command; the ``swapaware`` group registers it.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from policy_service.config import ConfigError, load_config
from policy_service.sim.config import load_sim_config
from policy_service.sim.loaders import DataNotFound, SchemaError
from policy_service.sim.policies import POLICIES
from policy_service.sim.report import Progress, format_table, meta_line, write_csv, write_json, write_plots
from policy_service.sim.runner import WORKLOADS, RunSpec, run_matrix


def _floats(name: str, text: str) -> tuple[float, ...]:
    text = (text or "").strip()
    if text.lower() in ("", "none"):
        return ()
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise click.BadParameter(f"expected comma-separated numbers, got {text!r}", param_hint=name) from None


@click.command("simulate")
@click.option("--workload", type=click.Choice(WORKLOADS), default="synthetic", show_default=True,
              help="Workload to replay.")
@click.option("--data-dir", type=click.Path(path_type=Path, file_okay=False), envvar="SWAPAWARE_DATA_DIR",
              help="Folder with the trace files (alibaba-v2023/, alibaba-v2020/, gavel/ or the files themselves).")
@click.option("--variant", default="default", show_default=True,
              help="openb pod list variant: default, gpushare40 or gpushare100 (alibaba-v2023).")
@click.option("--load", "loads", default="0.5,0.7,0.9", show_default=True,
              help="Offered loads (declared GPU share x duration / GPUs x window), comma-separated.")
@click.option("--jobs", type=click.IntRange(min=1), help="Number of jobs (synthetic) or first N GPU jobs (traces).")
@click.option("--gpus", type=click.IntRange(min=1), help="GPUs in the simulated partition (default per workload).")
@click.option("--seed", type=int, default=1, show_default=True)
@click.option("--noise", "noises", default="0.1,0.25,0.5", show_default=True,
              help="Per-run memory noise levels (+-fraction of the class's peak) for the sensitivity runs; "
                   "'none' skips them.")
@click.option("--noise-load", type=float, default=0.7, show_default=True, help="Load of the sensitivity runs.")
@click.option("--policies", default=",".join(POLICIES), show_default=True, help="Policies to compare.")
@click.option("--arrivals", type=click.Choice(("poisson", "scaled", "recorded")), default="poisson", show_default=True,
              help="poisson: trace order, exponential gaps at the load's rate; scaled: the trace's own "
                   "submit times stretched to the load's window; recorded: the submit times as recorded "
                   "(--load is then not applied: one run per policy).")
@click.option("--sacct-json", type=click.Path(path_type=Path, dir_okay=False),
              help="--workload sacct: a site's `sacct --json -X --allusers -S .. -E ..` export (.gz too).")
@click.option("--history", type=click.Path(path_type=Path, dir_okay=False),
              help="--workload sacct: the service's history (db_path), for the GPU memory it observed.")
@click.option("--out", "out_dir", type=click.Path(path_type=Path, file_okay=False), default=Path("results/simulate"),
              show_default=True, help="Folder for results.json / results.csv (and plots).")
@click.option("--plots", is_flag=True, help="Also write PNG plots (needs matplotlib).")
@click.option("--config", "config_path", type=click.Path(path_type=Path, dir_okay=False),
              help="swapaware TOML config (the policy's parameters).")
@click.option("--sim-config", "sim_config_path", type=click.Path(path_type=Path, dir_okay=False),
              help="TOML with the simulator's model parameters (sections memory, workload, scheduler, ...).")
@click.option("--gavel", type=click.Path(path_type=Path),
              help="Gavel simulation_throughputs.json (default: <data-dir>/gavel/).")
@click.option("--workers", type=click.IntRange(min=1), default=1, show_default=True,
              help="Processes running policies in parallel (results do not depend on it).")
@click.option("--progress/--no-progress", default=None, help="Progress bar on stderr (default: when a terminal).")
def simulate_command(workload, data_dir, variant, loads, jobs, gpus, seed, noises, noise_load, policies, arrivals,
                     sacct_json, history, out_dir, plots, config_path, sim_config_path, gavel, workers, progress):
    """Replay a GPU workload through B0/B1/B2/swapaware/oracle and compare them."""
    try:
        cfg = load_config(config_path)
        sim = load_sim_config(sim_config_path)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    names = tuple(p.strip() for p in policies.split(",") if p.strip())
    bad = [p for p in names if p not in POLICIES]
    if bad or not names:
        raise click.BadParameter(f"unknown {', '.join(bad) or 'empty'}; choose from {', '.join(POLICIES)}",
                                 param_hint="--policies")
    load_values = _floats("--load", loads) if arrivals != "recorded" else (1.0,)
    if not load_values or any(v <= 0 for v in load_values):
        raise click.BadParameter("give at least one load > 0", param_hint="--load")
    noise_values = _floats("--noise", noises)
    if any(not 0 <= v < 1 for v in noise_values):
        raise click.BadParameter("noise levels must be in [0, 1)", param_hint="--noise")
    spec = RunSpec(workload=workload, data_dir=data_dir, variant=variant, loads=load_values, noises=noise_values,
                   noise_load=noise_load, jobs=jobs, gpus=gpus, seed=seed, policies=names, arrivals=arrivals,
                   gavel=gavel, sacct_json=sacct_json, history=history, shards_per_gpu=cfg.gpu.shards_per_gpu)
    bar = Progress(sys.stderr.isatty() if progress is None else progress)
    t0 = time.perf_counter()
    try:
        result = run_matrix(spec, cfg, sim, workers=workers, progress=bar, argv=sys.argv)
    except (SchemaError, DataNotFound, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        bar.close()
    wall = time.perf_counter() - t0
    click.echo(meta_line(result.meta))
    click.echo(format_table(result.rows))
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "results.json", result)
    write_csv(out_dir / "results.csv", result)
    written = [out_dir / "results.json", out_dir / "results.csv"]
    if plots:
        try:
            written.extend(write_plots(out_dir, result))
        except RuntimeError as exc:
            raise click.ClickException(str(exc)) from None
    click.echo(f"{len(result.rows)} runs in {wall:.1f}s; wrote {', '.join(str(p) for p in written)}")


if __name__ == "__main__":  # python -m policy_service.sim.cli
    simulate_command()
