"""Slurm 22.05's GPUs held by no job after a slurmctld restart: whether jobs submitted right after
a restart are placed before the node's slurmd registers again, and whether their GPUs are freed
when they end, on the real dev cluster (single node).

What the source says (Slurm 22.05.8; fixed in 23.02.0 by "Save node gres topo state"): 22.05 saves
a node's GPU count with its state but not which GPU is of which type, and rebuilds that when the
node registers. An untyped request (`--gres=gpu:1`, `--gres=shard:N`) placed on the node before it
registered sets a bit in the node's GPU bitmap while the job's own per-type record stays empty, so
its end frees nothing; the registration then counts the leftover bits per type, and every later
GPU job of that size pends with Reason=Resources. A typed request takes the typed path and is freed.

Each case: --running jobs of the case's request started and left running (sleep 30), slurmctld
stopped and started again as `cluster.sh restart-ctld` does but without its wait for the node to
register, --jobs short jobs of the same request submitted at once with `-w <node>`; every 0.2 s the
node's state and SlurmdStartTime and the jobs' states are read (whether a job started before the
node registered); once every job ended, the node's GresUsed (GPUs held by no job?), then
`scontrol reconfigure` and GresUsed again; a node still holding GPUs is mended by
`cluster.sh restart-ctld`. --requeue-down tries the other path the source has (``requeue_down``).

    bash contrib/dev-stack.sh up && .venv/bin/python bench/restart_gres_leak.py [--cases untyped,typed]
    .venv/bin/python bench/restart_gres_leak.py --requeue-down
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from submit_burst import stack_env  # noqa: E402
from table_mode import dev_dir  # noqa: E402

from tests.waiting import wait_for  # noqa: E402
CLUSTER = ROOT / "contrib" / "dev-cluster" / "cluster.sh"
CASES = {"untyped": "--gres=gpu:1", "typed": "--gres=gpu:{type}:1", "shard": "--gres=shard:2"}


def run(argv: list[str], env: dict[str, str], check: bool = False, timeout: float = 120) -> subprocess.CompletedProcess:
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise SystemExit(f"{' '.join(argv)}: {r.stderr.strip()[-400:]}")
    return r


def pid_in(path: Path) -> int:
    return int(path.read_text().strip())


def states_of(env: dict[str, str], ids: list[str]) -> list[str]:
    """squeue's compact states of the jobs still in the queue (none: every job ended)."""
    return run(["squeue", "-h", "-j", ",".join(ids), "-o", "%t"], env).stdout.split()


def gres_used(env: dict[str, str], node: str) -> str:
    m = re.search(r"GresUsed=(\S*)", run(["scontrol", "show", "node", "-d", node], env).stdout)
    return m.group(1) if m else "?"


def gres_held(used: str) -> bool:
    """Whether GresUsed counts a GPU or a shard held (gpu:N, gpu:TYPE:N, shard:(null):N, ... with
    N > 0; the IDX list after N is not a count)."""
    return any(int(n) > 0 for n in re.findall(r"(?:gpu|shard)(?::(?:\(null\)|[^:(,]+))?:(\d+)", used))


def reconfigure_then_mend(env: dict[str, str], node: str) -> tuple[str, str]:
    """(the node's GresUsed after `scontrol reconfigure`, after `cluster.sh restart-ctld` where the
    reconfigure left GRES held, else "")."""
    run(["scontrol", "reconfigure"], env, check=True)
    wait_for(lambda: run(["scontrol", "ping"], env).returncode == 0, 60, "slurmctld after reconfigure", 0.2)
    reconfigured = gres_used(env, node)
    if not gres_held(reconfigured):
        return reconfigured, ""
    run(["bash", str(CLUSTER), "restart-ctld"], env)
    return reconfigured, gres_used(env, node)


def restart_without_wait(env: dict[str, str], state: Path) -> None:
    """slurmctld stopped and started as the dev cluster starts it, returning once it answers."""
    pid = pid_in(state / "run" / "slurmctld.pid")
    os.kill(pid, signal.SIGTERM)
    wait_for(lambda: not Path(f"/proc/{pid}").exists(), 60, "slurmctld to stop", 0.2)
    run(["slurmctld"], {**env, "LUA_PATH": f"{state}/etc/?.lua;;"}, check=True)
    wait_for(lambda: run(["scontrol", "ping"], env).returncode == 0, 60, "slurmctld to answer", 0.2)


def node_line(env: dict[str, str], node: str) -> tuple[str, bool]:
    """(State, registered with this slurmctld: SlurmdStartTime set)."""
    out = run(["scontrol", "show", "node", node], env).stdout
    m = re.search(r"\bState=(\S+)", out)
    return (m.group(1) if m else "?"), "SlurmdStartTime=None" not in out


def submit(env: dict[str, str], request: str, node: str, seconds: int) -> str:
    return run(["sbatch", "--parsable", request, f"-w{node}", "--job-name=gresleak", "--output=/dev/null",
                "--wrap", f"sleep {seconds}"], env, check=True).stdout.strip().split(";")[0]


def case(env: dict[str, str], state: Path, node: str, request: str, jobs: int, running: int) -> dict:
    assert not gres_held(gres_used(env, node)), f"node {node} holds GRES before the case"
    long = [submit(env, request, node, 30) for _ in range(running)]
    if long:
        wait_for(lambda: set(states_of(env, long)) == {"R"}, 60, "the running jobs to start", 0.2)
    restart_without_wait(env, state)
    at_restart = node_line(env, node)
    ids = [submit(env, request, node, 2) for _ in range(jobs)]
    asked = sorted(set(run(["squeue", "-h", "-j", ",".join(ids), "-o", "%b"], env).stdout.split()))
    started_before_registration, registered, reasons = 0, False, set()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        node_state, registered_now = node_line(env, node)
        rows = [x.split("|") for x in run(["squeue", "-h", "-j", ",".join(ids), "-o", "%i|%t|%r"],
                                          env).stdout.split("\n") if x]
        if not registered:
            started_before_registration = max(started_before_registration, sum(t in ("R", "CG", "CF") for _, t, _ in rows))
            reasons |= {r for _, t, r in rows if t == "PD"}
        registered = registered or registered_now
        if not rows:
            break
        time.sleep(0.2)
    wait_for(lambda: not states_of(env, ids + long), 120, "every job to end", 0.2)
    states = sorted(set(run(["sacct", "-n", "-X", "-j", ",".join(ids), "-o", "State"], env).stdout.split()))
    after = gres_used(env, node)
    reconfigured, mended = reconfigure_then_mend(env, node)
    return {"at_restart": at_restart[0], "asked": asked, "started_before_registration": started_before_registration,
            "pending_reasons": sorted(reasons), "sacct": states, "after": after, "held": gres_held(after),
            "after_reconfigure": reconfigured, "held_after_reconfigure": gres_held(reconfigured),
            "after_restart_ctld": mended}


def requeue_down(env: dict[str, str], node: str, request: str) -> dict:
    """The other path Slurm's source has to GPUs held by no job (22.05.8; fixed in 23.02.2, "requeued
    jobs had bad gres allocations"): a job requeued while it runs is still completing (its script
    ignores SIGTERM for KillWait) when its node is set DOWN, which frees its allocation without the
    requeue's own clean-up; when it runs again it takes GPU bits that its end does not free
    (slurmctld logs "dealloc of node ... bad node_offset")."""
    assert not gres_held(gres_used(env, node)), f"node {node} holds GRES before the case"
    log = dev_dir(env) / "log" / "slurmctld.log"
    start = log.stat().st_size
    job = run(["sbatch", "--parsable", "--requeue", request, f"-w{node}", "--job-name=gresleak", "--output=/dev/null",
               "--wrap", 'trap "" TERM; sleep 12'], env, check=True).stdout.strip().split(";")[0]
    wait_for(lambda: states_of(env, [job]) == ["R"], 60, "the job to run", 0.2)
    run(["scontrol", "requeue", job], env, check=True)
    completing = ",".join(states_of(env, [job]))
    run(["scontrol", "update", f"nodename={node}", "state=down", "reason=bench/restart_gres_leak.py"], env, check=True)
    run(["scontrol", "update", f"nodename={node}", "state=resume"], env, check=True)
    wait_for(lambda: states_of(env, [job]) == ["R"], 180, "the job to run again", 0.5)
    wait_for(lambda: not states_of(env, [job]), 120, "the job to end", 0.5)
    with open(log, errors="replace") as f:
        f.seek(start)
        bad = sum("bad node_offset" in x for x in f)
    after = gres_used(env, node)
    reconfigured, mended = reconfigure_then_mend(env, node)
    return {"state_at_down": completing, "bad_node_offset_lines": bad, "after": after, "after_reconfigure": reconfigured,
            "after_restart_ctld": mended}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="untyped,typed,shard", help=f"from {tuple(CASES)}")
    ap.add_argument("--requeue-down", action="store_true",
                    help="instead: a running job requeued and its node set DOWN while it completes (requeue_down)")
    ap.add_argument("--jobs", type=int, default=2, help="jobs submitted right after the restart")
    ap.add_argument("--running", type=int, default=2, help="jobs running across the restart (also run with none)")
    args = ap.parse_args()
    env = stack_env()
    state = dev_dir(env)
    node = run(["sinfo", "-h", "-N", "-o", "%N"], env, check=True).stdout.split()[0]
    gres = run(["scontrol", "show", "node", node], env, check=True).stdout
    gpu_type = (re.findall(r"gpu:([A-Za-z0-9_]+):\d", gres) or ["?"])[0]
    plugin = "on" if re.search(r"^JobSubmitPlugins=lua", (state / "etc" / "slurm.conf").read_text(), re.M) else "off"
    print(f"{run(['sinfo', '--version'], env).stdout.strip()}, node {node}, job_submit plugin {plugin}")
    for name in args.cases.split(","):
        request = CASES[name].format(type=gpu_type)
        if args.requeue_down:
            got = requeue_down(env, node, request)
            print(f"{name:8} {request:22} requeued, node set DOWN while the job was {got['state_at_down']}, run again "
                  f"and ended: GresUsed={got['after']}, {got['bad_node_offset_lines']} 'bad node_offset' line(s) in "
                  f"slurmctld.log; after scontrol reconfigure {got['after_reconfigure']}"
                  + (f"; after restart-ctld {got['after_restart_ctld']}" if got['after_restart_ctld'] else ""),
                  flush=True)
            continue
        for running in sorted({0, args.running}):
            got = case(env, state, node, request, args.jobs, running)
            print(f"{name:8} {request:22} {running} running at the restart, node {got['at_restart']} after it; "
                  f"{args.jobs} submitted at once (held as {','.join(got['asked'])}): "
                  f"{got['started_before_registration']} started before the node registered "
                  f"(pending: {'; '.join(got['pending_reasons']) or '-'}), ended {','.join(got['sacct'])}; "
                  f"GresUsed={got['after']} (GRES held by no job: {got['held']}); after scontrol reconfigure "
                  f"{got['after_reconfigure']} (held: {got['held_after_reconfigure']})"
                  + (f"; after restart-ctld {got['after_restart_ctld']}" if got['after_restart_ctld'] else ""),
                  flush=True)


if __name__ == "__main__":
    main()
