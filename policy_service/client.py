"""gRPC client of the policy service, with a deadline on every call."""
from __future__ import annotations

import grpc

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service._generated.swapaware.v1 import policy_pb2_grpc

RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED,
             grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED}


class PolicyClient:
    def __init__(self, address: str, deadline_s: float, token: str | None = None):
        self.address, self.deadline_s = address, deadline_s
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._channel = grpc.insecure_channel(address, options=[("grpc.enable_retries", 0)])
        self._stub = policy_pb2_grpc.PolicyServiceStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "PolicyClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def call(self, method: str, request):
        """Call an RPC by its proto name ('Admit', 'JobFinished', ...)."""
        return getattr(self._stub, method)(request, timeout=self.deadline_s, metadata=self._metadata)

    def admit(self, job: pb.JobFacts, dry_run: bool = False) -> pb.AdmitResponse:
        return self.call("Admit", pb.AdmitRequest(job=job, dry_run=dry_run))

    def explain(self, request: pb.ExplainRequest) -> pb.ExplainResponse:
        return self.call("Explain", request)
