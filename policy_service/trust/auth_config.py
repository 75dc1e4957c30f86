"""The ``[auth]`` and ``[tls]`` sections of the one configuration (``policy_service.config``).

Kept beside config.py so that file stays readable; ``Config.auth`` and ``Config.tls`` are these.
Pure: the checks return error messages, ``config`` raises them as one ``ConfigError``. Files
named under ``[tls]`` are checked by the component that uses them (``policy_service.trust.tls``): the
service's key need not exist on a compute node that reads the same file.
"""
from __future__ import annotations

import enum
import ipaddress
import stat
from dataclasses import dataclass
from pathlib import Path

from policy_service.trust.cred_binding import CLIENT_TTL_S
from policy_service.trust.munge import DEFAULT_SOCKET


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
    # Refuse credentials made to live longer than this (munged enforces each one's own TTL). At
    # most the TTL the clients give theirs (cred_binding.CLIENT_TTL_S, 60 s): a longer-lived
    # credential is none of theirs (Slurm's own live 300 s).
    max_ttl_s: int = CLIENT_TTL_S
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
    if not 1 <= auth.max_ttl_s <= CLIENT_TTL_S:
        errors.append(f"auth.max_ttl_s must be between 1 and {CLIENT_TTL_S} (the TTL swapaware's clients give "
                      f"their MUNGE credentials)")
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


# The hooks' token (service.token_file, hooks.token_file) is a bearer secret: whoever holds a copy
# is the nodes' hooks. It is kept where only its owner reads it, and sent only where nobody else
# can read it on the way (docs/admin-guide.md, "Identity and access").

LOCAL_SCHEMES = ("unix:", "unix-abstract:", "unix-abstract%3A")


def token_mode_error(path: str, mode: int) -> str | None:
    """Why a token file of this st_mode must not be used (None: it may)."""
    if not stat.S_ISREG(mode):
        return f"token file {path} is not a regular file"
    if mode & 0o077:
        return (f"token file {path} is readable or writable by group or others (mode "
                f"{stat.S_IMODE(mode):04o}): anyone who reads it can send events as the nodes' hooks; "
                f"run chmod 600 {path}")
    return None


def address_host(address: str) -> str | None:
    """The host of a gRPC target ('10.0.0.1:50551', '[::1]:50551', 'dns:///node:50551');
    None for a Unix socket ('unix:/run/x.sock')."""
    if address.startswith(LOCAL_SCHEMES):
        return None
    target = address.split("///", 1)[1] if "///" in address else address.removeprefix("dns:")
    if target.startswith("["):
        return target[1:target.find("]")] if "]" in target else target
    host, sep, _ = target.rpartition(":")
    return host if sep else target


def is_loopback(address: str) -> bool:
    """Whether a gRPC target stays on this host: a Unix socket, 127.0.0.0/8, ::1 (or
    ::ffff:127.x) or the name localhost. Other names are not looked up: a resolver can lie."""
    host = address_host(address)
    if host is None or host.lower() == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def plaintext_token_error(address: str, tls: bool) -> str | None:
    """Why the token must not be sent to ``address`` (None: it may): without TLS only to this host."""
    if tls or is_loopback(address):
        return None
    return (f"refusing to send the hooks' token in plaintext to {address} (not this host): anyone on "
            f"the path, or a process that holds the port, would get it; set tls.ca (the CA of the "
            f"service's certificate, with tls.cert/tls.key on the service) or use MUNGE "
            f"(auth.munge) without a token")
