"""Spool replay throughput against the real dev stack: events/s delivered one RPC per event
(what an older service gets) against batches of ReportEvents (one Slurm query per batch for the
job instances), side by side in interleaved rounds. Each round spools N JobFinished events of job
ids Slurm does not know (so the service asks Slurm about every one: squeue, then sacct) and
replays them as the node agent does, with the hooks' client (MUNGE credential per call).

    bash contrib/dev-stack.sh up
    .venv/bin/python bench/replay_throughput.py [--events 500 --rounds 2]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from submit_burst import stack_env  # noqa: E402

from policy_service._generated.swapaware.v1 import policy_pb2 as pb  # noqa: E402
from policy_service.config import load_config  # noqa: E402
from slurm_plugin.hooks import run as hooks, spool  # noqa: E402
from slurm_plugin.agent.daemon import REPLAY_DEADLINE_S  # noqa: E402


def spool_events(spool_dir: Path, n: int, base: int) -> None:
    tag = uuid.uuid4().hex[:8]
    for k in range(n):
        start = 1_000_000.0 + 100.0 * (base % 1_000_000 + k)  # one job after another on the GPU, as on a node
        req = pb.JobFinishedRequest(job_id=base + k, node="bench", gpu_indices=[0], started_at=start,
                                    finished_at=start + 60.0, event_id=f"bench-{tag}-{k}")
        spool.spool_event(spool_dir, "JobFinished", req, req.event_id)


def one_round(cfg, n: int, batch: int, base: int) -> float:
    with tempfile.TemporaryDirectory(prefix="replay-bench-") as d:
        spool_dir = Path(d)
        spool_events(spool_dir, n, base)
        replay_hooks = dataclasses.replace(cfg.hooks, deadline_s=REPLAY_DEADLINE_S)  # as the agent replays
        with hooks.hook_client(replay_hooks, cfg.auth, cfg.tls) as client:
            t0 = time.perf_counter()
            result = spool.replay(spool_dir, client.call, max_events=n, batch=batch)
            took = time.perf_counter() - t0
        if result.sent != n:
            raise SystemExit(f"replay delivered {result.sent} of {n}: {result.stopped_by}")
    return n / took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=500, help="events per round and mode")
    ap.add_argument("--per-event", type=int, default=100, help="events per round one RPC each (slow)")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    env = stack_env()
    os.environ.update({k: v for k, v in env.items() if k.startswith("SWAPAWARE_") or k == "SLURM_CONF"})
    cfg = load_config()
    rates: dict[str, list[float]] = {"per-event": [], "batched": []}
    base = 3_000_000_000
    for r in range(args.rounds):
        for mode in (("per-event", "batched") if r % 2 == 0 else ("batched", "per-event")):
            n, batch = (args.per_event, 1) if mode == "per-event" else (args.events, spool.BATCH_EVENTS)
            rate = one_round(cfg, n, batch, base)
            base += n
            rates[mode].append(rate)
            print(f"round {r + 1}/{args.rounds} {mode:9s}: {n} events, {rate:8.1f} events/s", file=sys.stderr)
    per, bat = (sum(v) / len(v) for v in (rates["per-event"], rates["batched"]))
    print(f"spool replay against the dev stack ({args.rounds} interleaved rounds):")
    print(f"  one RPC per event   {per:8.1f} events/s")
    print(f"  ReportEvents x{spool.BATCH_EVENTS:<4d} {bat:8.1f} events/s")
    print(f"  ratio batched / per-event: {bat / per:.1f}")


if __name__ == "__main__":
    main()
