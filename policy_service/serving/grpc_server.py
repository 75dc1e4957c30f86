"""gRPC transport: a thin servicer over ``PolicyHandler`` plus the standard health service."""
from __future__ import annotations

import errno
import hmac
import logging
import socket
import time
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service._generated.swapaware.v1 import policy_pb2_grpc
from policy_service.trust.access import AccessUnavailable, Authorizer
from policy_service.trust.authz import credential_verdict
from policy_service.serving.client import METHODS, SERVICE, message_types, method_path
from policy_service.serving.handler import Method, PolicyHandler
from policy_service.serving.handler_error import HandlerError
from policy_service.config import split_host_port
from policy_service.trust.limits import MAX_REQUEST_BYTES, oversize

log = logging.getLogger(__name__)


# Events feed the model. With an Authorizer (the service always has one) the caller is identified
# (MUNGE credential, the hooks' token) and policy_service.trust.authz decides; without one, the old rule:
# with a token configured, only callers that hold it may send events.


def authorized(metadata, token: str | None) -> bool:
    if token is None:
        return True
    expected = f"Bearer {token}".encode()
    return any(k == "authorization" and hmac.compare_digest(str(v).encode(), expected) for k, v in metadata or ())


@dataclass(frozen=True)
class Received:
    """A request and its bytes as they arrived (a MUNGE credential is bound to those bytes:
    policy_service/trust/cred_binding.py)."""

    message: object
    raw: bytes


def _keeping_bytes(message_type):
    def parse(raw: bytes) -> Received:
        return Received(message_type.FromString(raw), bytes(raw))
    return parse


def event_nodes(message) -> list[str]:
    """The nodes a JobStarted / JobFinished / ReportEvents request names, leaving out events over
    the size limits (the handler refuses each of those as INVALID_ARGUMENT, and applies none)."""
    events = ([getattr(e, e.WhichOneof("event")) for e in message.events if e.WhichOneof("event")]
              if isinstance(message, pb.ReportEventsRequest) else [message])
    return [e.node for e in events if hasattr(e, "node") and not oversize(e)]


class PolicyServicer(policy_pb2_grpc.PolicyServiceServicer):
    """Each method takes a ``Received`` (register with ``add_servicer``, not the generated
    function: a bare message has no bytes to check a credential against, and fails the call)."""

    def __init__(self, handler: PolicyHandler, token: str | None = None, authorizer: Authorizer | None = None):
        self._handler = handler
        self._token = token
        self._authorizer = authorizer

    def _caller(self, method: Method, raw: bytes, context: grpc.ServicerContext, message=None):
        """Who calls, once the checks that come before the handler passed (else the call is aborted)."""
        name = method.value[0]
        if self._authorizer is None:
            if method.is_event and not authorized(context.invocation_metadata(), self._token):
                context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{name} needs the hooks' token")
            return None
        try:
            caller = self._authorizer.identify(context.invocation_metadata(), method_path(name), raw)
        except AccessUnavailable as exc:
            log.error("%s from %s: %s", name, context.peer(), exc)
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        if caller.refused:
            self._handler.metrics.credentials_refused.labels(why=caller.refused).inc()
        verdict = credential_verdict(caller)
        if verdict.allowed and method.is_event:
            verdict = self._authorizer.events(name, caller)
        if verdict.allowed and method.is_event:
            verdict = self._authorizer.event_nodes(name, caller, event_nodes(message))
        if not verdict.allowed:
            log.warning("%s from %s refused: %s", name, context.peer(), verdict.reason)
            context.abort(verdict.code, verdict.reason)
        return caller

    def _call(self, method: Method, received: Received, context: grpc.ServicerContext):
        caller = self._caller(method, received.raw, context, received.message)
        try:
            return method.call(self._handler, received.message, caller)
        except HandlerError as exc:
            context.abort(exc.code, exc.message)
        except Exception:
            log.exception("%s failed", method.value[0])
            context.abort(grpc.StatusCode.INTERNAL, f"{method.value[0]} failed inside the service; see its log")

    def Admit(self, request, context):
        t0 = time.perf_counter()
        reply = self._call(Method.ADMIT, request, context)
        self._handler.metrics.admit_by["grpc"].observe(time.perf_counter() - t0)
        return reply

    def JobStarted(self, request, context):
        return self._call(Method.JOB_STARTED, request, context)

    def JobFinished(self, request, context):
        return self._call(Method.JOB_FINISHED, request, context)

    def Explain(self, request, context):
        return self._call(Method.EXPLAIN, request, context)

    def ReportEvents(self, request, context):
        return self._call(Method.REPORT_EVENTS, request, context)


# max_receive_message_length: the same bound as the local socket's; no request of this API comes
# near it, and a larger one is refused (RESOURCE_EXHAUSTED) before it is parsed (fields within it
# have their own limits). so_reuseport: gRPC's C core sets SO_REUSEPORT on Linux by default, so
# another process of the same user could bind the port while the service runs and take part of
# its traffic (the hooks' events, their token); off, the port is the service's alone.
SERVER_OPTIONS = [("grpc.max_receive_message_length", MAX_REQUEST_BYTES), ("grpc.so_reuseport", 0)]


def port_holder(address: str) -> OSError | None:
    """Why a plain listening socket cannot bind ``address`` (host:port) now, None where it can
    (or the address is not host:port). SO_REUSEADDR as gRPC sets it: a TIME_WAIT socket is no holder."""
    try:
        host, port = split_host_port(address)
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (ValueError, OSError):
        return None
    for family, kind, proto, _, sockaddr in infos[:1]:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(sockaddr)
            except OSError as exc:
                return exc
    return None


def held_message(address: str) -> str:
    """What the log and the exit say where another process holds the port of ``address``."""
    port = address.rpartition(":")[2]
    return (f"gRPC address {address} is in use by another process (ss -ltnp 'sport = :{port}' shows which): the "
            f"service does not share its port; stop that process or change service.grpc_address")


def bind_failure(address: str, grpc_said: str) -> OSError:
    """The error for a gRPC address the service could not bind: EADDRINUSE naming the address and
    the fix where another process holds the port, EACCES naming the capability for a privileged
    port, else what the bind said."""
    held = port_holder(address)
    if held is not None and held.errno == errno.EADDRINUSE:
        return OSError(errno.EADDRINUSE, held_message(address))
    if held is not None and held.errno == errno.EACCES:
        return OSError(errno.EACCES, f"cannot bind gRPC address {address}: port {address.rpartition(':')[2]} is "
                       "privileged: run the service as root or give it CAP_NET_BIND_SERVICE (contrib/systemd/"
                       "swapaware.service: AmbientCapabilities=CAP_NET_BIND_SERVICE)")
    code = held.errno if held is not None and held.errno else errno.EADDRNOTAVAIL
    detail = held.strerror if held is not None and held.strerror else grpc_said
    return OSError(code, f"cannot bind gRPC address {address}: {detail}")


def add_servicer(servicer: PolicyServicer, server: grpc.Server) -> None:
    """``add_PolicyServiceServicer_to_server``, but each method's handler gets the request's bytes
    as they arrived beside the parsed message (``Received``)."""
    handlers = {}
    for name in METHODS:
        request, reply = message_types(name)
        handlers[name] = grpc.unary_unary_rpc_method_handler(
            getattr(servicer, name), request_deserializer=_keeping_bytes(request),
            response_serializer=reply.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


def grpc_server(handler: PolicyHandler, max_workers: int, token: str | None = None,
                authorizer: Authorizer | None = None) -> tuple[grpc.Server, health.HealthServicer]:
    """The service's gRPC server, with its servicer and the health service (whose overall status
    and PolicyService entry say NOT_SERVING until a port is bound: serving/grpc_bind.py); no port
    yet, not started."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
                         options=SERVER_OPTIONS)
    add_servicer(PolicyServicer(handler, token, authorizer), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", SERVICE):
        health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    return server, health_servicer


def add_port(server: grpc.Server, address: str, credentials: grpc.ServerCredentials | None = None) -> int:
    """Bind ``address`` ('host:0' picks a free port) on a server not yet started, over TLS with
    ``credentials``. Returns the port; OSError naming the address where it cannot be bound
    (another process holds the port: EADDRINUSE; a privileged port without the capability: EACCES)."""
    try:
        port = (server.add_secure_port(address, credentials) if credentials is not None
                else server.add_insecure_port(address))
    except RuntimeError as exc:  # what grpcio raises now; older releases returned 0
        port, failure = 0, str(exc)
    else:
        failure = "no address bound"
    if port == 0:
        raise bind_failure(address, failure)
    return port


def serving(health_servicer: health.HealthServicer) -> None:
    """The health service's overall status and PolicyService entry: SERVING (the port is bound)."""
    for name in ("", SERVICE):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)


def start_grpc(handler: PolicyHandler, address: str, max_workers: int, token: str | None = None,
               authorizer: Authorizer | None = None, credentials: grpc.ServerCredentials | None = None,
               ) -> tuple[grpc.Server, int, health.HealthServicer]:
    """Start serving on ``address`` at once (the service itself waits for a held port:
    serving/grpc_bind.py). Returns (server, port, health); OSError as ``add_port``."""
    server, health_servicer = grpc_server(handler, max_workers, token, authorizer)
    try:
        port = add_port(server, address, credentials)
    except OSError as error:
        log.error("%s", error.strerror)
        raise
    server.start()
    serving(health_servicer)
    return server, port, health_servicer
