"""The node agent's Unix socket server: ``AgentServer`` listens on ``agent.socket_path`` (mode
0600), answers each connection's one request line through an ``Agent`` and runs its sampling
thread (the protocol is in ``slurm_plugin.agent.protocol``).
"""
from __future__ import annotations

import contextlib
import logging
import socket
import socketserver
import threading
from pathlib import Path

from policy_service.atomic_file import listening_unix_server
from slurm_plugin.agent.protocol import MAX_REQUEST_BYTES
from slurm_plugin.agent.sampler import Agent

log = logging.getLogger("swapaware.agent")

CONNECTION_TIMEOUT_S = 5.0


class _Handler(socketserver.StreamRequestHandler):
    server: "_UnixServer"

    def handle(self) -> None:
        self.connection.settimeout(CONNECTION_TIMEOUT_S)
        try:
            line = self.rfile.readline(MAX_REQUEST_BYTES + 1)
        except OSError:
            return
        if len(line) > MAX_REQUEST_BYTES:
            reply = b'{"ok":false,"error":"request too long"}\n'
        else:
            reply = self.server.agent.handle_line(line)
        with contextlib.suppress(OSError):
            self.wfile.write(reply)
            self.wfile.flush()


class _UnixServer(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True
    block_on_close = False
    agent: Agent


def _prepare_socket_path(path: Path) -> None:
    """Create the parent directory; remove a stale socket, refuse if another agent listens."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() and not path.is_symlink():
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(0.5)
    try:
        probe.connect(str(path))
    except OSError:
        path.unlink()
        return
    finally:
        probe.close()
    raise RuntimeError(f"another agent is listening on {path}")


class AgentServer:
    """The socket and the sampling thread around an ``Agent``."""

    def __init__(self, agent: Agent, socket_path: Path) -> None:
        self.agent = agent
        self.socket_path = Path(socket_path)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._server: _UnixServer | None = None

    def start(self) -> None:
        _prepare_socket_path(self.socket_path)
        # the path appears once the socket listens: a hook connecting in between is never refused
        self._server = listening_unix_server(lambda address: _UnixServer(address, _Handler), self.socket_path, 0o600)
        self._server.agent = self.agent
        self._threads = [
            threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2}, name="agent-socket",
                             daemon=True),
            threading.Thread(target=self.agent.run_sampler, args=(self._stop,), name="agent-sampler", daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        log.info("listening on %s, sampling every %.3f s from %s", self.socket_path,
                 self.agent.cfg.sample_period_s, self.agent.source)

    def stop(self) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        for thread in self._threads:
            thread.join(timeout=5)
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        self.agent.close()

    def __enter__(self) -> "AgentServer":
        self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()
