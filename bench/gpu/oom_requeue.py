#!/usr/bin/env python3
"""A real GPU out-of-memory of a capped shared job, and the whole-GPU requeue it gets.

For a node with one NVIDIA GPU and PyTorch; no Slurm needed (the scontrol side of the requeue runs
against real Slurm in tests/integration/test_requeue.py on every release). Steps, each timed:

1. **share**: a real swapaware service (gRPC on 127.0.0.1, SQLite in a temporary directory)
   decides a one-GPU job with a memory hint: shared, 1 shard (``gpu.shard_bytes``). The TaskProlog's
   own code (``task_prolog_lines``, framework_env) makes the job's export lines for that shard on
   this GPU (its NVML memory).
2. **shared run**: a child process with those exports, under a synthetic job id, is a PyTorch job
   that honours its share (``torch.cuda.set_per_process_memory_fraction(SWAPAWARE_GPU_MEM_FRACTION)``):
   it holds 96 % of the share, then asks for 1 GiB more and gets a real CUDA out-of-memory error
   (exit 1). The node agent's own code (``Agent`` over ``PynvmlTelemetry``) samples it.
3. **epilog**: ``slurm_plugin.hooks.run.finished_request`` builds the JobFinished from the agent's
   summary and exit status 1; the service applies it, infers the OOM and requeues: its Slurm
   access here is a recorder of the calls (``requeuehold``, the restored request, ``release``).
4. **rerun**: the same child without the share (the whole GPU the requeue gives it) completes.

    python3 bench/gpu/oom_requeue.py [--out DIR]

Writes ``<out>/oom-requeue-<host>-<date>.json``; exit 0 when every step behaved as described,
1 otherwise, 3 without a GPU or PyTorch.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

GIB = 1024 ** 3
JOB_ID = 990100

CHILD = r"""
import os, sys, time, torch
frac = os.environ.get("SWAPAWARE_GPU_MEM_FRACTION")
if frac:  # a job that honours the share swapaware handed down
    torch.cuda.set_per_process_memory_fraction(float(frac), 0)
hold = torch.empty(int(sys.argv[1]), dtype=torch.uint8, device="cuda:0").fill_(1)
torch.cuda.synchronize()
print("holding", hold.numel(), flush=True)
time.sleep(float(sys.argv[3]))
try:
    more = torch.empty(int(sys.argv[2]), dtype=torch.uint8, device="cuda:0").fill_(1)
    torch.cuda.synchronize()
except torch.OutOfMemoryError as exc:
    print("OOM:", str(exc).splitlines()[0][:300], file=sys.stderr, flush=True)
    sys.exit(1)
print("done", flush=True)
"""


class RecordingSlurm:
    """What the service asks of Slurm, recorded (there is no Slurm on this machine)."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.comments: dict[int, str] = {}
        self.submitted = int(time.time())

    def live_instances(self, job_ids):  # the job as squeue shows it: its decision in its AdminComment
        from policy_service.slurm.slurm_text import JobInstance
        return [JobInstance(j, "gpu", self.submitted, self.submitted, 0, self.comments[j], "RUNNING", source="squeue")
                for j in job_ids if j in self.comments]

    def requeue_hold(self, job_id):
        self.calls.append(("requeuehold", job_id, time.monotonic()))

    def update_held_job(self, job_id, fields, admin_comment):
        self.calls.append(("update", job_id, dict(fields), admin_comment, time.monotonic()))

    def release_job(self, job_id):
        self.calls.append(("release", job_id, time.monotonic()))

    def job_state(self, job_id):  # the epilog (this script) ended before the service asks
        return "PENDING"

    def set_admin_comment(self, job_id, text):
        self.calls.append(("admin_comment", job_id, text, time.monotonic()))

    def __getattr__(self, name):  # the queue and correlation reads: an empty cluster
        def nothing(*_a, **_k):
            if name == "cluster_nodes":
                from policy_service.slurm.slurm_text import NodeGres
                return NodeGres(1, {})
            return {} if name.endswith(("addresses", "priorities")) else ([] if name != "cluster_gpus" else 1)
        return nothing


def child_argv(hold_bytes: int, more_bytes: int, hold_s: float, fake_root: Path | None) -> list[str]:
    """PyTorch on the GPU; with ``fake_root`` the fake NVML's allocator honouring the same share
    (the CPU rehearsal of this script: tests/unit/bench/test_oom_requeue_bench.py)."""
    if fake_root is None:
        return [sys.executable, "-c", CHILD, str(hold_bytes), str(more_bytes), str(hold_s)]
    alloc = f"{sys.executable} -m slurm_plugin.gpu.nvml fake-alloc --root {fake_root} --gpu 0 --honour-limit"
    return ["bash", "-c", f"{alloc} --bytes {hold_bytes} || exit $?; sleep {hold_s}; {alloc} --bytes {more_bytes} "
                          "|| exit 1; echo done"]


def run_child(env: dict[str, str], hold_bytes: int, more_bytes: int, agent, hold_s: float = 2.0,
              fake_root: Path | None = None) -> dict:
    t0 = time.monotonic()
    agent.start(JOB_ID, [0], os.getuid())  # the child runs as this user, on GPU 0
    p = subprocess.Popen(child_argv(hold_bytes, more_bytes, hold_s, fake_root), env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while p.poll() is None:
        agent.sample_once()
        time.sleep(0.1)
    out, err = p.communicate()
    summary = agent.stop(JOB_ID)
    return {"exit": p.returncode, "stdout": out[-500:], "stderr": err[-1500:], "s": round(time.monotonic() - t0, 2),
            "telemetry": summary}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "gpu" / "results")
    ap.add_argument("--fake-nvml", type=Path, default=None, help="rehearse on fake NVML (no GPU): its root")
    args = ap.parse_args(argv)
    if args.fake_nvml is None:
        try:
            import torch
            if not torch.cuda.is_available():
                raise RuntimeError("torch sees no GPU")
            gpu_name = torch.cuda.get_device_name(0)
        except Exception as exc:  # noqa: BLE001
            print(f"no GPU / PyTorch: nothing measured ({exc})")
            return 3
    else:
        gpu_name = "fake NVML"
    from policy_service._generated.swapaware.v1 import policy_pb2 as pb
    from policy_service.serving.client import PolicyClient
    from policy_service.config import AgentConfig, load_config
    from policy_service.serving.server import start_service
    from slurm_plugin.hooks import run as hooks
    from slurm_plugin import task_prolog
    from slurm_plugin.agent.daemon import Agent
    from slurm_plugin.gpu.nvml import PynvmlTelemetry
    from slurm_plugin.gpu.nvml_fake import FakeNvmlTelemetry

    result: dict = {"host": socket.gethostname(), "gpu": gpu_name}
    tmp = Path(tempfile.mkdtemp(prefix="swapaware-oom-"))
    env_cfg = {"SWAPAWARE_SERVICE__DB_PATH": str(tmp / "h.sqlite3"), "SWAPAWARE_SERVICE__SOCKET_PATH": str(tmp / "s"),
               "SWAPAWARE_SERVICE__GRPC_ADDRESS": "127.0.0.1:0", "SWAPAWARE_AUTH__MUNGE": "off",
               "SWAPAWARE_POLICY__SHARE_MIN_QUEUE": "0", "SWAPAWARE_SERVICE__SLURM_RELEASE": "24.11",
               "SWAPAWARE_SERVICE__SLURM_CONF": str(tmp / "slurm.conf"), "SWAPAWARE_AGENT__ENFORCEMENT": "framework_env"}
    cfg = load_config(env=env_cfg)
    slurm = RecordingSlurm()
    svc = start_service(cfg, slurm=slurm)
    telemetry = PynvmlTelemetry() if args.fake_nvml is None else FakeNvmlTelemetry(args.fake_nvml)
    agent = Agent(AgentConfig(sample_period_s=0.1), telemetry, kernel_log=None)
    checks: dict[str, bool] = {}
    try:
        device_bytes = telemetry.memory(0).total_bytes
        with PolicyClient(f"127.0.0.1:{svc.grpc_port}", 10.0) as client:
            facts = pb.JobFacts(user="alice", account="proj", partition="gpu", job_name="grows",
                                tres_per_node="gres/gpu:1", comment="swapaware:mem=2G", is_batch=True,
                                script_fingerprint="00000001deadbeef")
            d = client.admit(facts).decision
            result["decision"] = {"action": pb.Action.Name(d.action), "shards": d.shards, "id": d.decision_id}
            checks["shared_one_shard"] = d.action == pb.ACTION_SHARE and d.shards == 1
            job_env = {"SLURM_JOB_ID": str(JOB_ID), "SLURM_SHARDS_ON_NODE": str(d.shards), "CUDA_VISIBLE_DEVICES": "0",
                       "SLURM_STEP_ID": "batch", "SLURM_LOCALID": "0"}
            lines = task_prolog.task_prolog_lines(job_env, cfg, False, None, device_bytes)
            exports = dict(line[len("export "):].split("=", 1) for line in lines if line.startswith("export "))
            result["exports"] = exports
            share = int(exports["SWAPAWARE_GPU_MEM_LIMIT_BYTES"])
            slurm.comments[JOB_ID] = d.rewrite.admin_comment
            client.call("JobStarted", pb.JobStartedRequest(job_id=JOB_ID, node="gpu-node", gpu_indices=[0],
                                                           started_at=time.time(), event_id="s1"))
            base = {**os.environ, "SLURM_JOB_ID": str(JOB_ID), "CUDA_VISIBLE_DEVICES": "0"}
            shared = run_child({**base, **exports}, int(0.96 * share), GIB, agent, fake_root=args.fake_nvml)
            result["shared_run"] = shared
            checks["cuda_oom"] = shared["exit"] != 0 and "out of memory" in shared["stderr"].lower()
            fin = hooks.finished_request({"SLURM_JOB_ID": str(JOB_ID), "SLURMD_NODENAME": "gpu-node",
                                          "SLURM_JOB_EXIT_CODE2": "1:0", "SLURM_JOB_GPUS": "0"}, time.time(),
                                         shared["telemetry"])
            t0 = time.monotonic()
            applied = client.call("JobFinished", fin).applied
            svc.handler.events.on_shared_oom.drain()
            result["job_finished_to_released_s"] = round(time.monotonic() - t0, 3)
            svc.handler.flush()
            (obs,) = svc.store.observations(job_id=JOB_ID)
            result["observation"] = {"applied": applied, "oom": obs.oom, "shared": obs.shared,
                                     "peak_bytes": obs.peak_bytes, "charge_bytes": d.shards * cfg.gpu.shard_bytes}
            result["requeue_calls"] = [c[:-1] for c in slurm.calls]
            kinds = [c[0] for c in slurm.calls]
            checks["oom_inferred"] = bool(obs.oom and obs.shared)
            checks["requeued_whole"] = kinds == ["requeuehold", "update", "release"] and \
                "action=whole_gpu" in slurm.calls[1][3] and "oom_requeued" in slurm.calls[1][3]
            rerun = run_child(base, int(0.96 * share), GIB, agent, fake_root=args.fake_nvml)
            result["whole_rerun"] = rerun
            checks["rerun_completes"] = rerun["exit"] == 0 and "done" in rerun["stdout"]
    finally:
        svc.stop(0)
        telemetry.close()
    result["checks"] = checks
    result["ok"] = all(checks.values()) and len(checks) == 5
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = args.out / f"oom-requeue-{result['host']}-{stamp}.json"
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(json.dumps({k: result.get(k) for k in ("gpu", "decision", "checks", "job_finished_to_released_s",
                                                  "observation", "requeue_calls")}, indent=1, default=str))
    print(f"shared run: exit {shared['exit']} {shared['stderr'].strip()[-300:]}")
    print(f"written: {path}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
