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
import cProfile
import io
import json
import os
import pstats
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from proc_cpu import stat_cpu_s  # noqa: E402
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
        from policy_service.adapters.slurm_text import JobInstance
        now = int(time.time())
        return [JobInstance(j, "bench", now, 1, 0, self.comments[j], "RUNNING", source="squeue")
                for j in job_ids if j in self.comments]

    def ended_instances(self, job_ids):
        return []

    def accounting_jobs(self, job_ids=(), start="", end=""):
        return []

    def pending_jobs(self):
        return []

    def slurm_user(self):
        return "root", 0


def seed_history(workdir: Path, pool: int) -> Path:
    """A history in which 3 of every 4 pool classes ran 1-4 times (this checkout's code)."""
    from policy_service._generated.swapaware.v1 import policy_pb2 as pb
    from google.protobuf import json_format
    from policy_service.config import load_config
    from policy_service.server import start_service

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


# ----------------------------------------------------------------------------- a service
def tree_of(rev: str, workdir: Path) -> Path:
    """The source of ``rev`` (git archive), with this checkout's generated protos."""
    out = workdir / f"src-{rev.replace('/', '_')}"
    out.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "policy_service"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    shutil.copytree(ROOT / "policy_service" / "_generated", out / "policy_service" / "_generated")
    return out


class Service:
    def __init__(self, name: str, src: Path, workdir: Path, history: Path, table: bool):
        self.name, self.src = name, src
        self.dir = Path(tempfile.mkdtemp(prefix="svc-", dir=workdir))  # (a socket path: at most 107 bytes)
        write_files(self.dir, table)
        shutil.copy(history, self.dir / "history.sqlite3")
        env = {**os.environ, "SWAPAWARE_CONFIG": str(self.dir / "swapaware.toml"), "PYTHONPATH": str(src),
               "PATH": f"{self.dir / 'bin'}:{os.environ.get('PATH', '')}", "PYTHONDONTWRITEBYTECODE": "1"}
        env = {k: v for k, v in env.items() if not k.startswith("SWAPAWARE_") or k == "SWAPAWARE_CONFIG"}
        self.log = open(workdir / f"{name}.log", "wb")
        entry = os.environ.get("ADMIT_CPU_ENTRY")  # (experiments: another way to start it)
        argv = [sys.executable, entry] if entry else [sys.executable, "-c", "from policy_service.cli import main; main()", "serve"]
        self.proc = subprocess.Popen(argv,
                                     env=env, cwd=src, stdout=self.log, stderr=subprocess.STDOUT)
        sock = self.dir / "swapaware.sock"
        for _ in range(300):
            if sock.exists():
                break
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name}: the service exited ({workdir / f'{name}.log'})")
            time.sleep(0.1)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(str(sock))
        self.sock.settimeout(10)
        self.rfile = self.sock.makefile("rb")
        self.replies: list[bytes] = []

    def cpu_s(self) -> float:
        return stat_cpu_s(Path(f"/proc/{self.proc.pid}/stat"))

    def threads(self) -> dict[str, float]:
        """CPU seconds of each live thread of the service, by tid."""
        out = {}
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            try:
                out[task.name] = stat_cpu_s(task / "stat")
            except (FileNotFoundError, ProcessLookupError):
                pass
        return out

    def admit(self, lines: list[bytes], keep: bool = False) -> None:
        for line in lines:
            self.sock.sendall(line)
            reply = self.rfile.readline()
            if not reply.startswith(b'{"response"'):
                raise RuntimeError(f"{self.name}: {reply[:300]!r}")
            if keep:
                self.replies.append(reply)

    def pending(self) -> int:
        """Decisions journaled and not yet in the history (the journal's size, 0 once drained)."""
        try:
            return (self.dir / "history.sqlite3.journal").stat().st_size
        except FileNotFoundError:
            return 0

    def stop(self) -> None:
        self.sock.close()
        self.proc.terminate()
        self.proc.wait(20)
        self.log.close()


def measure(svc: Service, lines: list[bytes]) -> tuple[float, float]:
    """CPU microseconds of the service per Admit over ``lines``, the writer's commits included,
    and the part of it spent by the thread that served the connection (the busiest one)."""
    t0, c0 = svc.threads(), svc.cpu_s()
    svc.admit(lines)
    for _ in range(200):  # the writer commits what waits every 50 ms, then empties the journal
        if svc.pending() == 0:
            break
        time.sleep(0.02)
    time.sleep(0.1)
    t1, c1 = svc.threads(), svc.cpu_s()
    busiest = max((v - t0.get(tid, 0.0) for tid, v in t1.items()), default=0.0)
    return (c1 - c0) * 1e6 / len(lines), busiest * 1e6 / len(lines)


def idle(svc: Service, seconds: float) -> float:
    c0 = svc.cpu_s()
    time.sleep(seconds)
    return (svc.cpu_s() - c0) * 1e6 / seconds


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
    from policy_service.adapters.local_socket import handle_line
    from policy_service.config import load_config
    from policy_service.server import start_service

    d = workdir / "profile"
    d.mkdir()
    write_files(d, table)
    shutil.copy(history, d / "history.sqlite3")
    cfg = load_config(d / "swapaware.toml", env={})
    svc = start_service(cfg, slurm=SeedSlurm())
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
        print(f"== the same, own share (the Python function on top of the stack: its C calls included) ==")
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
        print(f"== the same, by cumulative time ==")
        print("\n".join(s.getvalue().splitlines()[6:]))
        # the decision writer: records as Admit journals them, put into the history in batches
        from policy_service.adapters.decision_log import read_journal
        recs = []
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
            del read_journal
    finally:
        svc.stop(0)


# ----------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=1500, help="Admits per service per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pool", type=int, default=400, help="classes in the seeded pool")
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
        warm = [admit_line(gen.next()) for _ in range(300)]
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
