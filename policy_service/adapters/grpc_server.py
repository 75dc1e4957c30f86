"""gRPC transport: a thin servicer over ``PolicyHandler`` plus the standard health service."""
from __future__ import annotations

import logging
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from policy_service._generated.swapaware.v1 import policy_pb2_grpc
from policy_service.handler import HandlerError, Method, PolicyHandler

log = logging.getLogger(__name__)
SERVICE_NAME = "swapaware.v1.PolicyService"


class PolicyServicer(policy_pb2_grpc.PolicyServiceServicer):
    def __init__(self, handler: PolicyHandler):
        self._handler = handler

    def _call(self, method: Method, request, context: grpc.ServicerContext):
        try:
            return method.call(self._handler, request)
        except HandlerError as exc:
            context.abort(exc.code, exc.message)
        except Exception:
            log.exception("%s failed", method.value[0])
            context.abort(grpc.StatusCode.INTERNAL, f"{method.value[0]} failed inside the service; see its log")

    def Admit(self, request, context):
        return self._call(Method.ADMIT, request, context)

    def JobStarted(self, request, context):
        return self._call(Method.JOB_STARTED, request, context)

    def JobFinished(self, request, context):
        return self._call(Method.JOB_FINISHED, request, context)

    def Explain(self, request, context):
        return self._call(Method.EXPLAIN, request, context)


def start_grpc(handler: PolicyHandler, address: str, max_workers: int) -> tuple[grpc.Server, int, health.HealthServicer]:
    """Start serving on ``address`` ('host:0' picks a free port). Returns (server, port, health)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"))
    policy_pb2_grpc.add_PolicyServiceServicer_to_server(PolicyServicer(handler), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind gRPC address {address}")
    server.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, port, health_servicer
