"""TLS credentials for gRPC from ``[tls]`` (``policy_service.trust.auth_config.TlsConfig``).

Each side checks the files it uses when it builds its credentials: they exist, are readable,
and private keys are not readable by everyone (``ConfigError`` says which and why).
"""
from __future__ import annotations

import stat
from pathlib import Path

import grpc

from policy_service.trust.auth_config import TlsConfig
from policy_service.config import ConfigError


def _read(key: str, path: str, secret: bool = False) -> bytes:
    p = Path(path)
    try:
        mode = p.stat().st_mode
        data = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"tls.{key}: {path}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(mode):
        raise ConfigError(f"tls.{key}: {path} is not a regular file")
    if secret and mode & stat.S_IROTH:
        raise ConfigError(f"tls.{key}: {path} is readable by every user (mode {stat.S_IMODE(mode):04o}); "
                          f"chmod o-r it (e.g. 0600 or 0640)")
    if b"-----BEGIN " not in data:
        raise ConfigError(f"tls.{key}: {path} is not PEM (no '-----BEGIN' line)")
    return data


def server_enabled(tls: TlsConfig) -> bool:
    return bool(tls.cert)


def client_enabled(tls: TlsConfig) -> bool:
    return bool(tls.ca)


def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials:
    """The service's credentials: its certificate and key; client certificates required when
    ``client_ca`` is set."""
    if not server_enabled(tls):
        raise ConfigError("tls.cert and tls.key are not set")
    pair = [(_read("key", tls.key, secret=True), _read("cert", tls.cert))]
    if tls.client_ca:
        return grpc.ssl_server_credentials(pair, root_certificates=_read("client_ca", tls.client_ca),
                                           require_client_auth=True)
    return grpc.ssl_server_credentials(pair)


def channel_credentials(tls: TlsConfig) -> grpc.ChannelCredentials | None:
    """A client's credentials (None: plaintext, ``tls.ca`` is not set)."""
    if not client_enabled(tls):
        return None
    key = _read("client_key", tls.client_key, secret=True) if tls.client_key else None
    cert = _read("client_cert", tls.client_cert) if tls.client_cert else None
    return grpc.ssl_channel_credentials(root_certificates=_read("ca", tls.ca), private_key=key,
                                        certificate_chain=cert)
