"""Serving the policy: the request handler, gRPC server and local socket, JSON codec, client,
events, correlation, metrics and the service's start."""
