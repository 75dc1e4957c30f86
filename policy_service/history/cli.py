"""``swapaware history``: the history's own commands (docs/history-backends.md). ``migrate`` copies
a SQLite history into the MariaDB database that [history] names."""
from __future__ import annotations

from pathlib import Path

import click

from policy_service.config import ConfigError
from policy_service.history.config import HistoryBackend


@click.group("history")
def history_command() -> None:
    """The history database (docs/history-backends.md)."""


@history_command.command("migrate")
@click.option("--from", "source", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="The SQLite history to copy (service.db_path of the single-host service; stop it first).")
@click.option("--resume", is_flag=True, help="Finish an interrupted copy of the same history (rows already "
                                                "in the target are skipped); without it a non-empty target is refused.")
@click.option("--batch", default=5000, show_default=True, type=click.IntRange(1, 100_000), help="Rows per transaction.")
@click.option("--config", type=click.Path(dir_okay=False), help="TOML config (default: $SWAPAWARE_CONFIG).")
def migrate_command(source: Path, resume: bool, batch: int, config: str | None) -> None:
    """Copy a SQLite history into the configured MariaDB database ([history] backend = "mariadb"),
    verify each table's row count, and print rows/s."""
    from policy_service.history.db import HistoryUnavailable
    from policy_service.history.migrate import MigrationError, migrate_history
    from policy_service.cli import _load  # (cli.py registers this group: imported when run)

    cfg = _load(config)
    if cfg.history.backend is not HistoryBackend.MARIADB:
        raise click.ClickException('the target is [history] backend = "mariadb" (with host or unix_socket, '
                                   "database, user, password_file); this configuration names SQLite")
    click.echo(f"copying {source} into {cfg.history.where()} ({batch} rows per transaction)")
    try:
        result = migrate_history(source, cfg.history, cfg.service.db_path, resume=resume, batch=batch)
    except (MigrationError, HistoryUnavailable, ConfigError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    for t in result.tables:
        click.echo(f"  {t.table:<16} {t.source_rows:>10} rows  {t.seconds:8.2f} s  (target holds {t.target_rows})")
    click.echo(f"{result.rows} rows in {result.seconds:.2f} s: {result.rows_per_s:,.0f} rows/s; counts verified")
