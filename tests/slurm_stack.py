"""A real Slurm (munge, MariaDB, slurmdbd, slurmctld, slurmd) of the release installed where the
tests run (22.05, 24.11 or 26.05: contrib/matrix/run.sh runs the suites once per release, each in
its own network namespace), on fake GPUs, wired to swapaware by contrib/dev-stack.sh with its own
state directory and ports: what the integration and multi-node suites drive. ``Stack.dialect`` is
the running release's: tests spell GRES through it."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
import shutil
import sqlite3
import subprocess
import time
import sys
import uuid
from dataclasses import dataclass
from typing import Iterator
from pathlib import Path

import pytest

from policy_service.slurm.slurm import cluster_release
from policy_service.admin.wiring import plugin_settings
from policy_service.core.dialect import SlurmDialect
from tests.waiting import wait_for


def tail_of(log: Path, lines: int, keep=None) -> list[str]:
    """The last ``lines`` lines of ``log`` (those ``keep`` accepts, when given); what could not be
    read, as one line. For failure reports: never raises."""
    try:
        text = log.read_text(errors="replace").splitlines()
    except OSError as exc:
        return [f"({exc})"]
    return [ln for ln in text if keep is None or keep(ln)][-lines:]


def proc_state(pid: int | str, threads: bool = False) -> str:
    """A process's state from /proc ("S (sleeping)"), with its thread count and the kernel wait
    channels of its threads when asked; "gone" when it is not there. For failure reports: never raises."""
    try:
        proc = Path(f"/proc/{pid}")
        state = (proc / "status").read_text().split("State:", 1)[1].split("\n", 1)[0].strip()
        if threads:
            tasks = list((proc / "task").iterdir())
            waits = sorted({(t / "wchan").read_text() for t in tasks} - {"0"})
            state += f", {len(tasks)} threads waiting in {waits}"
        return state
    except (OSError, IndexError):
        return "gone"


ROOT = Path(__file__).resolve().parents[1]
STACK = ROOT / "contrib" / "dev-stack.sh"
CLUSTER = ROOT / "contrib" / "dev-cluster" / "cluster.sh"
# One state directory per release: cleanup that scans /proc by SLURM_CONF path (chroots share the
# host's /proc) never touches another release's cluster.
_RELEASE_TAG = os.environ.get("SWAPAWARE_RELEASE", "").replace(".", "")


def state_dir(kind: str = "test") -> Path:
    """/var/tmp/swapaware-<kind>[-<release>], or SWAPAWARE_TEST_DIR for the single-node suite."""
    default = f"/var/tmp/swapaware-{kind}" + (f"-{_RELEASE_TAG}" if _RELEASE_TAG else "")
    return Path(os.environ.get("SWAPAWARE_TEST_DIR", default) if kind == "test" else default)


STATE = state_dir()
PORTS = {"SWAPAWARE_CTLD_PORT": "16817", "SWAPAWARE_SLURMD_PORT": "16818", "SWAPAWARE_DBD_PORT": "16819",
         "SWAPAWARE_DB_PORT": "16816", "SWAPAWARE_GRPC_PORT": "56551"}
GIB = 1024**3
FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL")


@functools.lru_cache(maxsize=1)
def dev_fleet() -> tuple[tuple[str, int, int], ...]:
    """The dev cluster's GPUs as ``cluster.sh gpus`` makes them: (type, shards, GiB) per GPU."""
    fields = dict(kv.split("=", 1) for kv in subprocess.run(["bash", str(CLUSTER), "gpus"], capture_output=True,
                                                            text=True, check=True, timeout=60).stdout.split())
    gib, shard_gib = [int(g) for g in fields["gpu_gib"].split(",")], int(fields["shard_gib"])
    shards = [int(n) for n in fields["shards"].split(",")] if fields.get("shards") else [g // shard_gib for g in gib]
    return tuple(zip(fields["types"].split(","), shards, gib))


def skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "integration tests start Slurm's daemons and need root"
    if shutil.which("slurmctld") is None:
        return "Slurm is not installed (contrib/dev-cluster/cluster.sh install)"
    return None


def installed_dialect() -> SlurmDialect:
    """The dialect of the Slurm whose daemons the tests start, read as the service reads it."""
    release = cluster_release("", 30.0)
    assert release.version is not None, release.source
    return release.dialect


@dataclass
class Stack:
    env: dict[str, str]
    state: Path
    dialect: SlurmDialect = dataclasses.field(default_factory=installed_dialect)

    def gres(self, name: str, count: int, gres_type: str = "") -> str:
        """A GRES entry as this release shows it in TresPerNode: 'gres:shard:1' / 'gres/shard:1'."""
        return self.dialect.gres(name, count, gres_type)

    @property
    def whole_gpu_as_shards(self) -> bool:
        """Whether a whole-GPU decision of an untyped request is held as all shards of the GPU on
        this release: only where every GPU has the same shard count (the dev fleet's do not)."""
        return self.dialect.gpu_beside_shard_bug and len({n for _, n, _ in dev_fleet()}) == 1

    @property
    def whole_gpu_request(self) -> str:
        """A one-GPU request that swapaware holds on a GPU of its own while it is kept whole: on
        22.05 with GPUs of different shard counts an untyped one stays gpu:1, which Slurm 22.05 may
        place beside shard jobs; a typed one is held as all shards of its type (the h100s)."""
        return "--gres=gpu:1" if self.whole_gpu_as_shards or not self.dialect.gpu_beside_shard_bug \
            else "--gres=gpu:h100:1"

    def fill_gres(self, i: int) -> str:
        """A request that takes a whole GPU as all its shards whatever the history says (a shard
        request passes the plugin unchanged): the i-th of the dev fleet's GPUs, largest first, by type,
        so that fillers 0..3 take the four GPUs whatever order Slurm picks them in."""
        gpu_type, shards, _ = sorted(dev_fleet(), key=lambda g: -g[1])[i]
        return f"--gres=shard:{gpu_type}:{shards}"

    def run(self, *argv: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        r = subprocess.run(list(argv), env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            gone = "Unable to contact slurm controller" in r.stderr
            raise AssertionError(f"{' '.join(argv)} exited {r.returncode}\nstdout: {r.stdout}\nstderr: {r.stderr}"
                                 + (self._ctld_report() if gone else ""))
        return r

    def _ctld_report(self, keep: int = 60) -> str:
        """Whether slurmctld runs and its log's end: why the controller cannot be reached."""
        try:
            pid = int((self.state / "run" / "slurmctld.pid").read_text().strip() or 0)
        except (OSError, ValueError):
            pid = 0
        status = proc_state(pid) if pid else "no pid file"
        if pid and status != "gone":  # whose process the pid is now (pids wrap: another cluster's daemon may hold it)
            try:
                conf = [e for e in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if e.startswith(b"SLURM_CONF=")]
                status += f", {Path(f'/proc/{pid}/comm').read_text().strip()} with " \
                          f"{conf[0].decode(errors='replace') if conf else 'no SLURM_CONF'}"
            except OSError:
                status = "gone"
        tail = tail_of(self.state / "log" / "slurmctld.log", keep)
        return f"\nslurmctld pid {pid}: {status}\nslurmctld.log (last {keep} lines):\n" + "\n".join(tail)

    def stack(self, *args: str) -> subprocess.CompletedProcess:
        return self.run("bash", str(STACK), *args, timeout=600)

    def sbatch(self, script: str, *args: str) -> int:
        path = self.state / "jobs" / f"{uuid.uuid4().hex[:8]}.sh"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(script)
        out = self.run("sbatch", "--parsable", f"--chdir={path.parent}", *args, str(path)).stdout.strip()
        return int(out.split(";")[0])

    def show_job(self, job_id: int) -> str:
        return self.run("scontrol", "show", "job", "-o", str(job_id)).stdout

    def wait_done(self, job_id: int | str, timeout_s: float = 90) -> str:
        """The job's final state as the accounting (sacct) has it."""
        def state() -> str | None:
            r = self.run("sacct", "-X", "-n", "-P", "-j", str(job_id), "-o", "state", check=False)
            words = r.stdout.split()
            return words[0] if words and words[0] in FINAL_STATES else None

        return wait_for(state, timeout_s, lambda: f"job {job_id} to finish: {self.show_job(job_id)}\n"
                        f"{self.queue_and_gres()}", 0.5)

    def queue_and_gres(self) -> str:
        """The queue and what each node's GRES are used by: why a job waits (timeout messages)."""
        queue = self.run("squeue", "-o", "%i %j %T %r %b", check=False).stdout
        used = [ln.strip() for ln in self.run("scontrol", "show", "node", "-d", check=False).stdout.splitlines()
                if ln.strip().startswith(("NodeName", "Gres", "State"))]
        return f"squeue:\n{queue}nodes:\n" + "\n".join(used) + self._ctld_log_errors()

    def _ctld_log_errors(self, keep: int = 40) -> str:
        """slurmctld's last error and GRES lines (why GPUs stay allocated to no job)."""
        try:
            lines = (self.state / "log" / "slurmctld.log").read_text(errors="replace").splitlines()
        except OSError:
            return ""
        picked = [ln for ln in lines if "error" in ln or "gres" in ln.lower() or "started on cluster" in ln]
        return "\nslurmctld.log (errors, GRES, starts):\n" + "\n".join(picked[-keep:])

    def sacct_admin_comment(self, job_id: int) -> str:
        r = self.run("sacct", "-X", "-n", "-P", "-j", str(job_id), "-o", "admincomment")
        return r.stdout.strip()

    def history(self) -> sqlite3.Connection:
        return sqlite3.connect(f"file:{self.state}/lib/history.sqlite3?mode=ro", uri=True)

    def wait_observation(self, job_id: int, timeout_s: float = 30) -> tuple:
        """The job's observation once the history holds it and job_submit.lua decides from what it
        taught: the admission table dropped the classes it taught before the row was recorded
        (admission/publish.py, ``learning``), and the plugin sees the file as it is at most
        table_check_ms after (swapaware_table.lua caches its last look that long)."""
        def row() -> tuple | None:
            with self.history() as db:
                return db.execute("SELECT decision_id, runtime_s, exit_code, peak_bytes, gpu_indices, "
                                  "telemetry_source FROM observations WHERE job_id=?", (job_id,)).fetchone()

        found = wait_for(row, timeout_s, lambda: f"an observation of job {job_id}; hooks log:\n"
                         + (self.state / "log" / "hooks.log").read_text()[-3000:], 0.3)
        seen = time.monotonic()
        settings = plugin_settings((self.state / "etc" / "swapaware_plugin.conf").read_text())
        if settings["table"]:  # on: the plugin's cached look may predate the drop until then
            check_s = float(settings.get("table_check_ms", "1000")) / 1000
            wait_for(lambda: time.monotonic() >= seen + check_s, 5.0, "table_check_ms after the observation")
        return found

    def wait_for_decisions(self, *sbatch_args: str, timeout_s: float = 120) -> None:
        """After a service outage job_submit.lua's circuit breaker lets GPU jobs pass undecided
        for 10 s or more: submit held probes until one carries a decision again (each cancelled).
        Each probe is a class of its own, so that the admission table, which decides the classes it
        holds through an outage, cannot answer for the service."""
        def decided() -> bool:  # a class of its own: decided by the service, never from the admission table
            probe = self.held("#!/bin/sh\ntrue\n", "--gres=gpu:1", f"--job-name=probe-{uuid.uuid4().hex[:8]}",
                              *sbatch_args)
            return bool(decision_of(job_field(probe, "AdminComment")))

        wait_for(decided, timeout_s, "job_submit.lua to reach the service again", 2.0)

    def wait_nodes_up(self, timeout_s: float = 60) -> None:
        """Every node registered with slurmctld (sinfo shows none UNKNOWN, DOWN or not responding):
        Slurm itself refuses GPU requests before (seen on 26.05 right after a restart, plugin off)."""
        def up() -> bool:
            states = self.run("sinfo", "-h", "-N", "-o", "%T", check=False).stdout.split()
            return bool(states) and not any(s.startswith(("unknown", "down")) or s.endswith("*") for s in states)

        wait_for(up, timeout_s, lambda: "every node registered: " + self.run("sinfo", "-N", check=False).stdout, 0.3)

    def wait_sharing(self, timeout_s: float = 60) -> None:
        """After slurmctld (re)started, the service keeps GPU jobs whole until a queue poll begun
        after the start read its nodes (QueueMonitor.slurmctld_started): submit held probes of a
        shareable class (a memory hint) until one shares again (each cancelled)."""
        def shares() -> bool:  # a class of its own, as in wait_for_decisions
            probe = self.held("#!/bin/sh\ntrue\n", "--gres=gpu:1", "--comment=swapaware:mem=2G",
                              f"--job-name=probe-{uuid.uuid4().hex[:8]}")
            return decision_of(job_field(probe, "AdminComment")).get("action") == "share"

        wait_for(shares, timeout_s, "a shareable probe job to share after slurmctld started", 1.0)

    def held(self, script: str, *sbatch_args: str) -> str:
        """Submit ``script`` held and cancel it; its ``scontrol show job -o`` line (the decision
        is made at submit)."""
        job = self.sbatch(script, "--hold", *sbatch_args)
        try:
            return self.show_job(job)
        finally:
            self.run("scancel", str(job))

    @contextlib.contextmanager
    def service_with(self, **env: str) -> Iterator[None]:
        """The policy service restarted with extra environment (``SWAPAWARE_<SECTION>__<KEY>``)
        for the block, then restarted as configured."""
        self.stack("service-stop")
        dataclasses.replace(self, env={**self.env, **env}).stack("service-start")
        try:
            self.wait_for_decisions()
            yield
        finally:
            self.stack("service-stop")
            self.stack("service-start")
            self.wait_for_decisions()

    def node(self, name: str, *argv: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        """``argv`` inside compute node ``name``'s namespaces (multi-node stacks)."""
        return self.run("bash", str(CLUSTER), "node-exec", name, *argv, check=check, timeout=timeout)

    def node_dir(self, name: str) -> Path:
        """What node ``name`` keeps for itself (its spool, agent socket, fake GPUs), seen from here."""
        return self.state / "nodes" / name

    def observations(self, job_id: int) -> list[tuple]:
        """(node, decision id, peak bytes, exit code) of every observation of ``job_id``."""
        with self.history() as db:
            return db.execute("SELECT node, decision_id, peak_bytes, exit_code FROM observations WHERE job_id=? "
                              "ORDER BY node", (job_id,)).fetchall()

    def swapaware(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return self.run(str(Path(sys.executable).parent / "swapaware"), *args, check=check)


def reload_job_submit(js: Path, previous_mtime: float | None = None) -> None:
    """Make slurmctld load job_submit.lua again (a new Lua state, swapaware_plugin.conf read anew).
    It reloads when the script's mtime, in whole seconds, is past the mtime of the copy it loaded
    (slurm_lua_loadscript keeps st_mtime as its load time): put it a whole second or more past both
    now and the previous one (``previous_mtime``: the file's before it was rewritten; default: its
    mtime now). Two reloads within one second would otherwise keep the old script for good."""
    before = js.stat().st_mtime if previous_mtime is None else previous_mtime
    t = max(int(time.time()), int(before)) + 2
    os.utime(js, (t, t))


@contextlib.contextmanager
def plugin_table(stack: "Stack", table: Path) -> Iterator[None]:
    """job_submit.lua decides from the admission table at ``table`` (swapaware_plugin.conf's
    table=, checked at every job, owner root) for the block, on every slurmctld that reads this
    cluster's etc (both controllers of a two-controller cluster); then as configured again."""
    conf = stack.state / "etc" / "swapaware_plugin.conf"
    js = stack.state / "etc" / "job_submit.lua"
    before = conf.read_text()
    conf.write_text(before + f"\ntable={table}\ntable_check_ms=0\ntable_uids=0\n")
    reload_job_submit(js)
    try:
        yield
    finally:
        conf.write_text(before)
        reload_job_submit(js)


def job_field(oneliner: str, key: str) -> str:
    from policy_service.slurm.slurm import scontrol_field

    return scontrol_field(oneliner, key) or ""


def fake_alloc_script(stack: Stack, gib: float, hold_s: float = 1.5, extra: str = "", busy_pct: float | None = None
                      ) -> str:
    py = Path(sys.executable)
    busy = "" if busy_pct is None else f" --busy-pct {busy_pct}"
    return f"""#!/bin/bash
env | grep -E '^(CUDA_VISIBLE_DEVICES|SLURM_JOB_GPUS|SLURM_SHARDS_ON_NODE|SLURM_GPUS_ON_NODE|SWAPAWARE_GPU_MEM_LIMIT_BYTES)=' | sort
{extra}
exec {py} -m slurm_plugin.gpu.nvml fake-alloc --root {stack.state}/node/fake-nvml --gpu "${{CUDA_VISIBLE_DEVICES%%,*}}" \\
    --bytes {int(gib * GIB)} --hold-seconds {hold_s}{busy}
"""


def grows_script(stack) -> str:
    """Holds 9.6 GiB (96 % of one shard), lets the agent see it, then asks for 1 GiB more: refused
    under a 10 GiB share (exit 2, 'CUDA out of memory (fake)' on stderr), granted on a whole GPU."""
    alloc = (f"{sys.executable} -m slurm_plugin.gpu.nvml fake-alloc --root {stack.state}/node/fake-nvml "
             '--gpu "${CUDA_VISIBLE_DEVICES%%,*}" --honour-limit')
    return f"""#!/bin/bash
{alloc} --bytes {int(9.6 * GIB)} || exit $?
sleep 2
{alloc} --bytes {GIB} || exit $?
echo "done on a GPU of its own"
"""


def requeue_restarts(stack, job_id: int) -> int:
    return int(job_field(stack.show_job(job_id), "Restarts") or 0)


# What sacct -D shows of a job requeued after its run ended: the first run REQUEUED (22.05, 24.11)
# or FAILED (26.05, measured), then the rerun.
REQUEUED_RUNS = (["REQUEUED", "COMPLETED"], ["FAILED", "COMPLETED"])


def sacct_runs(stack, job_id: int) -> list[str]:
    """Every run of the job accounting holds (-D: a requeued run stays listed as REQUEUED)."""
    out = stack.run("sacct", "-D", "-X", "-n", "-P", "-j", str(job_id), "-o", "state").stdout
    return [line.strip() for line in out.splitlines() if line.strip()]


def decision_of(comment: str) -> dict[str, str]:
    from policy_service.core.policy import parse_admin_comment

    return parse_admin_comment(comment)


def start_stack(state: Path, ports: dict[str, str], *up_args: str, **extra_env: str) -> Stack:
    """A stack from an empty state (history and accounting), its client environment read back."""
    reason = skip_reason()
    if reason:
        if os.environ.get("CI"):
            raise RuntimeError(f"integration tests cannot run in CI: {reason}")
        pytest.skip(reason)
    env = {**os.environ, **ports, "SWAPAWARE_DEV_DIR": str(state), "SWAPAWARE_VENV": sys.prefix, **extra_env}
    env.pop("SWAPAWARE_CONFIG", None)
    s = Stack(env=env, state=state)
    s.stack("down", "--purge")
    up = s.stack("up", *up_args)
    for line in s.stack("env").stdout.splitlines():
        m = re.match(r"export (\w+)=(.*)", line)
        if m:
            env[m.group(1)] = m.group(2).strip("'\"")
    assert "SLURM_CONF" in env and "SWAPAWARE_CONFIG" in env, up.stderr
    return s

