"""A relay in front of a real server's Unix socket, listening on a Unix socket (a path) or on TCP
(``(host, port)``, port 0: any), that cuts one connection off the way a network cut does, while
the others and new ones go on.

``hold(marker)``: the next connection whose client sends bytes containing ``marker`` stops in both
directions from those bytes on: they are kept, not sent, and nothing the server sends (an answer,
its end of the connection) reaches the client, as with a host whose link is down. ``release()``
lets the held bytes and the server's answers through, as a link that comes back does.
"""
from __future__ import annotations

import socket
import threading
from pathlib import Path


class Relay:
    def __init__(self, listen: "Path | tuple[str, int]", target: str):
        self.target = target
        self.held: list[_Link] = []
        self._marker: bytes | None = None
        self._mutex = threading.Lock()
        self._links: list[_Link] = []
        tcp = isinstance(listen, tuple)
        self._listener = socket.socket(socket.AF_INET if tcp else socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(listen if tcp else str(listen))
        self.path = "" if tcp else str(listen)
        self.port = self._listener.getsockname()[1] if tcp else 0
        self._listener.listen(16)
        threading.Thread(target=self._accept, name="relay-accept", daemon=True).start()

    def hold(self, marker: bytes) -> None:
        with self._mutex:
            self._marker = marker

    def release(self) -> None:
        with self._mutex:
            held, self.held = self.held, []
        for link in held:
            link.flowing.set()

    def close(self) -> None:
        self.release()
        self._listener.close()
        for link in list(self._links):
            link.end()

    def _takes_hold(self, link: "_Link", data: bytes) -> bool:
        with self._mutex:
            if self._marker is None or self._marker not in data:
                return False
            self._marker = None
            self.held.append(link)
            return True

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self._links.append(_Link(self, client))


class _Link:
    def __init__(self, relay: Relay, client: socket.socket):
        self.relay, self.client = relay, client
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.connect(relay.target)
        self.flowing = threading.Event()
        self.flowing.set()
        for src, dst, up in ((client, self.server, True), (self.server, client, False)):
            threading.Thread(target=self._pump, args=(src, dst, up), name="relay-pump", daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, up: bool) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if up and self.relay._takes_hold(self, data):
                    self.flowing.clear()
                self.flowing.wait()
                dst.sendall(data)
        except OSError:
            pass
        self.flowing.wait()  # a held link's end, too, waits for the link to come back
        self.end()

    def end(self) -> None:
        for sock in (self.client, self.server):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
