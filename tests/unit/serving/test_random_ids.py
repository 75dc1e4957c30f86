"""Decision ids read from os.urandom in batches (handler.RandomIds): 16 hex digits each, never
handed out twice, in threads or in a forked child."""
from __future__ import annotations

import os
import re
import threading

from policy_service.serving.handler import RandomIds


def test_ids_are_16_hex_digits_and_distinct_across_batches_and_threads():
    ids = RandomIds(batch=7)
    got: list[str] = []

    def take():
        got.extend(ids() for _ in range(500))

    threads = [threading.Thread(target=take) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 2000 and len(set(got)) == 2000
    assert all(re.fullmatch(r"[0-9a-f]{16}", i) for i in got)


def test_a_forked_child_does_not_hand_out_the_parents_next_ids():
    ids = RandomIds(batch=64)
    ids()  # a batch read: 63 left
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next ids, to the parent
        os.close(r)
        os.write(w, "".join(ids() for _ in range(10)).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        child = f.read().decode()
    os.waitpid(pid, 0)
    parent = "".join(ids() for _ in range(10))
    assert len(child) == 160 and child != parent
    assert not {child[i:i + 16] for i in range(0, 160, 16)} & {parent[i:i + 16] for i in range(0, 160, 16)}
