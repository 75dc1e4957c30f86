"""The cyclic garbage collector's part of the service's Admit CPU, and its longest pause: a full
(generation 2) collection holds the GIL, and the Admit thread waits meanwhile, slurmctld holding
its job lock. Each variant runs in a process of its own (the collector is per process), the same
Admits in the same order (bench/admit_cpu_work.py: the seeded history, 15 % new classes), through
the local socket's handle_line in process:

    plain    the service as started (before settle_gc)
    settled  server.settle_gc() once the service has started (what `swapaware serve` does)

Printed per run: CPU us per Admit, the collector's share of it (gc.callbacks around each
collection), full collections, the longest one (CPU ms, and the objects it walked: generation 2
as it started, a figure the machine's load cannot move) and the objects tracked at the end.

    .venv/bin/python bench/gc_pause.py --admits 20000 --repeats 2
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def one(variant: str, admits: int, new: float) -> dict:
    """Runs in the child: the Admits, measured."""
    import gc

    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(ROOT))
    from admit_cpu_work import Classes, admit_line, in_process_service, seed_history
    from policy_service.serving.local_socket import handle_line
    from policy_service.serving.server import settle_gc

    workdir = Path(tempfile.mkdtemp(prefix="swapaware-gc-pause-"))
    try:
        svc = in_process_service(workdir / "svc", seed_history(workdir, 400))
        try:
            if variant == "settled":
                settle_gc()
            gen = Classes(2, 400, new)
            lines = [admit_line(gen.next()) for _ in range(admits)]
            full = {"n": 0, "longest_ms": 0.0, "walked": 0}
            spent, started = [0.0], [0.0, 0]

            def on_gc(phase: str, info: dict) -> None:
                if phase == "start":
                    started[1] = len(gc.get_objects(generation=2)) if info["generation"] == 2 else 0
                    started[0] = time.process_time()
                    return
                dt = time.process_time() - started[0]
                spent[0] += dt
                if info["generation"] == 2:
                    full["n"] += 1
                    if dt * 1e3 > full["longest_ms"]:
                        full["longest_ms"], full["walked"] = dt * 1e3, started[1]

            gc.callbacks.append(on_gc)
            t0 = time.process_time()
            for line in lines:
                handle_line(svc.handler, line, 0, 0)
            total = time.process_time() - t0
            gc.callbacks.remove(on_gc)
            svc.handler.flush()
            return {"us_per_admit": 1e6 * total / admits, "gc_share": spent[0] / total, "full": full["n"],
                    "longest_ms": full["longest_ms"], "walked": full["walked"], "tracked": len(gc.get_objects())}
        finally:
            svc.stop(0)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--admits", type=int, default=20000)
    ap.add_argument("--new", type=float, default=0.15, help="fraction of Admits of a class never seen")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each variant, interleaved")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(one(args.child, args.admits, args.new)))
        return
    print(f"{args.admits} Admits per run, {args.new:.0%} new classes, in process (handle_line)")
    for r in range(args.repeats):
        for variant in (("plain", "settled") if r % 2 == 0 else ("settled", "plain")):
            out = subprocess.run([sys.executable, __file__, "--child", variant, "--admits", str(args.admits),
                                  "--new", str(args.new)], capture_output=True, text=True, cwd=ROOT)
            if out.returncode != 0:
                sys.exit(f"{variant}: {out.stderr[-2000:]}")
            m = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"run {r + 1} {variant:8s}: {m['us_per_admit']:6.0f} us/Admit, collector {100 * m['gc_share']:4.1f} %, "
                  f"{m['full']} full collection(s), the longest {m['longest_ms']:5.0f} ms walking {m['walked']:7d} "
                  f"objects; {m['tracked']} tracked at the end", flush=True)


if __name__ == "__main__":
    main()
