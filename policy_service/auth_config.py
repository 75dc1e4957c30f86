"""The ``[auth]`` and ``[tls]`` sections of the one configuration (``policy_service.config``).

Kept beside config.py so that file stays readable; ``Config.auth`` and ``Config.tls`` are these.
Pure: the checks return error messages, ``config`` raises them as one ``ConfigError``. Files
named under ``[tls]`` are checked by the component that uses them (``policy_service.tls``): the
service's key need not exist on a compute node that reads the same file.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path

from policy_service.munge import DEFAULT_SOCKET


def bool_spelling(value: object) -> bool | None:
    """A boolean in any TOML / environment spelling (1, true, yes, on / 0, false, no, off); None
    for anything else. Tri-state settings (auto, on, off) accept these for on and off."""
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    return None


class MungeMode(enum.Enum):
    """auth.munge: auto (used where libmunge loads and munged's socket exists), on, off.
    Booleans are accepted in any TOML / environment spelling."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"

    @classmethod
    def _missing_(cls, value: object) -> "MungeMode | None":
        return {True: cls.ON, False: cls.OFF}.get(bool_spelling(value))


@dataclass(frozen=True)
class AuthConfig:
    """Who may call what (docs/admin-guide.md, "Identity and access")."""

    # MUNGE credentials on gRPC calls: clients attach one per call, the service checks them.
    munge: MungeMode = MungeMode.AUTO
    munge_socket: Path = Path(DEFAULT_SOCKET)
    # Slurm's SlurmUser (name or uid): trusted like root. Empty: SlurmUser from `scontrol show
    # config` at start, else the user "slurm" where it exists, else root.
    slurm_user: str = ""
    # Members of this Unix group may explain every job (besides root, SlurmUser and Slurm
    # operators / administrators). Empty: none.
    admin_group: str = ""
    # With service.token_file set, a caller holding that token may send events (the fallback
    # for nodes without MUNGE). Has no effect without a token file.
    accept_token: bool = True
    # Refuse credentials made to live longer than this (munged enforces each one's own TTL).
    max_ttl_s: int = 300
    # The cluster's node and controller addresses (a credential's origin must be one) are
    # re-read from Slurm after this long, and on an unknown origin at most every
    # address_refresh_min_s.
    address_cache_s: float = 300.0
    address_refresh_min_s: float = 30.0
    # A user's Slurm AdminLevel (sacctmgr) is re-read after this long.
    admin_level_cache_s: float = 300.0


@dataclass(frozen=True)
class TlsConfig:
    """TLS for gRPC. Service side: ``cert`` + ``key`` turn it on; ``client_ca`` then requires
    client certificates signed by that CA. Client side (hooks, CLI): ``ca`` turns it on (the CA
    that signed the service's certificate); ``client_cert`` + ``client_key`` when required."""

    cert: str = ""
    key: str = ""
    client_ca: str = ""
    ca: str = ""
    client_cert: str = ""
    client_key: str = ""


def auth_errors(auth: AuthConfig) -> list[str]:
    errors = []
    if auth.max_ttl_s < 1:
        errors.append("auth.max_ttl_s must be >= 1")
    if auth.address_cache_s <= 0:
        errors.append("auth.address_cache_s must be > 0")
    if auth.address_refresh_min_s < 0:
        errors.append("auth.address_refresh_min_s must be >= 0")
    if auth.admin_level_cache_s < 0:
        errors.append("auth.admin_level_cache_s must be >= 0")
    if not str(auth.munge_socket).startswith("/"):
        errors.append(f"auth.munge_socket: {auth.munge_socket} is not an absolute path")
    return errors


def tls_errors(tls: TlsConfig) -> list[str]:
    """Pairs that only work together (the files themselves are checked where they are used)."""
    errors = []
    if bool(tls.cert) != bool(tls.key):
        errors.append("tls.cert and tls.key go together: set both (TLS on gRPC) or neither")
    if tls.client_ca and not tls.cert:
        errors.append("tls.client_ca needs tls.cert and tls.key (client certificates need TLS)")
    if bool(tls.client_cert) != bool(tls.client_key):
        errors.append("tls.client_cert and tls.client_key go together: set both or neither")
    if tls.client_cert and not tls.ca:
        errors.append("tls.client_cert needs tls.ca (the CA of the service's certificate)")
    return errors
