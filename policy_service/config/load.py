"""Reading the configuration: TOML file, then ``SWAPAWARE_<SECTION>__<KEY>`` environment
overrides, each value coerced to its field's type, then every cross-field check at once."""
from __future__ import annotations

import dataclasses
import enum
import os
import tomllib
import typing
from pathlib import Path
from typing import Any, Mapping

from policy_service.trust.auth_config import auth_errors, tls_errors, token_mode_error
from policy_service.config.sections import DEFAULT_CONFIG_PATH, Config, ConfigError, UnsafeTokenFile
from policy_service.config.policy_sections import interference_checks
from policy_service.core.dialect import is_release
from policy_service.history.config import history_errors


def _coerce(section: str, key: str, typ: Any, raw: Any) -> Any:
    where = f"{section}.{key}"
    try:
        if isinstance(typ, type) and issubclass(typ, enum.Enum):
            try:
                return typ(str(raw).lower())
            except ValueError:
                allowed = ", ".join(m.value for m in typ)
                raise ConfigError(f"{where}: {raw!r} is not one of: {allowed}") from None
        if typ is bool:
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ConfigError(f"{where}: {raw!r} is not a boolean")
        if typ is int:
            if isinstance(raw, bool):
                raise ConfigError(f"{where}: expected an integer, got a boolean")
            return int(raw)
        if typ is float:
            return float(raw)
        if typ is Path:
            return Path(str(raw))
        if typ is str:
            return str(raw)
        if typing.get_origin(typ) is tuple:  # tuple[str, ...]: a TOML list or "a,b" in the environment
            items = raw if isinstance(raw, (list, tuple)) else str(raw).split(",")
            return tuple(str(x).strip() for x in items if str(x).strip())
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {raw!r} is not a valid {getattr(typ, '__name__', typ)}: {exc}") from None
    raise ConfigError(f"{where}: unsupported type {typ}")


def _build_section(name: str, cls: type, values: Mapping[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"[{name}]: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return cls(**{k: _coerce(name, k, hints[k], v) for k, v in values.items()})


def _validate(cfg: Config) -> None:
    checks = [
        (cfg.gpu.memory_bytes > 0, "gpu.memory_bytes must be > 0"),
        (1 <= cfg.gpu.shards_per_gpu <= 1024, "gpu.shards_per_gpu must be in 1..1024"),
        (0 < cfg.estimator.ewma_alpha <= 1, "estimator.ewma_alpha must be in (0, 1]"),
        (cfg.estimator.min_margin_frac >= 0, "estimator.min_margin_frac must be >= 0"),
        (cfg.estimator.oom_margin_multiplier >= 1, "estimator.oom_margin_multiplier must be >= 1"),
        (cfg.estimator.max_margin_multiplier >= 1, "estimator.max_margin_multiplier must be >= 1"),
        (cfg.estimator.oom_whole_gpu_runs >= 0, "estimator.oom_whole_gpu_runs must be >= 0"),
        (0 < cfg.estimator.oom_charge_frac <= 1, "estimator.oom_charge_frac must be in (0, 1]"),
        (cfg.estimator.min_samples >= 1, "estimator.min_samples must be >= 1"),
        (0 <= cfg.estimator.cold_margin_frac <= 4, "estimator.cold_margin_frac must be in [0, 4]"),
        (cfg.estimator.cold_samples >= 0, "estimator.cold_samples must be >= 0"),
        (0 <= cfg.estimator.recent_runs <= 256, "estimator.recent_runs must be in 0..256"),
        (cfg.estimator.quantile_min_runs >= 1, "estimator.quantile_min_runs must be >= 1"),
        (0 < cfg.estimator.margin_quantile <= 1, "estimator.margin_quantile must be in (0, 1]"),
        (cfg.estimator.quantile_floor_frac >= 0, "estimator.quantile_floor_frac must be >= 0"),
        (cfg.estimator.margin_multiplier_decay >= 1, "estimator.margin_multiplier_decay must be >= 1"),
        (cfg.estimator.wide_key_user_cap >= 1, "estimator.wide_key_user_cap must be >= 1"),
        (cfg.policy.max_victim_slowdown >= 1, "policy.max_victim_slowdown must be >= 1"),
        (cfg.policy.max_interference_slowdown == 0 or cfg.policy.max_interference_slowdown >= 1,
         "policy.max_interference_slowdown must be 0 (no budget) or >= 1"),
        (cfg.policy.interference_min_shared_runs >= 1, "policy.interference_min_shared_runs must be >= 1"),
        *interference_checks(cfg.interference),
        (0 <= cfg.policy.site_factor_max < 2**31 - 2, "policy.site_factor_max must fit Slurm's site factor"),
        (0 <= cfg.policy.share_min_queue <= 100, "policy.share_min_queue must be in [0, 100]"),
        (cfg.policy.queue_poll_s > 0, "policy.queue_poll_s must be > 0"),
        (cfg.policy.overcommit_compute_min_queue >= 0, "policy.overcommit_compute_min_queue must be >= 0"),
        (cfg.policy.redecide_max_per_poll >= 1, "policy.redecide_max_per_poll must be >= 1"),
        (cfg.policy.admin_comment_max_chars >= 80, "policy.admin_comment_max_chars must be >= 80"),
        (cfg.service.open_run_max_s > 0, "service.open_run_max_s must be > 0"),
        (cfg.service.history_check_s > 0, "service.history_check_s must be > 0"),
        (cfg.service.reconcile_s > 0, "service.reconcile_s must be > 0"),
        (cfg.service.reconcile_window_s > cfg.service.reconcile_settle_s >= 0,
         "service.reconcile_window_s must be > service.reconcile_settle_s >= 0"),
        (not cfg.service.metrics_address or _host_port(cfg.service.metrics_address),
         f"service.metrics_address must be host:port (e.g. 127.0.0.1:9851), not {cfg.service.metrics_address!r}"),
        (not cfg.agent.metrics_address or _host_port(cfg.agent.metrics_address),
         f"agent.metrics_address must be host:port (e.g. 0.0.0.0:9852), not {cfg.agent.metrics_address!r}"),
        (cfg.hooks.deadline_s > 0, "hooks.deadline_s must be > 0"),
        (cfg.admission.refresh_s > 0, "admission.refresh_s must be > 0"),
        (cfg.admission.valid_s > cfg.admission.refresh_s, "admission.valid_s must be > admission.refresh_s"),
        (cfg.admission.horizon_s > 0, "admission.horizon_s must be > 0"),
        (1 <= cfg.admission.max_entries <= 9_999_999, "admission.max_entries must be in 1..9999999"),
        (cfg.admission.archive_keep >= 1, "admission.archive_keep must be >= 1"),
        (0 < cfg.ha.renew_s * 2 <= cfg.ha.lease_ttl_s, "ha.renew_s must be > 0 and at most half of ha.lease_ttl_s"),
        (all(_host_port(a) for a in cfg.ha.controllers), f"ha.controllers must be host:port addresses, not {cfg.ha.controllers!r}"),
        (cfg.agent.sample_period_s > 0, "agent.sample_period_s must be > 0"),
        (0 < cfg.agent.replay_interval_s <= cfg.agent.replay_max_backoff_s,
         "agent.replay_interval_s must be > 0 and <= agent.replay_max_backoff_s"),
        (cfg.swap_cost.fault_granularity_bytes > 0, "swap_cost.fault_granularity_bytes must be > 0"),
        (cfg.service.max_workers >= 1, "service.max_workers must be >= 1"),
        (not cfg.service.slurm_release or is_release(cfg.service.slurm_release),
         f"service.slurm_release: {cfg.service.slurm_release!r} is not a Slurm release (use e.g. 24.11, or empty)"),
    ]
    errors = [msg for ok, msg in checks if not ok] + auth_errors(cfg.auth) + tls_errors(cfg.tls)
    errors += history_errors(cfg.history)
    if errors:
        raise ConfigError("; ".join(errors))


def read_token(path: str) -> str | None:
    """The shared secret in ``path`` (stripped), None when no file is configured. A file that
    group or others may read raises UnsafeTokenFile (the mode is that of the file opened)."""
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            unsafe = token_mode_error(path, os.fstat(f.fileno()).st_mode)
            if unsafe:
                raise UnsafeTokenFile(unsafe)
            token = f.read().decode().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"token file {path}: {exc}") from None
    if not token:
        raise ConfigError(f"token file {path} is empty")
    return token


def split_host_port(address: str) -> tuple[str, int]:
    """'127.0.0.1:9851' -> ('127.0.0.1', 9851); '[::1]:9851' too; ':9851' binds every address.
    ValueError when it is not host:port."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"address {address!r} is not host:port")
    return host.strip("[]") or "0.0.0.0", int(port)


def _host_port(address: str) -> bool:
    try:
        split_host_port(address)
    except ValueError:
        return False
    return True


def load_config(path: Path | None = None, env: Mapping[str, str] | None = None) -> Config:
    """Build and validate the configuration. ``env`` defaults to ``os.environ``."""
    env = os.environ if env is None else env
    explicit = path or (Path(env["SWAPAWARE_CONFIG"]) if env.get("SWAPAWARE_CONFIG") else None)
    data: dict[str, Any] = {}
    source = "defaults"
    if explicit is not None:
        if not explicit.is_file():
            raise ConfigError(f"config file {explicit} does not exist")
        chosen: Path | None = explicit
    else:
        chosen = DEFAULT_CONFIG_PATH if DEFAULT_CONFIG_PATH.is_file() else None
    if chosen is not None:
        try:
            data = tomllib.loads(chosen.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{chosen}: not valid TOML: {exc}") from None
        source = str(chosen)
    sections = {f.name: f for f in dataclasses.fields(Config) if f.name != "source"}
    unknown = sorted(set(data) - set(sections))
    if unknown:
        raise ConfigError(f"unknown section(s) {', '.join(unknown)}; known: {', '.join(sorted(sections))}")
    merged: dict[str, dict[str, Any]] = {name: dict(data.get(name, {})) for name in sections}
    env_used = False
    for key, value in env.items():
        if not key.startswith("SWAPAWARE_") or "__" not in key:
            continue
        section, _, item = key[len("SWAPAWARE_"):].lower().partition("__")
        if section not in merged:
            raise ConfigError(f"{key}: unknown section {section!r}")
        merged[section][item] = value
        env_used = True
    built = {name: _build_section(name, typing.get_type_hints(Config)[name], merged[name]) for name in sections}
    cfg = Config(**built, source=source + (" + environment" if env_used else ""))
    _validate(cfg)
    return cfg
