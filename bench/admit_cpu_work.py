"""bench/admit_cpu.py's workload: the files a service runs with (slurm.conf and gres.conf like the
dev cluster's, a swapaware.toml, Slurm's commands as stand-ins that answer an empty queue), the
Admits job_submit.lua would send (a pool of classes in 24.11's request shapes, some never seen
before), and the history seeded through the handler's own Admit / JobStarted / JobFinished path."""
from __future__ import annotations

import json
import random
import time
from pathlib import Path

GIB = 1024 ** 3

SLURM_CONF = """ClusterName=bench
SlurmctldHost=localhost
GresTypes=gpu,shard
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory,LL_SHARED_GRES
NodeName=vm NodeAddr=127.0.0.1 CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 ThreadsPerCore=1 RealMemory=24105 Gres=gpu:a100:2,gpu:h100:2,shard:24 State=UNKNOWN
PartitionName=gpu Nodes=vm Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8 TRESBillingWeights="CPU=1.0,GRES/gpu=8,GRES/shard=1"
PartitionName=gpudef Nodes=vm MaxTime=INFINITE State=UP OverSubscribe=FORCE:8 TRESBillingWeights="CPU=1.0,GRES/gpu=8,GRES/shard=1" DefCpuPerGPU=2 DefMemPerGPU=600
"""
GRES_CONF = """AutoDetect=off
Name=gpu Type=a100 File=/dev/null
Name=gpu Type=a100 File=/dev/zero
Name=gpu Type=h100 File=/dev/full
Name=gpu Type=h100 File=/dev/random
Name=shard Count=4 File=/dev/null
Name=shard Count=4 File=/dev/zero
Name=shard Count=8 File=/dev/full
Name=shard Count=8 File=/dev/random
"""
CONFIG = """[gpu]
memory_bytes = {mem}
shards_per_gpu = 8

[policy]
share_min_queue = 0.0
queue_poll_s = 2.0

[estimator]
min_samples = 1

[service]
grpc_address = "127.0.0.1:0"
socket_path = "{dir}/swapaware.sock"
db_path = "{dir}/history.sqlite3"
slurm_backend = "cli"
slurm_release = "24.11"
slurm_conf = "{dir}/slurm.conf"

[auth]
munge = "off"

[admission]
table_path = "{table}"
"""
# Slurm's commands as the service finds them on its PATH: an empty queue, no accounting
FAKE_SLURM = ("squeue", "sacct", "scontrol", "sinfo", "sacctmgr")

# request shapes (24.11's spelling) and how often each is sent
SHAPES = (({"tresPerNode": "gres/gpu:1"}, 6), ({"tresPerNode": "gres/gpu:a100:1"}, 2),
          ({"tresPerJob": "gres/gpu:1"}, 2), ({"tresPerNode": "gres/gpu:2"}, 1),
          ({"tresPerNode": "gres/shard:2"}, 1),
          ({"tresPerTask": "gres/gpu=1", "numTasks": 1, "tresBind": "gres/gpu:per_task:1"}, 1))


def facts(user: int, name: str, script: str, shape: dict, qos: str = "normal", partition: str = "gpu") -> dict:
    """What swapaware_facts.lua's M.facts sends: every field, "" and 0 where the user gave none."""
    out = {"user": f"user{user}", "uid": 1000 + user, "account": f"proj{user % 7}", "partition": partition,
           "jobName": name, "tresPerNode": "", "tresPerJob": "", "tresPerTask": "", "tresPerSocket": "",
           "timeLimitMin": 60, "scriptFingerprint": script, "workDir": f"/home/user{user}/{name}", "comment": "",
           "envMemHint": "", "minNodes": 0, "numTasks": 0, "isBatch": True, "hetJob": False, "qos": qos,
           "cpusPerTres": "", "memPerTres": "", "ntasksPerTres": 0, "tresBind": "", "tresFreq": "",
           "exclusive": "", "stepGpuBind": False}
    out.update(shape)
    return out


class Classes:
    """The jobs sent: a pool of classes, ``new`` of the Admits a class never seen before."""

    def __init__(self, seed: int, pool: int, new: float):
        self.rng, self.new, self.n = random.Random(seed), new, 0
        shapes = [s for s, w in SHAPES for _ in range(w)]
        self.pool = [facts(i % 40, f"train{i % 25}", f"{i:016x}", shapes[i % len(shapes)],
                           qos=("normal", "high", "")[i % 3], partition="gpudef" if i % 11 == 0 else "gpu")
                     for i in range(pool)]
        self.shapes = shapes

    def next(self) -> dict:
        if self.rng.random() < self.new:
            self.n += 1
            f = facts(self.rng.randrange(60), f"sweep{self.n % 97}", f"f{self.n:015x}",
                      self.rng.choice(self.shapes))
            self.pool.append(f)
            return f
        return self.pool[self.rng.randrange(len(self.pool))]


def admit_line(job: dict) -> bytes:
    return json.dumps({"method": "Admit", "request": {"job": job, "brief": True, "plugin": {
        "instance": "bench-ctld", "breakerOpen": 0, "serviceError": 0, "startedAt": 1700000000}}},
        separators=(",", ":")).encode() + b"\n"


# ----------------------------------------------------------------------------- the history
class SeedSlurm:
    """What the seeding needs of Slurm: each job's AdminComment, as squeue shows it."""

    def __init__(self):
        self.comments: dict[int, str] = {}

    def job_admin_comment(self, job_id):
        return self.comments.get(job_id)

    def live_instances(self, job_ids):
        from policy_service.slurm.slurm_text import JobInstance
        now = int(time.time())
        return [JobInstance(j, "bench", now, 1, 0, self.comments[j], "RUNNING", source="squeue")
                for j in job_ids if j in self.comments]

    def ended_instances(self, job_ids):
        return []

    def accounting_jobs(self, job_ids=(), start="", end=""):
        return []

    def pending_jobs(self):
        return []

    def queue_with_comments(self):
        return [], []

    def cluster_nodes(self):
        from policy_service.slurm.slurm_text import NodeGres
        return NodeGres(gpus=0, shards={})

    def slurm_user(self):
        return "root", 0


def seed_history(workdir: Path, pool: int) -> Path:
    """A history in which 3 of every 4 pool classes ran 1-4 times (this checkout's code)."""
    from policy_service._generated.swapaware.v1 import policy_pb2 as pb
    from google.protobuf import json_format
    from policy_service.config import load_config
    from policy_service.serving.server import start_service

    d = workdir / "seed"
    d.mkdir()
    write_files(d, table=False)
    cfg = load_config(d / "swapaware.toml", env={})
    slurm = SeedSlurm()
    svc = start_service(cfg, slurm=slurm, accept_empty_history=True)
    h, job_id, rng = svc.handler, 100, random.Random(7)
    try:
        for i, f in enumerate(Classes(1, pool, 0.0).pool):
            if i % 4 == 3:
                continue  # never ran: no estimate of its own
            for _ in range(1 + i % 4):
                job_id += 1
                d_ = h.admit(pb.AdmitRequest(job=json_format.ParseDict(f, pb.JobFacts()))).decision
                slurm.comments[job_id] = d_.rewrite.admin_comment
                start = time.time() - 3600 + job_id
                h.job_started(pb.JobStartedRequest(job_id=job_id, node="vm", gpu_indices=[job_id % 4],
                                                   started_at=start, event_id=f"s{job_id}"))
                fin = h.job_finished(pb.JobFinishedRequest(
                    job_id=job_id, node="vm", gpu_indices=[job_id % 4], finished_at=start + 60, exit_code=0,
                    event_id=f"f{job_id}", peak_gpu_bytes=int((2 + (i % 9) + rng.random()) * GIB),
                    telemetry_source="fake-nvml"))
                assert fin.applied, fin
        h.flush()
    finally:
        svc.stop(0)
    return d / "history.sqlite3"


def in_process_service(d: Path, history: Path, table: bool = False):
    """A service started in this process in ``d`` (made here) on a copy of the seeded ``history``,
    its Slurm the stand-in: what --profile and bench/gc_pause.py send Admits to through handle_line."""
    import shutil

    from policy_service.config import load_config
    from policy_service.serving.server import start_service

    d.mkdir()
    write_files(d, table)
    shutil.copy(history, d / "history.sqlite3")
    return start_service(load_config(d / "swapaware.toml", env={}), slurm=SeedSlurm())


def write_files(d: Path, table: bool) -> None:
    (d / "slurm.conf").write_text(SLURM_CONF)
    (d / "gres.conf").write_text(GRES_CONF)
    (d / "swapaware.toml").write_text(CONFIG.format(mem=80 * GIB, dir=d, table=f"{d}/admission.json" if table else ""))
    bindir = d / "bin"
    bindir.mkdir(exist_ok=True)
    for cmd in FAKE_SLURM:
        p = bindir / cmd
        p.write_text("#!/bin/sh\nexit 0\n")
        p.chmod(0o755)
