"""A Unix socket that appears under its path only once it listens, with its mode
(policy_service/atomic_file.listening_unix_server: the agent's socket and the service's local one)."""
from __future__ import annotations

import socket
import socketserver
import stat

import pytest

from policy_service.atomic_file import listening_unix_server


class Echo(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        self.wfile.write(self.rfile.readline())


def test_the_path_appears_only_once_the_socket_listens_with_its_mode(tmp_path):
    path = tmp_path / "s.sock"
    seen_at_bind = []

    def make(address: str) -> socketserver.UnixStreamServer:
        seen_at_bind.append((address, path.exists()))
        server = socketserver.UnixStreamServer(address, Echo)
        seen_at_bind.append(("listening", path.exists()))
        return server

    server = listening_unix_server(make, path, 0o660)
    try:
        assert seen_at_bind[0][0] != str(path) and seen_at_bind == [(seen_at_bind[0][0], False), ("listening", False)]
        assert stat.S_ISSOCK(path.stat().st_mode) and stat.S_IMODE(path.stat().st_mode) == 0o660
        assert [p.name for p in tmp_path.iterdir()] == ["s.sock"]  # the temporary name is gone
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:  # queued by listen() before any accept
            c.settimeout(5)
            c.connect(str(path))
            c.sendall(b"hello\n")
            server.handle_request()
            assert c.recv(16) == b"hello\n"
    finally:
        server.server_close()


def test_a_failed_bind_leaves_nothing_behind(tmp_path):
    path = tmp_path / "s.sock"

    def make(address: str):
        open(address, "w").close()  # as if bound, then failing
        raise OSError("address in use")

    with pytest.raises(OSError, match="address in use"):
        listening_unix_server(make, path, 0o600)
    assert list(tmp_path.iterdir()) == []
