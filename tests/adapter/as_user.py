"""Run a bit of test code as another user: a forked child drops to ``uid``/``gid`` and sends back
what ``fn`` returned (JSON), or the exception it raised. Needs root. The child does only plain
socket / libmunge work and leaves with ``os._exit``: nothing of the parent's gRPC or pytest state
runs there."""
from __future__ import annotations

import json
import os
import pwd
import select
import signal
import time
from typing import Any, Callable

try:
    NOBODY = pwd.getpwnam("nobody").pw_uid  # its group: the same number on Debian (nogroup)
except KeyError:
    NOBODY = 65534


class ChildError(Exception):
    pass


def run_as(uid: int, gid: int, fn: Callable[[], Any], timeout_s: float = 10.0) -> Any:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        code = 0
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            out = {"ok": fn()}
        except BaseException as exc:  # noqa: BLE001: reported to the parent
            out = {"error": f"{type(exc).__name__}: {exc}"}
        try:
            os.write(w, json.dumps(out).encode())
        except BaseException:  # noqa: BLE001
            code = 1
        os._exit(code)
    os.close(w)
    chunks, deadline = [], time.monotonic() + timeout_s
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                os.kill(pid, signal.SIGKILL)
                raise TimeoutError(f"child as uid {uid} gave no answer within {timeout_s}s")
            ready, _, _ = select.select([r], [], [], left)
            if ready:
                data = os.read(r, 65536)
                if not data:
                    break
                chunks.append(data)
    finally:
        os.close(r)
        os.waitpid(pid, 0)  # it has closed its end (exited) or was killed: returns at once
    out = json.loads(b"".join(chunks) or b'{"error": "the child died without an answer"}')
    if "error" in out:
        raise ChildError(out["error"])
    return out["ok"]
