"""Issue 23 on real daemons: slurmctld's failover between ctl1 and ctl2 during a burst of
submissions, and swapaware's two services following it on one MariaDB history.

Each burst submits held one-GPU jobs one after another (the decision is made at submit; a held job
never runs) and reads back each job's AdminComment. A job whose AdminComment carries a decision must
have exactly that decision in the history, once; a job without one was let through undecided by the
plugin's fail-open. Printed per burst: the failover gap (first to last undecided or refused
submission, seconds), lost (decided in Slurm, missing from the history) and duplicated (a burst job
with more than one decision in the history)."""
from __future__ import annotations

import dataclasses
import subprocess
import time
import uuid
from pathlib import Path
from typing import Callable

import pytest

from tests.multinode_ha.conftest import CTLD_TIMEOUT_S, PORTS, SUBNET
from tests.slurm_stack import CLUSTER, FINAL_STATES, Stack, decision_of, fake_alloc_script, job_field
from tests.waiting import wait_for



@dataclasses.dataclass(frozen=True)
class Submission:
    name: str
    started: float  # time.time() when sbatch began
    ended: float
    job_id: int | None  # None: sbatch refused or failed
    decision_id: str  # "" when the AdminComment carries no decision (fail-open)
    table: str = ""  # the AdminComment's tbl= (<version>:<entry><gate state>): decided by job_submit.lua's table


@dataclasses.dataclass(frozen=True)
class BurstResult:
    tag: str
    switch_at: float
    subs: tuple[Submission, ...]

    @property
    def undecided(self) -> tuple[Submission, ...]:
        return tuple(s for s in self.subs if not s.decision_id)

    @property
    def gap_s(self) -> float:
        """Seconds from the first undecided (or refused) submission's start to the last one's end."""
        u = self.undecided
        return max(s.ended for s in u) - min(s.started for s in u) if u else 0.0

    def first_decided_after(self, t: float) -> Submission | None:
        later = [s for s in self.subs if s.started >= t and s.decision_id]
        return min(later, key=lambda s: s.started) if later else None


def cluster_cmd(stack: Stack, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return stack.run("bash", str(CLUSTER), *args, check=check, timeout=120)


def in_control(stack: Stack) -> str:
    return cluster_cmd(stack, "in-control", check=False).stdout.strip()


def history_db(stack: Stack):
    """A connection to the cluster's swapaware history (MariaDB on the bridge side)."""
    import pymysql

    password = Path(stack.state / "etc" / "swapaware-db.pass").read_text().strip()
    return pymysql.connect(host=f"{SUBNET}.1", port=int(PORTS["SWAPAWARE_DB_PORT"]), user="swapaware",
                           password=password, database="swapaware", connect_timeout=5)


def history_rows(stack: Stack, tag: str) -> dict[str, list[tuple[str, float]]]:
    """job name -> (decision id, decided_at) in the MariaDB history, for the burst's job names."""
    conn = history_db(stack)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT job_name, decision_id, decided_at FROM decisions WHERE job_name LIKE %s",
                        (f"ha-{tag}-%",))
            rows: dict[str, list[tuple[str, float]]] = {}
            for name, did, at in cur.fetchall():
                rows.setdefault(name, []).append((did, float(at)))
            return rows
    finally:
        conn.close()


def submit_one(stack: Stack, name: str) -> Submission:
    t0 = time.time()
    r = stack.run("sbatch", "--parsable", "--hold", "--gres=gpu:1", f"--job-name={name}",
                  f"--chdir={stack.state}", "--wrap", "true", check=False, timeout=120)
    t1 = time.time()
    if r.returncode != 0:
        return Submission(name, t0, t1, None, "")
    job = int(r.stdout.strip().split(";")[0])
    line = stack.run("scontrol", "show", "job", "-o", str(job), check=False).stdout
    decision = decision_of(job_field(line, "AdminComment"))
    return Submission(name, t0, t1, job, decision.get("id", ""), decision.get("tbl", ""))


def burst(stack: Stack, switch: Callable[[], None], before: int = 8, after_decided: int = 10,
          limit_s: float = 90) -> BurstResult:
    """``before`` submissions, then ``switch()``, then submissions until ``after_decided`` of them
    carried a decision (or ``limit_s`` passed)."""
    tag = uuid.uuid4().hex[:6]
    subs: list[Submission] = [submit_one(stack, f"ha-{tag}-{i}") for i in range(before)]
    switch_at = time.time()
    switch()
    i = before
    while sum(1 for s in subs[before:] if s.decision_id) < after_decided and time.time() - switch_at < limit_s:
        subs.append(submit_one(stack, f"ha-{tag}-{i}"))
        i += 1
    return BurstResult(tag, switch_at, tuple(subs))


@dataclasses.dataclass(frozen=True)
class Counts:
    lost: int  # decided in Slurm (AdminComment), not in the history
    dup: int  # a burst job with more than one decision in the history
    decision_gap_s: float  # the longest pause between the burst's decisions (the history's decided_at)
    decided_at: tuple[float, ...]  # the burst's decisions' times, sorted


def settle_and_count(stack: Stack, res: BurstResult) -> Counts:
    """Waits until every decided job's decision is in the history (the writer drains its journal)."""
    decided = {s.name: s.decision_id for s in res.subs if s.decision_id}

    def missing() -> list[str]:
        rows = history_rows(stack, res.tag)
        return [n for n, d in decided.items() if d not in [r[0] for r in rows.get(n, [])]]

    try:
        wait_for(lambda: not missing(), 60, lambda: f"decisions {missing()} in the history", 0.5)
    except AssertionError:
        pass  # counted below as lost
    rows = history_rows(stack, res.tag)
    times = sorted(at for n, d in decided.items() for did, at in rows.get(n, []) if did == d)
    gap = max((b - a for a, b in zip(times, times[1:])), default=0.0)
    return Counts(len(missing()), sum(1 for s in res.subs if s.job_id is not None and len(rows.get(s.name, [])) > 1),
                  gap, tuple(times))


def backup_on_at(stack: Stack) -> float:
    """When SlurmctldPrimaryOnProg last ran on ctl2 (its role file: "primary <time>")."""
    role, at = (stack.state / "nodes" / "ctl2" / "run" / "role").read_text().split()[:2]
    assert role == "primary", role
    return float(at)


def report(what: str, res: BurstResult, c: Counts, on_at: float) -> None:
    first = res.first_decided_after(res.switch_at + 0.5)
    resumed = min((t for t in c.decided_at if t >= on_at), default=float("nan"))
    refused = sum(1 for s in res.subs if s.job_id is None)
    print(f"\n[ha] {what}: {len(res.subs)} submissions, {len(res.undecided)} undecided "
          f"({refused} refused by sbatch), failover gap (fail-open) {res.gap_s:.1f} s, longest pause between "
          f"decisions {c.decision_gap_s:.1f} s, first decided submission after the switch ended "
          f"+{(first.ended - res.switch_at) if first else float('nan'):.1f} s, Slurm's takeover (ctl2's "
          f"PrimaryOnProg) +{on_at - res.switch_at:.1f} s, ctl2's first decision {resumed - on_at:.1f} s after that, "
          f"lost {c.lost}, dup {c.dup}")


def restore_primary(stack: Stack) -> None:
    """ctl1 running and in control again (22.05's `scontrol takeover` stops the primary), and every
    node registered with it and answering (wait_nodes_back)."""
    if not ctl_running(stack, "ctl1"):
        cluster_cmd(stack, "start-ctl", "ctl1")
    wait_for(lambda: in_control(stack) == "ctl1", 60, lambda: f"ctl1 in control (now: {in_control(stack)!r})", 0.5)
    # A primary back from a cut tells the backup to give up (its PrimaryOffProg): until then both act
    # as primary, and a job one of them made may be unknown to the other. 22.05's backup was seen to
    # hang there ("REQUEST_CONTROL reply but backup not completely done relinquishing control") and
    # exit without its OffProg: then it is started again, as the backup.
    # (hung: alive 29 s after REQUEST_CONTROL, still primary, answering nothing: killed by its pid)
    try:
        wait_for(lambda: role_of(stack, "ctl2") != "primary" or not ctl_running(stack, "ctl2"), 45,
                 "ctl2's PrimaryOffProg or its exit", 0.5)
    except AssertionError:
        pid = cluster_cmd(stack, "ctl-pid", "ctl2", check=False).stdout.strip()
        print(f"\n[ha] ctl2's slurmctld (pid {pid}) hung giving control back: killed")
        if pid:
            stack.run("kill", "-KILL", pid, check=False)
        wait_for(lambda: not ctl_running(stack, "ctl2"), 15, "ctl2's slurmctld gone", 0.2)
    if not ctl_running(stack, "ctl2"):
        cluster_cmd(stack, "start-ctl", "ctl2")
        wait_for(lambda: role_of(stack, "ctl2") == "backup", 30, "ctl2 standing by", 0.5)
    wait_writer(stack, "ctl1")
    wait_nodes_back(stack)


def wait_nodes_back(stack: Stack) -> None:
    """Every node registered with the controller in control (SlurmdStartTime, None until then: a
    restarted 22.05 slurmctld knows a node's shards only from its registration) and answering it.
    A primary cut off the network set the nodes DOWN (not responding) and takes them back at its
    next ping of them: 61 s after the uncut on 24.11 (measured; the next test's own 60 s wait for
    its nodes once ran out there). Within three SlurmdTimeouts."""
    def back() -> bool:
        states = stack.run("sinfo", "-h", "-N", "-o", "%T", check=False).stdout.split()
        nodes = stack.run("scontrol", "show", "node", "-o", check=False).stdout.splitlines()
        return (bool(states) and not any(st.endswith("*") or st.startswith(("down", "unk")) for st in states)
                and bool(nodes) and not any("SlurmdStartTime=None" in n for n in nodes))

    wait_for(back, 180, lambda: "every node registered and responding: " + stack.run("sinfo", "-N", check=False).stdout
             + stack.run("scontrol", "show", "node", "-o", check=False).stdout[-1500:] + unanswered(stack), 1.0)


def unanswered(stack: Stack, lines: int = 12) -> str:
    """Why Slurm's commands may read nothing: sinfo's exit and error, each controller's slurmctld
    (pid, role, state and where it waits, from /proc) and its log's last lines. A failure message
    is what CI keeps of a run: the suite's log tails printed after it may be cut."""
    try:
        r = stack.run("sinfo", "-h", "-N", check=False)
        out = [f"\n-- sinfo exited {r.returncode}: {r.stderr.strip()[-400:]!r}"]
    except Exception as exc:  # noqa: BLE001 - a report of a failure never fails itself
        out = [f"\n-- sinfo: {exc!r}"]
    for ctl in ("ctl1", "ctl2"):
        try:
            pid = cluster_cmd(stack, "ctl-pid", ctl, check=False).stdout.strip()
        except Exception:  # noqa: BLE001
            pid = ""
        try:
            proc = Path(f"/proc/{pid}")
            state = (proc / "status").read_text().split("State:", 1)[1].split("\n", 1)[0].strip() if pid else "no slurmctld"
            if pid:
                waits = sorted({(t / "wchan").read_text() for t in (proc / "task").iterdir()} - {"0"})
                state += f", {len(list((proc / 'task').iterdir()))} threads waiting in {waits}"
        except (OSError, IndexError):
            state = "gone"
        log = stack.state / "nodes" / ctl / "run" / "slurmctld.log"
        try:
            tail = log.read_text(errors="replace").splitlines()[-lines:]
        except OSError as e:
            tail = [f"({e})"]
        out.append(f"-- {ctl}: slurmctld pid {pid or '-'} ({state}), role {role_of(stack, ctl) or '-'}; "
                   f"{log.name}:\n" + "\n".join(tail))
    return "\n".join(out)


def ctl_running(stack: Stack, ctl: str) -> bool:
    return bool(cluster_cmd(stack, "ctl-pid", ctl, check=False).stdout.strip())


def role_of(stack: Stack, ctl: str) -> str:
    """What the last PrimaryOnProg/OffProg on ``ctl`` wrote ("primary", "backup"; "" before any)."""
    try:
        return (stack.state / "nodes" / ctl / "run" / "role").read_text().split()[0]
    except (OSError, IndexError):
        return ""


def ha_status(stack: Stack) -> str:
    return stack.swapaware("ha", "status", check=False).stdout


def wait_writer(stack: Stack, ctl: str, timeout_s: float = 30) -> None:
    """``ctl``'s service holds the writer lease (``swapaware ha status``); when it does not in
    time, the message says what each service last decided of its role and why."""
    wait_for(lambda: f"writer lease: {ctl}" in ha_status(stack), timeout_s,
             lambda: f"{ctl} the writer: {ha_status(stack)}" + writers_report(stack), 0.5)


def writers_report(stack: Stack, lines: int = 8) -> str:
    """Each controller's role file, the shared heartbeat slurmctld writes, and the last lines its
    service logged of its role (what a lease that did not move is explained by)."""
    out = []
    try:
        hb = (stack.state / "spool" / "ctld" / "heartbeat").read_bytes()
        out.append(f"\n-- heartbeat: {hb.hex()} (written {time.time() - int.from_bytes(hb[:8], 'big'):.0f} s ago)"
                   if len(hb) == 16 else f"\n-- heartbeat: {len(hb)} bytes")
    except OSError as exc:
        out.append(f"\n-- heartbeat: {exc}")
    for ctl in ("ctl1", "ctl2"):
        try:
            role = (stack.state / "nodes" / ctl / "run" / "role").read_text().strip()
        except OSError as exc:
            role = str(exc)
        try:
            logged = [ln for ln in (stack.state / "log" / f"swapaware-{ctl}.log").read_text(errors="replace").splitlines()
                      if "swapaware.ha" in ln or " ERROR " in ln][-lines:]
        except OSError as exc:
            logged = [str(exc)]
        out.append(f"-- {ctl}: role file {role!r}; its service's role, as logged:\n" + "\n".join(logged))
    return "\n".join(out)


def check_failover(res: BurstResult, c: Counts, on_at: float) -> None:
    """Slurm's own part (the switch until the backup runs its PrimaryOnProg) is at most
    SlurmctldTimeout after the primary is gone; decisions pause no longer than that + 5 s. (24.11
    ran job_submit on the backup before its PrimaryOnProg ended: the backup's first decision may
    precede on_at.)"""
    assert res.first_decided_after(res.switch_at + 0.5) is not None, f"no decided submission after the switch: {res.subs}"
    assert [t for t in c.decided_at if t >= on_at - 5], f"ctl2 in control at {on_at}, decisions at {c.decided_at}"
    assert c.decision_gap_s <= (on_at - res.switch_at) + 5, \
        f"decisions paused {c.decision_gap_s:.1f} s around the switch (Slurm's takeover {on_at - res.switch_at:.1f} s)"
    assert (c.lost, c.dup) == (0, 0)


def test_both_controllers_and_services_come_up(ha_cluster: Stack) -> None:
    assert in_control(ha_cluster) == "ctl1"
    assert "writer lease: ctl1" in ha_status(ha_cluster)
    s = submit_one(ha_cluster, f"ha-up-{uuid.uuid4().hex[:6]}")
    assert s.decision_id, s


def test_takeover_during_a_burst(ha_cluster: Stack) -> None:
    restore_primary(ha_cluster)
    res = burst(ha_cluster, lambda: ha_cluster.run("scontrol", "takeover"))
    wait_for(lambda: in_control(ha_cluster) == "ctl2", 30, "ctl2 in control")
    wait_writer(ha_cluster, "ctl2")
    on_at = backup_on_at(ha_cluster)
    c = settle_and_count(ha_cluster, res)
    report("scontrol takeover", res, c, on_at)
    check_failover(res, c, on_at)
    restore_primary(ha_cluster)


def rows_per(stack: Stack, table: str, column: str, values: list) -> dict:
    """value -> how many rows of the history's ``table`` have it in ``column`` (absent: none)."""
    conn = history_db(stack)
    try:
        with conn.cursor() as cur:
            cur.execute(f"SELECT {column}, COUNT(*) FROM {table} WHERE {column} IN ("
                        + ",".join(["%s"] * len(values)) + f") GROUP BY {column}", values)
            return {v: int(n) for v, n in cur.fetchall()}
    finally:
        conn.close()


def observations_per_job(stack: Stack, jobs: list[int]) -> dict[int, int]:
    return {int(j): n for j, n in rows_per(stack, "observations", "job_id", jobs).items()}


def test_observations_during_a_takeover_arrive_once(ha_cluster: Stack) -> None:
    """Jobs that run across a takeover: their hooks' events go to whichever service
    writes (a standby refuses them, the lease gap spools them on the node, the agent replays); each
    job ends with exactly one observation.

    The jobs' end is read from the controller in control, not from sacct: a 26.05 backup that took
    over sends nothing to slurmdbd until the primary is back (docs/slurm-releases.md, "26.05: a
    backup in control sends nothing to slurmdbd"), so sacct keeps them RUNNING meanwhile."""
    restore_primary(ha_cluster)
    # All submitted and running before the switch: 22.05's backup refused shard submissions after a
    # takeover ("Requested node configuration is not available"; sinfo there showed 0 shards).
    script = fake_alloc_script(ha_cluster, 1, hold_s=4)
    jobs = [ha_cluster.sbatch(script, "--gres=shard:1", f"--job-name=ha-obs-{i}") for i in range(4)]
    # check=False: 26.05 answered 'Invalid job id' for a job it had just accepted (seen once)
    wait_for(lambda: all(job_field(ha_cluster.run("scontrol", "show", "job", "-o", str(j), check=False).stdout,
                                   "JobState") == "RUNNING" for j in jobs), 60, "the jobs running", 0.2)
    ha_cluster.run("scontrol", "takeover")
    for j in jobs:
        # MinJobAge (30 s on the dev cluster) keeps a finished job in the controller's answers
        wait_for(lambda: job_field(ha_cluster.run("scontrol", "show", "job", "-o", str(j), check=False).stdout,
                                   "JobState") in FINAL_STATES, 120, f"job {j} finished on {in_control(ha_cluster)}", 0.2)
    sacct = ha_cluster.run("sacct", "-X", "-n", "-P", "-j", ",".join(map(str, jobs)), "-o", "jobid,state").stdout
    print(f"\n[ha] after the takeover, in control: {in_control(ha_cluster)}; sacct: {' '.join(sacct.split())}")
    wait_for(lambda: len(observations_per_job(ha_cluster, jobs)) == len(jobs), 90,
             lambda: f"one observation per job: {observations_per_job(ha_cluster, jobs)}", 0.5)
    counts = observations_per_job(ha_cluster, jobs)
    print(f"\n[ha] observations across a takeover: {len(jobs)} jobs, per job {sorted(counts.values())}")
    assert sorted(counts) == sorted(jobs) and set(counts.values()) == {1}, counts
    restore_primary(ha_cluster)


def test_primary_cut_off_during_a_burst(ha_cluster: Stack) -> None:
    """Decisions the cut-off primary had answered but not yet written wait in its journal: they
    arrive once it is back and writes again, so they are counted after that."""
    restore_primary(ha_cluster)
    try:
        res = burst(ha_cluster, lambda: cluster_cmd(ha_cluster, "cut", "ctl1"))
        wait_for(lambda: in_control(ha_cluster) == "ctl2", 30, "ctl2 in control")
        wait_writer(ha_cluster, "ctl2")
        on_at = backup_on_at(ha_cluster)
    finally:
        cluster_cmd(ha_cluster, "uncut", "ctl1")
    restore_primary(ha_cluster)  # (and the nodes back: wait_nodes_back)
    c = settle_and_count(ha_cluster, res)
    report("primary cut off", res, c, on_at)
    check_failover(res, c, on_at)


def sacct_jobs(stack: Stack, jobs: list) -> list[str]:
    out = stack.run("sacct", "-X", "-n", "-P", "-j", ",".join(map(str, jobs)), "-o", "jobid", check=False).stdout
    return [j for j in out.split() if j]


def test_hand_back_with_the_backup_stopped_first(ha_cluster: Stack) -> None:
    """`cluster.sh hand-back`, the order docs/ha.md gives sites: the backup in control is stopped
    (it saves its state and exits), then the primary started, then the backup again. Slurm's own
    hand-back (the primary started while the backup is in control, `start-ctl ctl1`) made the
    primary wait 29 s and, on 26.05, read a state file the backup was replacing ("fatal: No node
    state file ... to recover"; docs/slurm-releases.md). Jobs the backup accepted just before are
    known to the primary after it."""
    if ha_cluster.dialect.name != "26.05":
        # Measured on 26.05 only (15 of 15 hand-backs). On 22.05 the backup in control, sent SIGTERM,
        # had not exited 60 s later in the one run of this test there; not looked into.
        pytest.skip(f"the hand-back order is measured on 26.05; this is {ha_cluster.dialect.name}")
    restore_primary(ha_cluster)
    ha_cluster.run("scontrol", "takeover")
    wait_for(lambda: in_control(ha_cluster) == "ctl2" and not ctl_running(ha_cluster, "ctl1"), 30,
             "ctl2 in control, ctl1 stopped", 0.2)
    jobs = [s.job_id for s in (submit_one(ha_cluster, f"ha-hb-{uuid.uuid4().hex[:6]}-{i}") for i in range(4))]
    assert None not in jobs, jobs
    log = ha_cluster.state / "nodes" / "ctl1" / "run" / "slurmctld.log"
    offset = log.stat().st_size
    t0 = time.monotonic()
    try:
        cluster_cmd(ha_cluster, "hand-back")
        took = time.monotonic() - t0
        assert in_control(ha_cluster) == "ctl1"
        assert ctl_running(ha_cluster, "ctl2") and role_of(ha_cluster, "ctl2") == "backup"
        states = {j: job_field(ha_cluster.run("scontrol", "show", "job", "-o", str(j), check=False).stdout, "JobState")
                  for j in jobs}
        assert set(states.values()) == {"PENDING"}, states
        with log.open("rb") as f:
            f.seek(offset)
            started = f.read().decode(errors="replace")
        assert "fatal:" not in started and "Running as primary controller" in started, started
        wait_writer(ha_cluster, "ctl1")
        # a 26.05 backup in control sends nothing to slurmdbd (docs/slurm-releases.md): its jobs
        # reach sacct once the primary is back
        wait_for(lambda: len(sacct_jobs(ha_cluster, jobs)) == len(jobs), 60,
                 lambda: f"the backup's jobs in sacct: {sacct_jobs(ha_cluster, jobs)}", 0.5)
        print(f"\n[ha] hand-back with the backup stopped first: ctl1 in control, ctl2 standing by after {took:.1f} s; "
              f"the backup's {len(jobs)} jobs known to ctl1 and in sacct")
    finally:
        ha_cluster.run("scancel", *map(str, jobs), check=False)


def test_both_services_told_primary_one_writes(ha_cluster: Stack) -> None:
    restore_primary(ha_cluster)
    before = ha_status(ha_cluster)
    conf = str(ha_cluster.state / "etc" / "swapaware-ctl2.toml")
    venv = ha_cluster.env["SWAPAWARE_VENV"]
    ha_cluster.node("ctl2", f"{venv}/bin/swapaware", "ha", "primary-on", "--config", conf)
    try:
        tag = uuid.uuid4().hex[:6]
        subs = [submit_one(ha_cluster, f"ha-{tag}-{i}") for i in range(6)]
        res = BurstResult(tag, time.time(), tuple(subs))
        c = settle_and_count(ha_cluster, res)
        assert all(s.decision_id for s in subs), subs
        assert (c.lost, c.dup) == (0, 0)
        after = ha_status(ha_cluster)
        # the lease stayed ctl1's, same epoch: ctl2 never took it while ctl1 renewed it
        assert before.splitlines()[0].split(" expires")[0] == after.splitlines()[0].split(" expires")[0], (before, after)
    finally:
        ha_cluster.node("ctl2", f"{venv}/bin/swapaware", "ha", "primary-off", "--config", conf)

