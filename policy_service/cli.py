"""``swapaware``: the one command-line entry point."""
from __future__ import annotations

import getpass
import json
import logging
import re
import sys
from pathlib import Path

import click
import grpc
from google.protobuf import json_format

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.serving.client import FailoverClient, configured_client
from policy_service.config import Config, ConfigError, LinkKind, UnsafeTokenFile, load_config, read_token
from policy_service.core.ha import service_addresses
from policy_service.core.request import script_fingerprint

_SBATCH_RE = re.compile(r"^#SBATCH\s+(--?[\w-]+)(?:[= ]\s*(\S.*?))?\s*$")


def _load(config: str | None) -> Config:
    try:
        return load_config(Path(config) if config else None)
    except ConfigError as exc:
        raise click.ClickException(f"configuration: {exc}") from None


@click.group()
@click.version_option(package_name="swapaware")
def main() -> None:
    """swapaware: GPU swap-aware scheduling for Slurm."""


LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"  # the service's (serve)


@main.command()
@click.option("--config", type=click.Path(dir_okay=False), help="TOML config (default: $SWAPAWARE_CONFIG).")
@click.option("--accept-empty-history", is_flag=True,
              help="Start on a new, empty history even where files beside service.db_path show that a history "
                   "existed (it was removed or moved away); without it the service refuses to start there.")
def serve(config: str | None, accept_empty_history: bool) -> None:
    """Run the policy service (gRPC + controller-local socket)."""
    from policy_service.history.guard import HistoryMissing
    from policy_service.serving.server import serve_forever

    cfg = _load(config)
    logging.basicConfig(level=cfg.service.log_level.upper(), format=LOG_FORMAT)
    # what that format does not print is not gathered for each record (a decision's log line, one
    # per Admit: os.getpid() was a system call each, the thread's and process's names look-ups)
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    logging.getLogger("swapaware.service").info("starting\n%s", cfg.summary())
    # `kill -USR1 <pid>`: every thread's stack to stderr (the service's log), written by the
    # interpreter in C, without stopping the service: where a service that no longer does something waits
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        serve_forever(cfg, reload=lambda: _load(config), accept_empty_history=accept_empty_history)
    except (OSError, ConfigError, HistoryMissing) as exc:
        raise click.ClickException(f"cannot start: {exc}") from None


def sbatch_options(script_text: str) -> dict[str, str]:
    """The #SBATCH options of a script that matter to the policy ({'--gres': 'gpu:1', ...})."""
    aliases = {"-J": "--job-name", "-A": "--account", "-p": "--partition", "-G": "--gpus", "-N": "--nodes"}
    out: dict[str, str] = {}
    for line in script_text.splitlines():
        if not line.startswith("#SBATCH"):
            if line.strip() and not line.startswith("#"):
                break  # sbatch stops reading options at the first command
            continue
        m = _SBATCH_RE.match(line)
        if m:
            out[aliases.get(m.group(1), m.group(1))] = (m.group(2) or "").strip()
    return out


def facts_from_script(path: Path, overrides: dict[str, str | None]) -> pb.JobFacts:
    data = path.read_bytes()
    opts = sbatch_options(data.decode(errors="replace"))
    opts.update({k: v for k, v in overrides.items() if v is not None})

    def gres(v: str | None) -> str:
        return ",".join(f"gres:{g.strip()}" for g in v.split(",")) if v else ""

    return pb.JobFacts(
        user=opts.get("--user") or getpass.getuser(), account=opts.get("--account", ""),
        partition=opts.get("--partition", ""), job_name=opts.get("--job-name") or path.name,
        tres_per_node=gres(opts.get("--gres")), tres_per_job=gres(f"gpu:{opts['--gpus']}" if opts.get("--gpus") else None),
        script_fingerprint=script_fingerprint(data), comment=opts.get("--comment", ""),
        min_nodes=int(opts.get("--nodes", "1").split("-")[0] or 1), is_batch=True)


def render_explain(resp: pb.ExplainResponse) -> str:
    d = resp.decision
    gib = 1024**3
    lines = [f"decision {d.decision_id}  model {d.model_version}",
             f"  job: user={resp.job.user} name={resp.job.job_name} request={resp.job.tres_per_node or resp.job.tres_per_job}"
             + (f"  (job id {resp.job_id})" if resp.job_id else ""),
             f"  action: {pb.Action.Name(d.action).removeprefix('ACTION_').lower()}"
             + (f" -> {d.rewrite.tres_per_node}" if d.rewrite.HasField("tres_per_node") else ""),
             f"  predicted peak: {d.estimate.peak_bytes / gib:.2f} GiB + margin {d.estimate.margin_bytes / gib:.2f} GiB"
             f" (source {pb.EstimateSource.Name(d.estimate.source).removeprefix('ESTIMATE_SOURCE_').lower()},"
             f" {d.estimate.samples} sample(s), observed max {d.estimate.observed_max_bytes / gib:.2f} GiB)",
             f"  site factor: {d.site_factor}   swap slowdown: {d.swap_cost.slowdown:.2f}x",
             "  reasons:"]
    lines += [f"    - {r.code}: {r.message}" for r in d.reasons]
    if resp.observations:
        lines.append("  observed runs:")
        for o in resp.observations:
            peak = f"{o.peak_gpu_bytes / gib:.2f} GiB" if o.HasField("peak_gpu_bytes") else "unknown"
            lines.append(f"    - job {o.job_id} on {o.node} gpus={list(o.gpu_indices)} runtime={o.runtime_s:.1f}s "
                         f"exit={o.exit_code} peak={peak} co-runners={o.co_runners} oom={o.oom_detected}")
    return "\n".join(lines)


@main.command()
@click.argument("job_id", required=False, type=int)
@click.option("--decision", "decision_id", help="Explain a decision by its id.")
@click.option("--script", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Dry run: what would be decided for this batch script (nothing is recorded).")
@click.option("--gres", help="With --script: override #SBATCH --gres (e.g. gpu:1).")
@click.option("--job-name", help="With --script: override the job name.")
@click.option("--user", help="With --script: submit as this user (default: you).")
@click.option("--comment", help="With --script: the job's --comment (hints).")
@click.option("--json", "as_json", is_flag=True, help="Print the response as proto3 JSON.")
@click.option("--config", type=click.Path(dir_okay=False))
def explain(job_id, decision_id, script, gres, job_name, user, comment, as_json, config) -> None:
    """Show why a job was (or would be) decided the way it was."""
    cfg = _load(config)
    targets = [t for t in (job_id, decision_id, script) if t]
    if len(targets) != 1:
        raise click.UsageError("give exactly one of JOB_ID, --decision or --script")
    if script:
        req = pb.ExplainRequest(job=facts_from_script(script, {"--gres": gres, "--job-name": job_name,
                                                                 "--user": user, "--comment": comment}))
    elif job_id:
        req = pb.ExplainRequest(job_id=job_id)
    else:
        req = pb.ExplainRequest(decision_id=decision_id)
    try:
        with cli_client(cfg, max(cfg.hooks.deadline_s, 5.0), _readable_token(cfg.hooks.token_file)) as client:
            resp = client.explain(req)
    except ConfigError as exc:
        raise click.ClickException(f"configuration: {exc}") from None
    except grpc.RpcError as exc:
        raise click.ClickException(f"{exc.code().name}: {exc.details()}") from None
    click.echo(json_format.MessageToJson(resp) if as_json else render_explain(resp))


def cli_client(cfg: Config, deadline_s: float, token: str | None):
    """The CLI's client: ``ha.controllers`` in turn where set (docs/ha.md), else hooks.service_address."""
    addresses = service_addresses(cfg)
    if len(addresses) == 1:
        return configured_client(cfg, addresses[0], deadline_s, token)
    return FailoverClient(lambda a: configured_client(cfg, a, deadline_s, token), addresses, deadline_s)


def _readable_token(path: str) -> str | None:
    """The hooks' token where this user may read it (root on a node: it may explain every job);
    anyone else is identified by MUNGE. A token file others may read is never used: said on stderr."""
    try:
        return read_token(path)
    except UnsafeTokenFile as exc:
        click.echo(f"warning: {exc}; going without the token", err=True)
        return None
    except ConfigError:
        return None


@main.command("replay-spool")
@click.option("--config", type=click.Path(dir_okay=False))
def replay_spool(config: str | None) -> None:
    """Send the events the hooks spooled while the service was unreachable."""
    from slurm_plugin.hooks.run import replay_main

    cfg = _load(config)
    result = replay_main(cfg.hooks, cfg.auth, cfg.tls, cfg.ha)
    click.echo(json.dumps(result.__dict__))
    if result.stopped_by:
        sys.exit(1)


@main.command()
@click.argument("measurements", type=click.File("r"))
@click.option("--link", type=click.Choice([k.value for k in LinkKind]), default=None,
              help="Link the measurements were taken over (default: gpu.link from the config).")
@click.option("--config", type=click.Path(dir_okay=False))
def calibrate(measurements, link: str | None, config: str | None) -> None:
    """Fit the swap-cost model's link bandwidth and fault latency to measured slowdowns.

    MEASUREMENTS is a CSV with columns mode (victim|naive), access, footprint_bytes,
    working_set_bytes, offloaded_bytes, sweeps_per_s, solo_s, measured_s (see docs/model.md).
    Prints the fit and the [swap_cost] lines to put in the config."""
    from policy_service.core.calibrate import CalibrationError, fit, read_measurements

    cfg = _load(config)
    kind = LinkKind(link) if link else cfg.gpu.link
    try:
        result = fit(read_measurements(measurements), cfg.swap_cost)
    except CalibrationError as exc:
        raise click.ClickException(str(exc)) from None
    new = result.apply(cfg.swap_cost, kind)
    click.echo(f"fitted from {result.n} run(s): link {result.link_bytes_per_s / 1e9:.1f} GB/s, fault latency "
               f"{result.fault_latency_s * 1e6:.1f} us, rms slowdown error {result.rms_error:.3f}")
    click.echo("[swap_cost]")
    click.echo(f"{kind.value}_bytes_per_s = {new.link_bytes_per_s(kind):.6g}")
    click.echo(f"fault_latency_s = {new.fault_latency_s:.6g}")


@main.command("show-config")
@click.option("--config", type=click.Path(dir_okay=False))
def show_config(config: str | None) -> None:
    """Print the effective configuration (after file and environment)."""
    click.echo(_load(config).summary())


def _register_subsystem_commands() -> None:
    """Commands that live beside their subsystems."""
    from policy_service.admin import doctor_command, gres_conf_command
    from policy_service.ha.cli import ha_command
    from policy_service.history.cli import history_command
    from policy_service.report import report_command
    from policy_service.sim.cli import simulate_command

    for cmd in (doctor_command, gres_conf_command, ha_command, history_command, report_command, simulate_command):
        main.add_command(cmd)


_register_subsystem_commands()
