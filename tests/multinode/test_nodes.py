"""A controller and three compute nodes: jobs spread over the nodes and every node's observations are
learned; a multi-node job stays whole; a partitioned node, a service outage and a failed node lose
no observation and count none twice. Delivery times are printed (``-s`` shows them)."""
from __future__ import annotations

import os
import signal
import time
import uuid

from tests.slurm_stack import GIB, decision_of, fake_alloc_script, job_field
from tests.waiting import wait_for

from .conftest import NODES


def wait_running(cluster, job_id: int, timeout_s: float = 60) -> str:
    """The node the job runs on, once it runs."""
    def node() -> str | None:
        line = cluster.show_job(job_id)
        return job_field(line, "NodeList") if job_field(line, "JobState") == "RUNNING" else None

    return wait_for(node, timeout_s, lambda: f"job {job_id} to run: {cluster.show_job(job_id)}", 0.3)


def spooled(cluster, node: str) -> list:
    spool = cluster.node_dir(node) / "spool"
    return sorted(spool.glob("*.json")) if spool.is_dir() else []


def started(cluster, job_id: int, node: str) -> bool:
    with cluster.history() as db:
        return db.execute("SELECT 1 FROM runs WHERE job_id=? AND node=?", (job_id, node)).fetchone() is not None


def test_jobs_spread_over_the_nodes_and_each_node_is_learned(cluster):
    """A whole node's GPUs per job: six jobs land two on each node; each node's agent measured what
    the job allocated there, and the service learned every one."""
    gib = {}
    jobs = []
    for i in range(6):
        gib_i = 1 + i % 3
        job = cluster.sbatch(fake_alloc_script(cluster, gib_i, hold_s=1.0), "--gres=gpu:4",
                             f"--job-name=spread-{uuid.uuid4().hex[:6]}")
        jobs.append(job)
        gib[job] = gib_i
    nodes = {}
    for job in jobs:
        assert cluster.wait_done(job) == "COMPLETED"
        nodes[job] = cluster.run("sacct", "-X", "-n", "-P", "-j", str(job), "-o", "nodelist").stdout.strip()
    assert set(nodes.values()) == set(NODES), nodes
    for job in jobs:
        cluster.wait_observation(job)
        [(node, decision_id, peak, code)] = cluster.observations(job)
        assert node == nodes[job] and code == 0 and peak == gib[job] * GIB
        assert decision_id == decision_of(cluster.sacct_admin_comment(job))["id"]


def test_multi_node_job_stays_whole_and_each_node_reports(cluster):
    name = f"wide-{uuid.uuid4().hex[:6]}"
    job = cluster.sbatch(fake_alloc_script(cluster, 2, hold_s=1.0), "-N", "3", "--gres=gpu:1", f"--job-name={name}")
    line = cluster.show_job(job)
    decision = decision_of(job_field(line, "AdminComment"))
    assert decision["action"] != "share", line
    assert cluster.gres("gpu", 1) in job_field(line, "TresPerNode") and "shard" not in job_field(line, "TresPerNode")
    assert cluster.wait_done(job) == "COMPLETED"
    rows = wait_for(lambda: (r := cluster.observations(job)) and len(r) == 3 and r, 60,
                    lambda: f"three observations of job {job}: {cluster.observations(job)}", 0.3)
    assert [r[0] for r in rows] == list(NODES)
    assert {r[1] for r in rows} == {decision["id"]}
    # The batch script (and its allocation) ran on the first node only.
    assert [r[2] for r in rows] == [2 * GIB, 0, 0]
    explained = cluster.swapaware("explain", str(job)).stdout
    assert decision["id"] in explained
    # Kept, not learned: one node's part is not the job's peak, and the policy never shares such jobs.
    with cluster.history() as db:
        [(job_class,)] = db.execute("SELECT job_class FROM decisions WHERE decision_id=?", (decision["id"],))
        assert db.execute("SELECT stats_json FROM class_stats WHERE level='class' AND key=?",
                          (job_class,)).fetchall() == []


def not_responding(cluster, node: str) -> bool:
    state = job_field(cluster.run("scontrol", "show", "node", "-o", node).stdout, "State")
    return "NOT_RESPONDING" in state or state.endswith("*") or state.startswith("DOWN")


def test_partitioned_node_reports_its_job_once_when_it_is_back(cluster):
    """node2 loses the controller's network (its link down) while its job ends. Measured on every
    release: slurmd runs a batch job's epilog only when slurmctld's terminate request reaches it,
    so nothing is produced during the partition; once the link is back the job ends (COMPLETED,
    or NODE_FAIL if Slurm declared the node down meanwhile) and its one observation arrives."""
    job = cluster.sbatch(fake_alloc_script(cluster, 3, hold_s=3.0), "--gres=gpu:1", "-w", "node2", "--no-requeue",
                         f"--job-name=part-{uuid.uuid4().hex[:6]}")
    assert wait_running(cluster, job) == "node2"
    wait_for(lambda: started(cluster, job, "node2"), 30, f"job {job}'s start to be recorded", 0.2)
    cluster.node("node2", "ip", "link", "set", "eth0", "down")
    try:
        wait_for(lambda: not_responding(cluster, "node2"), 90, "slurmctld to see node2 not responding", 0.5)
        assert cluster.observations(job) == []
    finally:
        cluster.node("node2", "ip", "link", "set", "eth0", "up")
    t0 = time.monotonic()
    wait_for(lambda: cluster.observations(job), 120, lambda: f"job {job}'s observation after the partition; "
             f"hooks log: {(cluster.state / 'log' / 'hooks.log').read_text()[-2000:]}", 0.2)
    print(f"\npartition: job {job}'s observation arrived {time.monotonic() - t0:.1f}s after the link came back")
    assert cluster.wait_done(job) in ("COMPLETED", "NODE_FAIL")
    [(node, _d, peak, _code)] = cluster.observations(job)
    assert (node, peak) == ("node2", 3 * GIB)
    wait_for(lambda: not spooled(cluster, "node2"), 30, "node2's spool to be empty", 0.2)
    cluster.run("scontrol", "update", "nodename=node2", "state=resume", check=False)
    wait_for(lambda: not not_responding(cluster, "node2"), 90, "node2 to answer again", 0.5)


def agent_pid(cluster, node: str) -> int | None:
    try:
        return int((cluster.node_dir(node) / "agent.pid").read_text())
    except (OSError, ValueError):
        return None


def test_service_outage_every_node_replays_once(cluster):
    """With the service down, jobs run on every node and their hooks spool starts and finishes; node3
    goes down for swapaware too (its agent stops). Once the service is back, node1's and node2's
    agents deliver what they spooled on their own, each event once, with no new job to trigger it;
    node3's events wait on its spool until its agent is back, then arrive once."""
    per_node = 6
    held = {(n, k): cluster.sbatch(fake_alloc_script(cluster, 1, hold_s=0.2), "--hold", "--gres=gpu:1", "-w", n,
                                   f"--job-name=outage-{n}-{uuid.uuid4().hex[:6]}")
            for n in NODES for k in range(per_node)}
    up, down = NODES[:2], NODES[2]
    cluster.stack("service-stop")
    try:
        cluster.run("scontrol", "release", *map(str, held.values()))
        for (node, _k), job in held.items():
            assert cluster.wait_done(job) == "COMPLETED"
        for node in NODES:
            wait_for(lambda: len(spooled(cluster, node)) >= 2 * per_node, 60,
                     lambda: f"{node}'s hooks to spool {2 * per_node} events: {spooled(cluster, node)}", 0.3)
        pid = agent_pid(cluster, down)
        assert pid is not None
        os.kill(pid, signal.SIGTERM)
        wait_for(lambda: not os.path.exists(f"/proc/{pid}"), 30, f"{down}'s agent to stop", 0.1)
    finally:
        cluster.stack("service-start")
        t0 = time.monotonic()
    for (node, _k), job in held.items():
        if node in up:
            wait_for(lambda: cluster.observations(job), 120, f"job {job}'s observation from {node}", 0.1)
    took = time.monotonic() - t0
    events = 2 * per_node * len(up)
    print(f"\nservice outage: {events} spooled events on {len(up)} nodes delivered {took:.1f}s after the service "
          f"was back ({events / took:.0f} events/s end to end)")
    assert len(spooled(cluster, down)) >= 2 * per_node  # its agent is down: nothing replays there
    cluster.stack("up", "--nodes", str(len(NODES)))  # node3's agent back
    t1 = time.monotonic()
    for (node, _k), job in held.items():
        if node == down:
            wait_for(lambda: cluster.observations(job), 120, f"job {job}'s observation from {node}", 0.1)
    print(f"service outage: {down}'s {2 * per_node} events delivered {time.monotonic() - t1:.1f}s after its agent "
          f"was back")
    for (node, _k), job in held.items():
        assert [r[0] for r in cluster.observations(job)] == [node]
        assert started(cluster, job, node)
    for node in NODES:
        wait_for(lambda: not spooled(cluster, node), 30, f"{node}'s spool to be empty", 0.2)


def test_failed_node_loses_nothing_and_counts_nothing_twice(cluster):
    """node3's slurmd is killed while its job runs: Slurm ends the job NODE_FAIL. The start was
    recorded once; whatever the node says when it comes back is recorded at most once."""
    job = cluster.sbatch(fake_alloc_script(cluster, 2, hold_s=300.0), "--gres=gpu:1", "-w", "node3", "--no-requeue",
                         f"--job-name=fail-{uuid.uuid4().hex[:6]}")
    assert wait_running(cluster, job) == "node3"
    wait_for(lambda: started(cluster, job, "node3"), 30, f"job {job}'s start to be recorded", 0.2)
    pid = (cluster.node_dir("node3") / "slurmd.pid").read_text().strip()
    cluster.node("node3", "kill", "-KILL", pid)
    try:
        assert cluster.wait_done(job, timeout_s=120) == "NODE_FAIL"
    finally:
        cluster.stack("up", "--nodes", str(len(NODES)))  # slurmd back on node3 (and nothing else changed)
        cluster.run("scontrol", "update", "nodename=node3", "state=resume", check=False)
    wait_for(lambda: job_field(cluster.run("scontrol", "show", "node", "-o", "node3").stdout, "State")
             .startswith("IDLE"), 90, "node3 to be idle again", 0.5)
    # Whatever node3's epilog sends now arrives once; nothing of the job is counted twice, and no
    # event of the node was refused.
    rows = cluster.observations(job)
    assert len(rows) <= 1 and all(r[0] == "node3" for r in rows), rows
    rejected = cluster.node_dir("node3") / "spool" / "rejected"
    assert not rejected.exists() or not list(rejected.iterdir())
