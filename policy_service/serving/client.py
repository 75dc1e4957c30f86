"""gRPC client of the policy service, with a deadline on every call; optionally TLS, the hooks'
token and a fresh MUNGE credential on every call (a credential decodes once: munged keeps a
replay cache), bound to that call's method and request (policy_service/trust/cred_binding.py).

Every gRPC client of the project (hooks, node agent, ``swapaware explain``, ``replay-spool``)
calls through ``PolicyClient.call``: it serialises the request once, makes the credential for
those bytes and sends those bytes."""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable, Sequence

import grpc

from policy_service.trust import cred_binding, munge
from policy_service.trust.munge import MUNGE_METADATA  # the service reads a credential here (trust/access.py)
from policy_service.trust.auth_config import plaintext_token_error
from policy_service.config import ConfigError

from policy_service._generated.swapaware.v1 import policy_pb2 as pb

log = logging.getLogger("swapaware.client")
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
        (None: none); ``tls``: channel credentials (``policy_service.trust.tls.channel_credentials``).
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

    def call(self, method: str, request, timeout_s: float | None = None):
        """Call an RPC by its proto name ('Admit', 'JobFinished', ...); ``timeout_s``: this call's
        deadline (default: the client's)."""
        raw = serialised(request)
        return self._calls[method](raw, timeout=self.deadline_s if timeout_s is None else timeout_s,
                                   metadata=self.metadata(method_path(method), raw))

    def admit(self, job: pb.JobFacts, dry_run: bool = False) -> pb.AdmitResponse:
        return self.call("Admit", pb.AdmitRequest(job=job, dry_run=dry_run))

    def explain(self, request: pb.ExplainRequest) -> pb.ExplainResponse:
        return self.call("Explain", request)


# A service that cannot take the call now: the next address may (a standby answers UNAVAILABLE
# "standby: writer is <h>"; a connect error is UNAVAILABLE too). Events carry ids: one applied by a
# service whose answer came too late is not applied again by the next.
MOVE_ON = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}


def attempt_order(addresses: Sequence[str], last_good: str | None) -> list[str]:
    """The addresses in the order to try: the one that answered last first, then the others."""
    order = list(dict.fromkeys(addresses))
    if last_good in order:
        order.remove(last_good)
        order.insert(0, last_good)
    return order


def attempt_timeout(left_s: float, remaining: int) -> float:
    """One attempt's deadline: an equal share of what is left among the addresses still to try."""
    return left_s / max(1, remaining)


class FailoverClient:
    """``PolicyClient``'s ``call`` over several services (two controllers: docs/ha.md): the one
    that answered last first, the next on UNAVAILABLE or a passed deadline, all within one
    deadline; the last error is raised when none took the call. ``remember``: a file keeping the
    address that answered across processes (the hooks); None: this process only."""

    def __init__(self, make: Callable[[str], PolicyClient], addresses: Sequence[str], deadline_s: float,
                 remember: Path | None = None, clock: Callable[[], float] = time.monotonic):
        if not addresses:
            raise ValueError("no service address")
        self.addresses, self.deadline_s, self.remember, self.clock = tuple(addresses), deadline_s, remember, clock
        self._make = make
        self._clients: dict[str, PolicyClient] = {}
        self.last_good: str | None = self._recall()
        self.address = self.last_good or self.addresses[0]

    def _recall(self) -> str | None:
        if self.remember is None:
            return None
        try:
            text = self.remember.read_text().strip()
        except (OSError, UnicodeDecodeError):
            return None
        return text if text in self.addresses else None

    def _keep(self, address: str) -> None:
        if address == self.last_good:
            return
        self.last_good = self.address = address
        if self.remember is not None:
            try:
                self.remember.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                tmp = self.remember.with_name(f".{self.remember.name}.tmp")
                tmp.write_text(address + "\n")
                tmp.replace(self.remember)
            except OSError as exc:
                log.debug("cannot keep the answering service in %s: %s", self.remember, exc)

    def client(self, address: str) -> PolicyClient:
        if address not in self._clients:
            self._clients[address] = self._make(address)
        return self._clients[address]

    def call(self, method: str, request):
        end = self.clock() + self.deadline_s
        order = attempt_order(self.addresses, self.last_good)
        last: grpc.RpcError | None = None
        for i, address in enumerate(order):
            left = end - self.clock()
            if left <= 0:
                break
            try:
                reply = self.client(address).call(method, request, timeout_s=attempt_timeout(left, len(order) - i))
            except grpc.RpcError as exc:
                code = exc.code() if hasattr(exc, "code") else None
                if code not in MOVE_ON:
                    raise
                log.info("%s: %s at %s (%s); trying the next service", method, code.name, address,
                         exc.details() if hasattr(exc, "details") else exc)
                last = exc
                continue
            self._keep(address)
            return reply
        if last is None:  # the deadline passed before any try
            raise TimeoutError(f"{method}: no time left to reach {', '.join(order)}")
        raise last

    def admit(self, job: pb.JobFacts, dry_run: bool = False) -> pb.AdmitResponse:
        return self.call("Admit", pb.AdmitRequest(job=job, dry_run=dry_run))

    def explain(self, request: pb.ExplainRequest) -> pb.ExplainResponse:
        return self.call("Explain", request)

    def close(self) -> None:
        for c in self._clients.values():
            c.close()
        self._clients.clear()

    def __enter__(self) -> "FailoverClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def configured_client(cfg, address: str, deadline_s: float, token: str | None = None) -> PolicyClient:
    """A client as ``cfg`` (policy_service.config.Config) says: TLS from ``[tls]`` (a bad file
    raises ConfigError), a MUNGE credential per call where ``[auth] munge`` says so (auto: where
    libmunge and munged's socket exist; on: always, a failure to make one is logged per call)."""
    from policy_service.trust.tls import channel_credentials

    return PolicyClient(address, deadline_s, token, munge_socket=munge_socket_for(cfg.auth),
                        tls=channel_credentials(cfg.tls))


def token_refusal(cfg, address: str) -> str | None:
    """Why a client configured by ``cfg`` must not send the token to ``address`` (None: it may)."""
    from policy_service.trust.tls import client_enabled

    return plaintext_token_error(address, client_enabled(cfg.tls))


def munge_socket_for(auth) -> str | None:
    """munged's socket where ``auth`` (policy_service.trust.auth_config.AuthConfig) has clients attach
    credentials (auto: where libmunge and munged's socket exist; on: always), else None."""
    from policy_service.trust.auth_config import MungeMode

    mode = auth.munge
    use_munge = mode is MungeMode.ON or (mode is MungeMode.AUTO and munge.usable(auth.munge_socket))
    return str(auth.munge_socket) if use_munge else None
