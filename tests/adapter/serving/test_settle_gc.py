"""server.settle_gc: what a started service holds is moved out of the cyclic collector's reach,
so that a full collection walks only what was made since (bench/gc_pause.py measures the pause)."""
from __future__ import annotations

import subprocess
import sys
import textwrap


def test_a_started_service_s_objects_are_frozen_and_what_is_made_later_is_collected() -> None:
    # a process of its own: the collector's generations are per process, and pytest's are not a service's
    code = textwrap.dedent("""
        import gc
        from policy_service.serving.server import settle_gc

        class Cycle:
            pass

        held = [object() for _ in range(1000)]  # a started service's state, tracked
        walked_before = len(gc.get_objects())
        settle_gc()
        frozen, walked_after = gc.get_freeze_count(), len(gc.get_objects())
        a, b = Cycle(), Cycle()  # garbage made later, in a cycle: still the collector's
        a.other, b.other = b, a
        del a, b
        found = gc.collect()
        print(walked_before, frozen, walked_after, found)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    walked_before, frozen, walked_after, found = map(int, out.stdout.split())
    # the modules' objects and what was held (the rest was garbage, collected first)
    assert walked_before > 1000 and frozen >= 0.9 * walked_before
    assert walked_after < 100  # what a full collection walks now: what the call itself made
    assert found >= 2  # the later cycle was collected
