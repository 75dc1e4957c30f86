"""The service's CPU per table-made decision it catches up (issue 33: controller CPU with the
table): what recording a decision the job_submit plugin made from the table costs the service once
a queue poll shows its job (admission/catchup.py: the template filled in, journaled, committed to
the history by the writer thread, counted), and what a poll that finds nothing new costs per job
it reads.

Each source tree runs in a process of its own (a worker: this script with --worker, the tree on
PYTHONPATH), on the real pieces: a SQLite history, the archive beside it, the DecisionLog with its
journal and writer thread, the service's metrics. Its Slurm is a list of jobs, as
CliSlurm.live_commented_jobs returns them. The collector is frozen after the set-up, as the service
does (serving/server.settle_gc). CPU is utime + stime of the worker's own process (every thread,
the writer's too), from getrusage.

Trees are compared in interleaved rounds, one worker per tree per round, so that the machine's
other load hits each alike:

    .venv/bin/python bench/catchup_cpu.py --base HEAD~1            # HEAD~1 against this checkout
    .venv/bin/python bench/catchup_cpu.py --jobs 3000 --rounds 6
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from admit_cpu_service import ROOT, tree_of  # noqa: E402


def worker(jobs: int, workdir: Path) -> dict:
    """One round in this process: ``jobs`` new table-made decisions caught up from one poll, then
    the same poll again (nothing new). CPU per job of each."""
    import gc
    import resource

    from policy_service._generated.swapaware.v1 import policy_pb2 as pb
    from policy_service.admission.archive import TableArchive, archive_path
    from policy_service.admission.catchup import AdmissionCatchup
    from policy_service.core.admission import PLACEHOLDER_ID, TableRef
    from policy_service.history.decision_log import DecisionLog
    try:
        from policy_service.history.journal_records import DecisionRecord
    except ImportError:  # a tree from before the journal's records had a module of their own
        from policy_service.history.decision_log import DecisionRecord
    from policy_service.history.store import HistoryStore
    from policy_service.serving.metrics import ServiceMetrics
    from policy_service.slurm.slurm_comments import CommentedJob

    db = workdir / "history.sqlite3"
    store = HistoryStore(db, accept_empty=True)
    archive = TableArchive(archive_path(str(db)))
    version, ref = "0123456789abcdef", TableRef("0123456789abcdef", 7, "*")
    comment = f"swapaware:v1 id={PLACEHOLDER_ID} {ref.token} model=swapaware-model/1 action=share shards=2 " \
              "pred=9.0GiB+1.0GiB src=class n=12 sf=3 why=fits_shards,priority_contention"
    reasons = [pb.Reason(code=c, message=f"{c}: the reason's text as the handler writes it, about this long")
               for c in ("fits_shards", "priority_contention")]
    tpl_facts = pb.JobFacts(user="alice", uid=1000, account="proj", partition="gpu", job_name="train",
                            tres_per_node="gres/gpu:1", script_fingerprint="ab" * 8)
    tpl = DecisionRecord(decision_id=PLACEHOLDER_ID, decided_at=0, job_class="c0ffee", user="alice", account="proj",
                         partition="gpu", job_name="train", action="share", shards=2, model_version="swapaware-model/1",
                         keys={"class": "c0ffee", "user_name": "alice/train", "account": "proj", "partition": "gpu"},
                         facts_pb=tpl_facts.SerializeToString(),
                         decision_pb=pb.Decision(decision_id=PLACEHOLDER_ID, action=pb.ACTION_SHARE, shards=2,
                                                 model_version="swapaware-model/1", reasons=reasons,
                                                 rewrite=pb.JobRewrite(admin_comment=comment)).SerializeToString())
    archive.put(version, {(7, "*"): tpl})
    log = DecisionLog(Path(f"{db}.journal"), store.record)
    catchup = AdmissionCatchup(store, log, archive, None, metrics=ServiceMetrics())
    base = 1_796_418_925
    live = [CommentedJob(1000 + i, base + i, 1000, "alice", "proj", "gpu", "PENDING",
                         comment.replace(f"id={PLACEHOLDER_ID}", f"id=a1b2c3d4{i:08x}"), "squeue", 60)
            for i in range(jobs)]
    gc.collect()
    gc.freeze()

    def cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    t0 = cpu()
    recorded = catchup.learn(live)
    log.flush()
    new_s = cpu() - t0
    t1 = cpu()
    again = catchup.learn(live)
    seen_s = cpu() - t1
    log.close()
    rows = store._read("SELECT count(*) FROM decisions")[0][0]
    return {"recorded": recorded, "again": again, "rows": rows, "new_us": new_s / jobs * 1e6,
            "seen_us": seen_s / jobs * 1e6}


def run_worker(src: Path, jobs: int, workdir: Path) -> dict:
    d = Path(tempfile.mkdtemp(dir=workdir))
    env = {**os.environ, "PYTHONPATH": str(src), "PYTHONDONTWRITEBYTECODE": "1"}
    out = subprocess.run([sys.executable, __file__, "--worker", "--jobs", str(jobs), "--dir", str(d)], env=env,
                         cwd=src, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"worker of {src} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=3000, help="table-made decisions a poll finds, per round")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--src", action="append", default=[], help="a source tree to run (repeatable)")
    ap.add_argument("--base", action="append", default=[], help="a git revision to run (repeatable)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.jobs, args.dir)))
        return
    with tempfile.TemporaryDirectory(prefix="catchup-cpu-") as tmp:
        work = Path(tmp)
        trees = [(rev, tree_of(rev, work)) for rev in args.base]
        trees += [(src, Path(src).resolve()) for src in args.src] or ([] if args.base and args.src else
                                                                        [("checkout", ROOT)])
        got: dict[str, list[dict]] = {name: [] for name, _ in trees}
        for r in range(args.rounds):
            for name, src in (trees if r % 2 == 0 else trees[::-1]):
                res = run_worker(src, args.jobs, work)
                if res["recorded"] != args.jobs or res["again"] != 0 or res["rows"] != args.jobs:
                    raise SystemExit(f"{name}: recorded {res['recorded']}, again {res['again']}, rows {res['rows']} "
                                     f"(want {args.jobs}, 0, {args.jobs})")
                got[name].append(res)
                print(f"round {r + 1}/{args.rounds} {name:>12}: {res['new_us']:6.1f} us per new decision, "
                      f"{res['seen_us']:5.2f} us per job seen before", file=sys.stderr)
    print(f"{args.jobs} table-made decisions per poll, {args.rounds} interleaved rounds; CPU of the worker process "
          "(every thread), median of the rounds")
    first = trees[0][0]
    print(f"{'tree':>12}  {'us/new decision':>15}  {'us/job seen':>11}  {'new/' + first[:10]:>16}")
    base_new = statistics.median(x["new_us"] for x in got[first])
    for name, _ in trees:
        new = statistics.median(x["new_us"] for x in got[name])
        seen = statistics.median(x["seen_us"] for x in got[name])
        per_round = [a["new_us"] / b["new_us"] for a, b in zip(got[name], got[first])]
        print(f"{name:>12}  {new:15.1f}  {seen:11.2f}  {new / base_new:8.3f} (rounds {min(per_round):.2f}-"
              f"{max(per_round):.2f})")


if __name__ == "__main__":
    main()
