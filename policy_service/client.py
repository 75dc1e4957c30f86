"""gRPC client of the policy service, with a deadline on every call; optionally TLS, the hooks'
token and a fresh MUNGE credential on every call (a credential decodes once: munged keeps a
replay cache), bound to that call's method and request (policy_service/cred_binding.py).

Every gRPC client of the project (hooks, node agent, ``swapaware explain``, ``replay-spool``)
calls through ``PolicyClient.call``: it serialises the request once, makes the credential for
those bytes and sends those bytes."""
from __future__ import annotations

import logging

import grpc

from policy_service import cred_binding, munge
from policy_service.auth_config import plaintext_token_error
from policy_service.config import ConfigError

from policy_service._generated.swapaware.v1 import policy_pb2 as pb

log = logging.getLogger("swapaware.client")
MUNGE_METADATA = "x-swapaware-munge"  # the service reads a credential here (policy_service.access)
MUNGE_TTL_S = cred_binding.CLIENT_TTL_S  # each credential is used at once, and once
SERVICE = "swapaware.v1.PolicyService"
_METHODS = pb.DESCRIPTOR.services_by_name["PolicyService"].methods_by_name
METHODS = tuple(_METHODS)  # the RPCs' proto names: Admit, JobStarted, ...


def method_path(method: str) -> str:
    """The full gRPC name of an RPC of the policy service ('Admit' -> '/swapaware.v1.PolicyService/Admit')."""
    return f"/{SERVICE}/{method}"


def message_types(method: str) -> tuple[type, type]:
    """(request, reply) message classes of an RPC of the policy service, by its proto name."""
    m = _METHODS[method]
    return getattr(pb, m.input_type.name), getattr(pb, m.output_type.name)


def serialised(request) -> bytes:
    """A request's bytes on the wire: deterministic, so a credential's digest is of what is sent."""
    return request.SerializeToString(deterministic=True)


RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED,
             grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED}


class PolicyClient:
    def __init__(self, address: str, deadline_s: float, token: str | None = None,
                 munge_socket: str | None = None, tls: grpc.ChannelCredentials | None = None):
        """``munge_socket``: attach a MUNGE credential made through this munged to every call
        (None: none); ``tls``: channel credentials (``policy_service.tls.channel_credentials``).
        A token goes in plaintext only to this host: ConfigError for any other address without TLS."""
        refused = plaintext_token_error(address, tls is not None) if token else None
        if refused:
            raise ConfigError(refused)
        self.address, self.deadline_s = address, deadline_s
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._munge_socket = munge_socket
        options = [("grpc.enable_retries", 0)]
        self._channel = (grpc.secure_channel(address, tls, options=options) if tls is not None
                         else grpc.insecure_channel(address, options=options))
        # Requests go as bytes (serialised here, see call); replies are parsed by their type.
        self._calls = {name: self._channel.unary_unary(method_path(name), request_serializer=None,
                                                       response_deserializer=message_types(name)[1].FromString)
                       for name in _METHODS}

    def metadata(self, method: str = "", raw: bytes = b"") -> tuple[tuple[str, str], ...] | None:
        """The metadata of one call of ``method`` (full gRPC name) with the serialised request
        ``raw``: the token, and a credential made now whose payload binds it to them (none without
        a method). A credential that cannot be made (munged down) is left out and logged: the
        service then says what it needs."""
        md = self._metadata
        if self._munge_socket is not None and method:
            try:
                cred = munge.encode(cred_binding.payload(method, raw), socket=self._munge_socket, ttl=MUNGE_TTL_S)
                md = md + ((MUNGE_METADATA, cred),)
            except munge.MungeError as exc:
                log.warning("no MUNGE credential for this call: %s", exc)
        return md or None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "PolicyClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def call(self, method: str, request):
        """Call an RPC by its proto name ('Admit', 'JobFinished', ...)."""
        raw = serialised(request)
        return self._calls[method](raw, timeout=self.deadline_s, metadata=self.metadata(method_path(method), raw))

    def admit(self, job: pb.JobFacts, dry_run: bool = False) -> pb.AdmitResponse:
        return self.call("Admit", pb.AdmitRequest(job=job, dry_run=dry_run))

    def explain(self, request: pb.ExplainRequest) -> pb.ExplainResponse:
        return self.call("Explain", request)


def configured_client(cfg, address: str, deadline_s: float, token: str | None = None) -> PolicyClient:
    """A client as ``cfg`` (policy_service.config.Config) says: TLS from ``[tls]`` (a bad file
    raises ConfigError), a MUNGE credential per call where ``[auth] munge`` says so (auto: where
    libmunge and munged's socket exist; on: always, a failure to make one is logged per call)."""
    from policy_service.tls import channel_credentials

    return PolicyClient(address, deadline_s, token, munge_socket=munge_socket_for(cfg.auth),
                        tls=channel_credentials(cfg.tls))


def token_refusal(cfg, address: str) -> str | None:
    """Why a client configured by ``cfg`` must not send the token to ``address`` (None: it may)."""
    from policy_service.tls import client_enabled

    return plaintext_token_error(address, client_enabled(cfg.tls))


def munge_socket_for(auth) -> str | None:
    """munged's socket where ``auth`` (policy_service.auth_config.AuthConfig) has clients attach
    credentials (auto: where libmunge and munged's socket exist; on: always), else None."""
    from policy_service.auth_config import MungeMode

    mode = auth.munge
    use_munge = mode is MungeMode.ON or (mode is MungeMode.AUTO and munge.usable(auth.munge_socket))
    return str(auth.munge_socket) if use_munge else None
