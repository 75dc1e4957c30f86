"""``swapaware ha``: the writer role of two controllers' services (docs/ha.md).

``primary-on`` / ``primary-off`` are slurm.conf's SlurmctldPrimaryOnProg / SlurmctldPrimaryOffProg:
they write the role file the service watches (ha/role.py). ``status`` prints the store's
writer lease and this host's role."""
from __future__ import annotations

import json
import time
from pathlib import Path

import click

from policy_service.config import Config, ConfigError, load_config


def _load(config: str | None) -> Config:
    try:
        return load_config(Path(config) if config else None)
    except ConfigError as exc:
        raise click.ClickException(f"configuration: {exc}") from None


@click.group("ha")
def ha_command() -> None:
    """Two controllers, one history: the writer role (docs/ha.md)."""


def _write(config: str | None, role_name: str) -> None:
    from policy_service.ha.role import write_role
    from policy_service.core.ha import Role

    cfg = _load(config)
    try:
        write_role(cfg.ha.role_file, Role(role_name), time.time())
    except OSError as exc:
        raise click.ClickException(f"role file {cfg.ha.role_file} not written: {exc}") from None
    click.echo(f"{cfg.ha.role_file}: {role_name}")


@ha_command.command("primary-on")
@click.option("--config", type=click.Path(dir_okay=False))
def primary_on(config: str | None) -> None:
    """This host's slurmctld is now in control (SlurmctldPrimaryOnProg)."""
    _write(config, "primary")


@ha_command.command("primary-off")
@click.option("--config", type=click.Path(dir_okay=False))
def primary_off(config: str | None) -> None:
    """This host's slurmctld is no longer in control (SlurmctldPrimaryOffProg)."""
    _write(config, "backup")


@ha_command.command("status")
@click.option("--json", "as_json", is_flag=True, help="One JSON object.")
@click.option("--config", type=click.Path(dir_okay=False))
def status(as_json: bool, config: str | None) -> None:
    """The writer lease (holder, epoch, expiry) and this host's role."""
    from policy_service.ha.role import holder_name, lease_view, read_role_file
    from policy_service.history.store import open_history

    from policy_service.trust.access import resolve_slurm_uid
    from policy_service.ha.role import trusted_uids

    cfg = _load(config)
    try:
        slurm_uid = resolve_slurm_uid(cfg.auth, None)[0]  # auth.slurm_user, else the user "slurm"
    except ConfigError:
        slurm_uid = None
    role, at, problem = read_role_file(cfg.ha.role_file, trusted_uids(slurm_uid))
    try:
        store = open_history(cfg)
        try:
            lease = lease_view(store.writer())
        finally:
            store.close()
    except Exception as exc:  # noqa: BLE001 - said, with what else is known
        raise click.ClickException(f"the history cannot be read: {type(exc).__name__}: {exc}") from None
    me = holder_name(cfg.ha)
    live = lease is not None and lease.expires_at > lease.now
    out = {"holder": lease.holder if lease else None, "epoch": lease.epoch if lease else None,
           "expires_in_s": round(lease.expires_at - lease.now, 3) if lease else None, "live": live,
           "this_host": me, "this_host_writes": bool(live and lease.holder == me),
           "role_file": str(cfg.ha.role_file), "role_file_says": role.value if role else None,
           "role_file_age_s": None if at is None else round(time.time() - at, 1), "role_file_problem": problem,
           "ha_enabled": cfg.ha.enabled}
    if as_json:
        click.echo(json.dumps(out, sort_keys=True))
        return
    if lease is None:
        click.echo("writer lease: never taken")
    else:
        click.echo(f"writer lease: {lease.holder}, epoch {lease.epoch}, "
                   + (f"expires in {lease.expires_at - lease.now:.1f} s" if live
                      else f"expired {lease.now - lease.expires_at:.1f} s ago"))
    click.echo(f"this host: {me}, " + ("the writer" if out["this_host_writes"] else "standby")
               + f"; role file {cfg.ha.role_file}: " + (role.value if role else (problem or "none")))
