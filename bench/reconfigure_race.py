"""`sbatch` during `scontrol reconfigure`, with the job_submit plugin off and on, side by side on
the real dev cluster: how often the controller closes a submission's connection with no answer
("Zero Bytes were transmitted or received"), and whether the job was created all the same.

Why: on 22.05 a reconfigure re-reads slurm.conf inside the running slurmctld
(read_slurm_conf -> slurm_conf_reinit), which clears the whole configuration, MessageTimeout
included, before parsing it again; a connection thread that reads or sends in that window times out
at once and closes the connection unanswered (slurmctld logs `slurm_msg_sendto ... msg_type=4004`
when the job was made and its answer was lost, `slurm_receive_msg ...` when the request was never
read). Since 23.11 a reconfigure restarts slurmctld instead. Whatever the plugin does, it is not
in that path; this measures whether the failures come with it or without it alike.

Each round runs both modes, in alternating order: --submitters loops of
`sbatch --hold --gres=gpu:1 --job-name=<unique> --wrap=true` for --seconds while another thread runs
`scontrol reconfigure` back to back; then the held jobs are listed (by name: a failed sbatch whose
job exists anyway) and cancelled, and slurmctld.log's new lines are counted.

    bash contrib/dev-stack.sh up && .venv/bin/python bench/reconfigure_race.py [--rounds 3 --seconds 60]
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from submit_burst import stack_env  # noqa: E402
from submit_overhead import set_mode  # noqa: E402
from table_mode import ctld_log, log_size  # noqa: E402

# slurmctld's lines for a connection closed unanswered (src/common/slurm_protocol_api.c; 4004:
# RESPONSE_SUBMIT_BATCH_JOB, the answer to a job that was created)
LOST_ANSWER = re.compile(r"slurm_msg_sendto: .*msg_type=(\d+|RESPONSE_SUBMIT_BATCH_JOB)")
UNREAD = re.compile(r"slurm_receive_msg \[[^]]*\]: ")


def run(argv: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)


def submitter(env: dict[str, str], tag: str, stop: threading.Event, out: list) -> None:
    k = 0
    while not stop.is_set():
        name = f"{tag}-{k}"
        k += 1
        r = run(["sbatch", "--parsable", "--hold", "--gres=gpu:1", f"--job-name={name}", "--wrap=true",
                 "--output=/dev/null"], env)
        out.append((name, r.returncode, r.stderr.strip().splitlines()[-1] if r.returncode else ""))


def reconfigurer(env: dict[str, str], stop: threading.Event, out: list) -> None:
    while not stop.is_set():
        out.append(run(["scontrol", "reconfigure"], env).returncode)


def block(env: dict[str, str], mode: str, seconds: float, submitters: int, rnd: int) -> dict:
    tag = f"rcf{os.getpid()}-{mode}-{rnd}"
    log = ctld_log(env)
    start = log_size(env)
    stop = threading.Event()
    subs: list = []
    reconf: list = []
    threads = [threading.Thread(target=submitter, args=(env, f"{tag}-{i}", stop, subs)) for i in range(submitters)]
    threads.append(threading.Thread(target=reconfigurer, args=(env, stop, reconf)))
    for t in threads:
        t.start()
    time.sleep(seconds)  # the block's length: what is measured happens meanwhile (not a wait for a condition)
    stop.set()
    for t in threads:
        t.join()
    names = set(run(["squeue", "-h", "-o", "%j", "--states=PENDING"], env).stdout.split())
    run(["scancel", "--state=PENDING", "--user=root"], env)
    with open(log, errors="replace") as f:
        f.seek(start)
        lines = f.read().splitlines()
    failed = [(n, err) for n, rc, err in subs if rc != 0]
    return {
        "sbatch": len(subs), "failed": collections.Counter(err.split(": ", 2)[-1] for _, err in failed),
        "failed_but_created": sum(n in names for n, _ in failed),
        "reconfigures": len(reconf), "reconfigure_failed": sum(rc != 0 for rc in reconf),
        "log_lost_answer": sum(bool(LOST_ANSWER.search(x)) for x in lines),
        "log_unread": sum(bool(UNREAD.search(x)) for x in lines),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=60, help="length of each mode's block per round")
    ap.add_argument("--submitters", type=int, default=4)
    args = ap.parse_args()
    env = stack_env()
    release = run(["sinfo", "--version"], env).stdout.strip()
    total: dict[str, dict] = {}
    for rnd in range(args.rounds):
        for mode in (("off", "on") if rnd % 2 == 0 else ("on", "off")):
            set_mode(mode, env)
            got = block(env, mode, args.seconds, args.submitters, rnd)
            print(f"round {rnd + 1} {mode:3}: {got['reconfigures']} reconfigures, {got['sbatch']} sbatch, "
                  f"{sum(got['failed'].values())} failed {dict(got['failed'])}, {got['failed_but_created']} of "
                  f"them created; slurmctld.log: {got['log_lost_answer']} answers lost, {got['log_unread']} "
                  f"requests unread", flush=True)
            acc = total.setdefault(mode, collections.Counter())
            for k, v in got.items():
                if isinstance(v, collections.Counter):
                    acc.update({f"failed: {m}": c for m, c in v.items()})
                else:
                    acc[k] += v
    set_mode("on", env)
    print(f"\n{release}, {args.rounds} rounds x {args.seconds:.0f} s per mode, {args.submitters} submitters:")
    for mode, acc in total.items():
        print(f"  {mode:3}: " + ", ".join(f"{k}={v}" for k, v in sorted(acc.items())))


if __name__ == "__main__":
    main()
