"""``swapaware doctor`` and ``swapaware gres-conf``: the click commands (all the I/O)."""
from __future__ import annotations

import logging
import os
import socket
import sys
from pathlib import Path
from typing import Sequence

import click

from policy_service.admin.checks import (Check, doctor_checks, enforcement_checks, gres_conf_lines, queue_check,
                                        shards_fitting)
from policy_service.admin.grpc_port import look_at_port
from policy_service.admin.host import host_checks
from policy_service.slurm.slurm_files import parse_slurm_conf
from policy_service.config import Config, ConfigError, load_config
from policy_service.core.ha import service_addresses
from slurm_plugin.gpu.nvml import GpuTelemetry, TelemetryError, open_telemetry

log = logging.getLogger("swapaware.admin")


def _default_slurm_conf() -> str:
    return os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf")


def _load(config_path: Path | None) -> Config:
    try:
        return load_config(config_path)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None


def probe_service(address: str, timeout_s: float, tls=None) -> bool:
    """gRPC health check of the policy service (overall status), bounded by ``timeout_s``;
    ``tls``: ``[tls]`` (TlsConfig), whose ``ca`` checks the service's certificate."""
    try:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        from policy_service.trust.tls import channel_credentials

        creds = channel_credentials(tls) if tls is not None else None
        with (grpc.secure_channel(address, creds) if creds else grpc.insecure_channel(address)) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        return reply.status == health_pb2.HealthCheckResponse.SERVING
    except Exception:  # noqa: BLE001 - any failure means "not reachable"
        return False


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _print_checks(checks: Sequence[Check]) -> None:
    for c in checks:
        click.echo(f"[{c.label}] {c.name}: {c.detail}")
        if (c.warn or not c.ok) and c.fix:
            click.echo(f"       fix: {c.fix}")


@click.command("doctor")
@click.option("--slurm-conf", type=click.Path(path_type=Path), default=_default_slurm_conf, show_default="$SLURM_CONF "
              "or /etc/slurm/slurm.conf")
@click.option("--gres-conf", type=click.Path(path_type=Path), default=None, help="default: next to slurm.conf")
@click.option("--config", "config_path", type=click.Path(path_type=Path), default=None)
@click.option("--no-probes", is_flag=True, help="do not contact the policy service or the node agent")
def doctor_command(slurm_conf: Path, gres_conf: Path | None, config_path: Path | None, no_probes: bool) -> None:
    """Check this node's Slurm and swapaware setup; exit 1 when a check fails."""
    cfg = _load(config_path)
    gres_conf = gres_conf or slurm_conf.parent / "gres.conf"
    slurm_text, gres_text = _read(slurm_conf), _read(gres_conf)
    missing = [Check(f"read {p}", False, "file not readable", "pass --slurm-conf / --gres-conf")
               for p, t in ((slurm_conf, slurm_text), (gres_conf, gres_text)) if t is None]
    telemetry, opened = _open_telemetry_checked(cfg)
    service = None if no_probes else any(probe_service(a, cfg.hooks.deadline_s, cfg.tls)  # ha.controllers: any
                                         for a in service_addresses(cfg))
    from policy_service.slurm.slurm import cluster_release

    release = cluster_release(cfg.service.slurm_release, cfg.service.slurm_timeout_s)
    hostname = socket.gethostname().split(".")[0]
    dialect = release.dialect if release.version is not None else None
    checks = missing + opened + doctor_checks(slurm_text or "", gres_text or "", cfg, telemetry, service,
                                              hostname=hostname, dialect=dialect,
                                              grpc_port=look_at_port(cfg, ask_service=not no_probes))
    checks += enforcement_checks(cfg)  # which GPU memory enforcement this node has, what it enforces
    # how Slurm reaches swapaware here: Lua files, swapaware_plugin.conf, SlurmUser's access, the service's
    # user, the agent (a line of its own where this user may not ask it), MUNGE's origin: admin/host.py
    if slurm_text is not None:
        checks += host_checks(slurm_conf, slurm_text, cfg, hostname, probes=not no_probes, dialect=dialect)
    from policy_service.slurm.queue import reads_queue

    if not no_probes and reads_queue(cfg):
        from policy_service.slurm.slurm import CliSlurm

        checks.append(queue_check(CliSlurm(cfg.service.slurm_timeout_s), cfg))
    _print_checks(checks)
    if not all(c.ok for c in checks):
        sys.exit(1)


def _open_telemetry_checked(cfg: Config) -> tuple[GpuTelemetry | None, list[Check]]:
    try:
        return open_telemetry(cfg.agent, log), []
    except TelemetryError as exc:
        return None, [Check("nvml_backend", False, str(exc), "install the driver or set agent.nvml_backend=auto")]


@click.command("gres-conf")
@click.option("--slurm-conf", type=click.Path(path_type=Path), default=_default_slurm_conf,
              help="cross-checked against the generated counts when readable")
@click.option("--config", "config_path", type=click.Path(path_type=Path), default=None)
@click.option("--shard-bytes", type=int, default=None,
              help="memory of one shard on every GPU; default: gpu.shard_bytes (gpu.memory_bytes / gpu.shards_per_gpu)")
@click.option("--device-prefix", default="/dev/nvidia", show_default=True)
def gres_conf_command(slurm_conf: Path, config_path: Path | None, shard_bytes: int | None,
                      device_prefix: str) -> None:
    """Print a gres.conf for this node's GPUs (from NVML, or the fake): each GPU's shards are its
    memory in units of gpu.shard_bytes."""
    cfg = _load(config_path)
    unit = shard_bytes or cfg.gpu.shard_bytes
    try:
        telemetry = open_telemetry(cfg.agent, log)
        if telemetry is None:
            raise click.ClickException("no GPU telemetry on this node (NVML unavailable)")
        lines = gres_conf_lines(telemetry, unit, device_prefix)
        shards = sum(shards_fitting(telemetry.memory(i).total_bytes, unit) for i in range(telemetry.device_count()))
    except (TelemetryError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo("\n".join(lines))
    _warn_slurm_conf_mismatch(_read(slurm_conf), telemetry.device_count(), shards)


def _warn_slurm_conf_mismatch(text: str | None, gpus: int, shards: int) -> None:
    if text is None:
        return
    host = socket.gethostname().split(".")[0]
    for node in parse_slurm_conf(text).nodes:
        if host in node.names and (node.gres.get("gpu"), node.gres.get("shard")) != (gpus, shards):
            click.echo(f"warning: slurm.conf NodeName={node.expr} has Gres gpu={node.gres.get('gpu', 0)} "
                       f"shard={node.gres.get('shard', 0)}; this node needs Gres=gpu:{gpus},shard:{shards}", err=True)
