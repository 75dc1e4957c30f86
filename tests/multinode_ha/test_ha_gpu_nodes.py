"""Issue 32 item 10: GPU nodes stay in service across takeovers and hand-backs with GPU jobs running.

Measured on Slurm 24.11.5 (docs/slurm-releases.md, "Two controllers"): with a node's `Gres=` in
slurm.conf listing its shards untyped (`shard:24`) while gres.conf types them (a shard takes its
GPU's type through the same `File=`), the backup taking control set every node INVAL and DRAIN when
it registered, "gres/shard type (a100) reported but not configured"; where jobs ran, the drain
outlived the hand-back and no job started there until an admin resumed the node. The dev cluster
types the shards in both files (contrib/dev-cluster/config.sh). Each switch here waits until every
node registered with the controller now in control (SlurmdStartTime, which reads None until then)
and a new GPU job ran on each node, and then requires every node in service."""
from __future__ import annotations

import os
import re
import time
import uuid

from tests.multinode_ha.controllers import in_control, restore_primary, takeover, unanswered
from tests.slurm_stack import Stack, job_field
from tests.waiting import wait_for

ROUNDS = int(os.environ.get("SWAPAWARE_HA_ROUNDS", "3"))  # takeovers and hand-backs (more: a stress run of them)
BAD_REASON = "reported but not configured"
OUT_OF_SERVICE = ("drain", "inval", "down", "fail")  # sinfo %T words of a node that takes no new job


def sinfo_nodes(stack: Stack) -> dict[str, tuple[str, str, str]]:
    """node -> (state, reason, GRES) as the controller in control shows them (sinfo %T, %E, %G)."""
    out = stack.run("sinfo", "-h", "-N", "-o", "%N|%T|%E|%G", check=False).stdout
    return {f[0]: (f[1], f[2], f[3]) for f in (ln.split("|", 3) for ln in out.splitlines()) if len(f) == 4}


def out_of_service(stack: Stack) -> dict[str, str]:
    """The nodes that take no new job (drained, draining, invalid, down), or name the GRES mismatch."""
    return {n: f"{st} ({why})" for n, (st, why, _) in sinfo_nodes(stack).items()
            if any(w in st for w in OUT_OF_SERVICE) or BAD_REASON in why}


def slurmd_start_times(stack: Stack) -> dict[str, str]:
    """node -> SlurmdStartTime ("None" until its slurmd registered with the controller in control)."""
    out = stack.run("scontrol", "show", "node", "-o", check=False).stdout
    times = {}
    for line in out.splitlines():
        name, started = re.match(r"NodeName=(\S+)", line), re.search(r"\bSlurmdStartTime=(\S+)", line)
        if name:
            times[name.group(1)] = started.group(1) if started else "None"
    return times


def registered(stack: Stack, nodes: list[str]) -> bool:
    """Every node's slurmd registered with the controller in control and answers it."""
    times, states = slurmd_start_times(stack), sinfo_nodes(stack)
    return all(times.get(n, "None") != "None" and n in states and not states[n][0].startswith("unk")
               and not states[n][0].endswith("*") for n in nodes)


def job_state(stack: Stack, job: int) -> str:
    return job_field(stack.run("scontrol", "show", "job", "-o", str(job), check=False).stdout, "JobState")


def submit(stack: Stack, node: str, gres: str, name: str, wrap: str) -> int:
    out = stack.run("sbatch", "--parsable", f"--nodelist={node}", gres, f"--job-name={name}",
                    f"--chdir={stack.state}", "--wrap", wrap, timeout=120).stdout
    return int(out.strip().split(";")[0])


def test_takeovers_and_hand_backs_with_gpu_jobs_running_keep_gpu_nodes_in_service(ha_cluster: Stack) -> None:
    stack, tag = ha_cluster, uuid.uuid4().hex[:6]
    restore_primary(stack)
    nodes = sorted(sinfo_nodes(stack))
    assert len(nodes) >= 2, nodes
    wait_for(lambda: registered(stack, nodes) and not out_of_service(stack), 60,
             lambda: f"every node registered and in service with ctl1 in control: {sinfo_nodes(stack)}", 0.5)
    jobs: list[int] = []
    try:
        # On each node a job holding shards and one asking for a GPU (swapaware may share it), running
        # through every switch: a controller that takes control recovers them with the nodes.
        long = [submit(stack, n, g, f"ha-gn-{tag}-{n}-{i}", "sleep 3600")
                for n in nodes for i, g in enumerate(("--gres=shard:1", "--gres=gpu:1"))]
        jobs += long
        wait_for(lambda: all(job_state(stack, j) == "RUNNING" for j in long), 90,
                 lambda: f"the long jobs running: {[(j, job_state(stack, j)) for j in long]}\n{stack.queue_and_gres()}",
                 0.5)

        lines: list[str] = []

        def switch(what: str, act, ctl: str) -> None:
            t0 = time.monotonic()
            act()
            wait_for(lambda: in_control(stack) == ctl, 90, f"{ctl} in control after the {what}", 0.3)
            t_ctl = time.monotonic() - t0
            wait_for(lambda: registered(stack, nodes), 90,
                     lambda: f"every node registered with {ctl} after the {what}: {slurmd_start_times(stack)} "
                             f"{sinfo_nodes(stack)}" + unanswered(stack), 0.5)
            t_reg = time.monotonic() - t0
            # a new GPU job on each node, on the controller now in control: it runs where the node is in service
            probes = [submit(stack, n, "--gres=gpu:1", f"ha-gn-{tag}-{what[:4]}-{n}", "true") for n in nodes]
            jobs.extend(probes)
            wait_for(lambda: all(job_state(stack, j) == "COMPLETED" for j in probes) or out_of_service(stack), 90,
                     lambda: f"the new jobs completed after the {what}: {[(j, job_state(stack, j)) for j in probes]}"
                             f"\n{stack.queue_and_gres()}", 0.5)
            seen = sinfo_nodes(stack)
            lines.append(f"{what}: {ctl} in control +{t_ctl:.1f} s, nodes registered +{t_reg:.1f} s, new jobs "
                         f"{[job_state(stack, j) for j in probes]}; sinfo: "
                         + ", ".join(f"{n} {st} {gres}" for n, (st, _, gres) in sorted(seen.items())))
            bad = out_of_service(stack)
            assert not bad, f"after the {what} with {ctl} in control, nodes out of service: {bad}\n" + "\n".join(lines)
            assert all(job_state(stack, j) == "RUNNING" for j in long), \
                f"the long jobs after the {what}: {[(j, job_state(stack, j)) for j in long]}"

        for n in range(1, ROUNDS + 1):
            switch(f"takeover {n}", lambda: takeover(stack), "ctl2")
            switch(f"hand-back {n}", lambda: restore_primary(stack), "ctl1")
        print("\n[ha] GPU nodes across takeovers with jobs running:\n  " + "\n  ".join(lines))
    finally:
        if jobs:
            stack.run("scancel", *map(str, jobs), check=False)
        # leave the session's cluster usable for the tests after this one, whatever happened here
        for node in out_of_service(stack):
            stack.run("scontrol", "update", f"nodename={node}", "state=resume", check=False)
