"""bench/admit_cpu.py --profile: the same Admits in this process through the local socket's
handle_line (JSON in, handler, JSON out), timed plain, under a CPU-time sampler (SIGPROF) and under
cProfile, then the decision writer's cost per decision (journal record -> SQLite)."""
from __future__ import annotations

import cProfile
import io
import pstats
import time
from pathlib import Path

from admit_cpu_work import in_process_service

# ----------------------------------------------------------------------------- in-process profile
SAMPLE_S = 0.0005


class Samples:
    def __init__(self):
        import collections
        self.inclusive: collections.Counter = collections.Counter()
        self.own: collections.Counter = collections.Counter()
        self.total = 0


def sample(work) -> Samples:
    """Run ``work`` in this (the main) thread under a CPU-time sampler: SIGPROF every SAMPLE_S of
    the process's CPU, its handler counting the stack it interrupts (a C call counts in the Python
    function that made it). No tracing: the functions run at their own speed."""
    import signal

    out = Samples()

    def where(code) -> str:
        return f"{Path(code.co_filename).name}:{code.co_name}"

    def on_prof(_signum, frame) -> None:
        if frame is None:
            return
        out.total += 1
        out.own[where(frame.f_code)] += 1
        seen = set()
        while frame is not None:
            name = where(frame.f_code)
            if name not in seen:
                seen.add(name)
                out.inclusive[name] += 1
            frame = frame.f_back

    old = signal.signal(signal.SIGPROF, on_prof)
    signal.setitimer(signal.ITIMER_PROF, SAMPLE_S, SAMPLE_S)
    try:
        work()
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0, 0)
        signal.signal(signal.SIGPROF, old)
    return out


def profile(workdir: Path, history: Path, lines: list[bytes], table: bool, top: int) -> None:
    from policy_service.serving.local_socket import handle_line

    svc = in_process_service(workdir / "profile", history, table)
    try:
        h = svc.handler
        warm, run = lines[:300], lines[300:]
        for line in warm:
            handle_line(h, line, 0, 0)
        h.flush()
        t0 = time.process_time()
        for line in warm:
            handle_line(h, line, 0, 0)
        plain = time.process_time() - t0
        h.flush()
        print(f"\n== handle_line in process, no profiler: {1e6 * plain / len(warm):.0f} us CPU per Admit "
              f"(the decision writer's part aside) ==")
        sampled = sample(lambda: [handle_line(h, line, 0, 0) for line in run])
        h.flush()
        print(f"\n== handle_line in process, sampled every {SAMPLE_S * 1e3:.1f} ms of CPU (SIGPROF, no tracing): "
              f"{sampled.total} samples; inclusive share of the top {top} functions ==")
        for name, n in sampled.inclusive.most_common(top):
            print(f"  {100 * n / sampled.total:5.1f}%  {name}")
        print("== the same, own share (the Python function on top of the stack: its C calls included) ==")
        for name, n in sampled.own.most_common(top):
            print(f"  {100 * n / sampled.total:5.1f}%  {name}")
        prof = cProfile.Profile()
        t0 = time.process_time()
        prof.enable()
        for line in run:
            handle_line(h, line, 0, 0)
        prof.disable()
        spent = time.process_time() - t0
        h.flush()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(top)
        print(f"\n== handle_line in process under cProfile: {len(run)} Admits, {1e6 * spent / len(run):.0f} us "
              f"CPU each with the profiler's overhead; top {top} by own time ==")
        print("\n".join(s.getvalue().splitlines()[6:]))
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(top)
        print("== the same, by cumulative time ==")
        print("\n".join(s.getvalue().splitlines()[6:]))
        # the decision writer: records as Admit journals them, put into the history in batches
        for line in run[:1000]:
            handle_line(h, line, 0, 0)
        recs = list(h.decisions.records())
        h.flush()
        if recs:
            t0 = time.process_time()
            for i in range(0, len(recs), 256):
                svc.store.record(recs[i:i + 256])
            spent = time.process_time() - t0
            print(f"== the writer: {1e6 * spent / len(recs):.0f} us CPU per decision into SQLite "
                  f"({len(recs)} decisions in batches of 256) ==")
    finally:
        svc.stop(0)
