"""The one error every PolicyHandler path raises: a gRPC status code and a message (the transports
map it: gRPC's status, the local socket's error line)."""
from __future__ import annotations

import grpc


class HandlerError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message

