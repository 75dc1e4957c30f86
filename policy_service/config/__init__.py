"""The one typed configuration of swapaware: TOML file + environment overrides.

Every component (service, hooks, node agent, simulator) reads this same object. It is
validated once at start and logged once (``Config.summary()``).

Sources, later wins:
  1. the defaults in ``sections.py`` and ``policy_sections.py``;
  2. the TOML file named by ``--config`` / ``SWAPAWARE_CONFIG`` (default
     ``/etc/swapaware/swapaware.toml`` when it exists);
  3. environment variables ``SWAPAWARE_<SECTION>__<KEY>`` (e.g. ``SWAPAWARE_SERVICE__DB_PATH``).
"""
from __future__ import annotations

from policy_service.trust.auth_config import (AuthConfig, MungeMode, TlsConfig, auth_errors, bool_spelling,
                                             tls_errors, token_mode_error)
from policy_service.config.load import load_config, read_token, split_host_port
from policy_service.config.choices import (AccessClass, Enforcement, LinkKind, NvmlBackend, Oversubscription,
                                           PolicyMode, SlurmBackend, WholeGpuAsShards)
from policy_service.config.policy_sections import (GIB, EstimatorConfig, GpuConfig, InterferenceConfig, PolicyConfig,
                                                   SwapCostConfig)
from policy_service.config.sections import (DEFAULT_CONFIG_PATH, AdmissionConfig, AgentConfig, Config, ConfigError,
                                            HaConfig, HookConfig, ServiceConfig, UnsafeTokenFile)
from policy_service.history.config import HistoryBackend, HistoryConfig, history_errors

__all__ = [
    "AccessClass",
    "AdmissionConfig",
    "AgentConfig",
    "AuthConfig",
    "Config",
    "ConfigError",
    "DEFAULT_CONFIG_PATH",
    "Enforcement",
    "EstimatorConfig",
    "GIB",
    "GpuConfig",
    "HaConfig",
    "HistoryBackend",
    "HistoryConfig",
    "HookConfig",
    "InterferenceConfig",
    "LinkKind",
    "MungeMode",
    "NvmlBackend",
    "Oversubscription",
    "PolicyConfig",
    "PolicyMode",
    "ServiceConfig",
    "SlurmBackend",
    "SwapCostConfig",
    "TlsConfig",
    "UnsafeTokenFile",
    "WholeGpuAsShards",
    "auth_errors",
    "bool_spelling",
    "history_errors",
    "load_config",
    "read_token",
    "split_host_port",
    "tls_errors",
    "token_mode_error",
]
