"""The service's CPU per Admit on the local socket (issue 33, item 6): utime + stime of the
`swapaware serve` process (all its threads: the socket's, the decision writer's, the admission
table's publisher) from /proc/<pid>/stat, per Admit, from one client on one kept connection, as
job_submit.lua sends them.

The service runs as its own process, exactly as deployed (a config file in a temporary directory,
its socket, a SQLite history with its decision journal, a slurm.conf and gres.conf like the dev
cluster's: two A100s and two H100s with shards, partitions gpu and gpudef). Slurm's commands are
stand-ins on the service's PATH that answer an empty queue (no cluster of this host is asked). The
history is seeded first through the handler's own Admit / JobStarted / JobFinished path, so that
most classes have observed runs and estimates.

The Admits are the facts swapaware_facts.lua sends (every field, brief, the plugin's counters),
of a pool of classes in the request shapes of 24.11 (gres/gpu:1, typed, --gpus, two GPUs, shards,
--gpus-per-task): ``--new`` of them a class never seen before (a new script), the others drawn
from the seeded classes and the classes already admitted in this run.

``--src DIR`` (repeatable) runs one service per source tree (default: this checkout), in
interleaved rounds of ``--calls`` Admits each, so that trees are compared in the same run:

    .venv/bin/python bench/admit_cpu.py --base HEAD~1        # HEAD~1 (git archive) against the checkout
    .venv/bin/python bench/admit_cpu.py --profile            # + where an Admit's CPU goes (cProfile)

``--table`` publishes the admission table (the dev stack's default; the publisher's CPU is the
service's too). ``--profile`` runs the same Admits in this process through the local socket's
handle_line (JSON in, handler, JSON out) under cProfile and prints the top functions, then the
decision writer's cost per decision (journal record -> SQLite).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

# The parts, beside this script: admit_cpu_work.py (the files, the Admits, the seeded history),
# admit_cpu_service.py (a service process and its CPU per Admit), admit_cpu_profile.py (--profile).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from admit_cpu_profile import profile  # noqa: E402
from admit_cpu_service import ROOT, Service, idle, measure, tree_of  # noqa: E402
from admit_cpu_work import Classes, admit_line, seed_history  # noqa: E402


# ----------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=1500, help="Admits per service per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pool", type=int, default=400, help="classes in the seeded pool")
    ap.add_argument("--warm", type=int, default=300,
                    help="Admits sent before the rounds, not counted (the pool's classes first seen there: "
                         "--new 0 --warm 2000 measures repeats alone)")
    ap.add_argument("--new", type=float, default=0.15, help="fraction of Admits of a class never seen")
    ap.add_argument("--src", action="append", default=[], help="a source tree to run (repeatable)")
    ap.add_argument("--base", action="append", default=[], help="a git revision to run (repeatable)")
    ap.add_argument("--table", action="store_true", help="publish the admission table")
    ap.add_argument("--profile", action="store_true", help="profile Admit in process (cProfile)")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--check", action="store_true",
                    help="check that every service gave the same decisions (apart from their ids)")
    args = ap.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="swapaware-admit-cpu-"))
    t0 = time.time()
    history = seed_history(workdir, args.pool)
    print(f"history seeded in {time.time() - t0:.0f} s ({args.pool} classes, 3 in 4 with 1-4 observed runs)")
    trees = [(str(rev), tree_of(rev, workdir)) for rev in args.base]
    trees += [(src, Path(src).resolve()) for src in args.src]
    if not trees or not args.src:
        trees.append(("checkout", ROOT))
    services = []
    try:
        for name, src in trees:
            services.append(Service(name, src, workdir, history, args.table))
        gen = Classes(2, args.pool, args.new)
        warm = [admit_line(gen.next()) for _ in range(args.warm)]
        rounds = [[admit_line(gen.next()) for _ in range(args.calls)] for _ in range(args.rounds)]
        for svc in services:
            svc.admit(warm, keep=args.check)
        time.sleep(1.0)
        idle_rate = {svc.name: idle(svc, 2.0) for svc in services}
        cpu: dict[str, list[float]] = {svc.name: [] for svc in services}
        conn: dict[str, list[float]] = {svc.name: [] for svc in services}
        for r, lines in enumerate(rounds):
            order = services if r % 2 == 0 else services[::-1]  # interleaved, each first in turn
            for svc in order:
                total, busiest = measure(svc, lines)
                cpu[svc.name].append(total)
                conn[svc.name].append(busiest)
            print(f"round {r + 1}: " + "  ".join(f"{n} {v[-1]:6.0f} ({conn[n][-1]:4.0f} in the connection's thread)"
                                              for n, v in cpu.items()), flush=True)
        if args.check:
            for svc in services:
                svc.admit([line for lines in rounds[:1] for line in lines], keep=True)
        print(f"\nservice CPU per Admit (utime+stime of its pid, us; {args.calls} Admits per round, "
              f"{args.rounds} rounds, {args.new:.0%} new classes, table {'on' if args.table else 'off'}):")
        for svc in services:
            v = cpu[svc.name]
            print(f"  {svc.name:24s} median {statistics.median(v):6.0f}  min {min(v):6.0f}  max {max(v):6.0f}  "
                  f"(the connection's thread: median {statistics.median(conn[svc.name]):4.0f}; "
                  f"idle: {idle_rate[svc.name]:.0f} us/s)")
        first = services[0].name
        for svc in services[1:]:  # per round, against the first tree: load that comes and goes cancels
            ratios = [b / a for a, b in zip(cpu[first], cpu[svc.name]) if a > 0]
            if ratios:
                print(f"  {svc.name} / {first}, per round: median {statistics.median(ratios):.2f}  "
                      f"(min {min(ratios):.2f}, max {max(ratios):.2f})")
    finally:
        for svc in services:
            svc.stop()
    if args.check and len(services) > 1:
        check(services)
    if args.profile:
        gen = Classes(3, args.pool, args.new)
        profile(workdir, history, [admit_line(gen.next()) for _ in range(300 + args.calls)], args.table, args.top)
    print(f"(machine: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; files in {workdir})")


def check(services: list[Service]) -> None:
    """The same decisions from every service, reply by reply, ids aside."""
    import re

    def plain(reply: bytes) -> str:
        return re.sub(r'(decisionId":"|id=)[0-9a-f]{16}', r"\1-", reply.decode())

    first = [plain(r) for r in services[0].replies]
    for svc in services[1:]:
        other = [plain(r) for r in svc.replies]
        diff = sum(a != b for a, b in zip(first, other)) + abs(len(first) - len(other))
        print(f"  replies of {svc.name} against {services[0].name}: {len(other)} compared, {diff} differ")
    first = history_rows(services[0].dir / "history.sqlite3")
    for svc in services[1:]:
        other = history_rows(svc.dir / "history.sqlite3")
        diff = sum(a != b for a, b in zip(first, other)) + abs(len(first) - len(other))
        print(f"  history rows of {svc.name} against {services[0].name}: {len(other)} compared, {diff} differ")


def history_rows(db: Path) -> list[tuple]:
    """Every decision row and class statistics row, in the order recorded, ids and times aside
    (the decision's own message included: its id, time and the AdminComment's id blanked)."""
    import re
    import sqlite3

    from policy_service._generated.swapaware.v1 import policy_pb2 as pb

    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    out = []
    for row in con.execute("SELECT job_class, user, account, partition, job_name, action, shards, model_version, "
                           "keys_json, facts_pb, decision_pb FROM decisions ORDER BY rowid"):
        d = pb.Decision.FromString(row[-1])
        d.decision_id, d.decided_at = "", 0.0
        d.rewrite.admin_comment = re.sub(r"id=[0-9a-f]{16}", "id=-", d.rewrite.admin_comment)
        out.append(row[:-1] + (d.SerializeToString(deterministic=True),))
    out += con.execute("SELECT level, key, stats_json FROM class_stats ORDER BY level, key").fetchall()
    con.close()
    return out


if __name__ == "__main__":
    main()
