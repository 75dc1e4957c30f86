"""Same decisions (issue 21, item 3): the admission table path against the service's own Admit.

The same generated jobs (tests/admission_jobs.py: seeded, every request shape, QoS, class state
and option) go to
  (a) the table path: the real publisher (admission/publish.py) of a real service over a
      real SQLite history, taught through the handler's own Admit / JobStarted / JobFinished path,
      read by the real lua5.1 running the real swapaware.lua + swapaware_table.lua (one Lua state
      per batch, tests/adapter/admission_diff_driver.lua), and
  (b) PolicyHandler.admit() of that service with the facts the plugin built (M.facts) and the same
      queue state (the queue monitor's snapshot the gate file was written from).
For every job the Lua path either declined (took the RPC path) or set exactly what Admit's reply
sets (tres_* fields, tres_bind, site factor, every AdminComment field but id and tbl, the user's
message). It declines exactly for the keys the table does not hold, and every job whose key the
table holds is decided by the table. Queue states: no snapshot yet, short, mixed (per QoS: short,
normal and long at once), long, and stale (a gate file past valid_until: "unknown" in Lua, a stale
snapshot in decide()); modes enforce and shadow; the GRES spelling and dialect of 22.05, 24.11
and 26.05. The hit rate per shape is printed (-s).

The harness (fixtures, Lua runner, training, gate reads) is differential_harness.py's; the archived
templates against what Admit records: test_admission_differential_archive.py."""
from __future__ import annotations

import collections
import json
import re
import time

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.config import PolicyMode
from policy_service.core import admission
from policy_service.core.admission_format import read_table
from policy_service.serving.handler_error import HandlerError
from tests import admission_jobs as gen
from tests.waiting import wait_for

from tests.adapter.admission.test_admission_publish import rpc_set
from tests.adapter.admission.differential_harness import (POOL, QUEUES, SEED, TIME_LIMITS, gate_state,  # noqa: F401
                                                          lua_set, plugin_conf, queue_state_of, release, run_lua,
                                                          svc, to_facts, train, unversioned, wait_gate)  # (fixtures)

_TOKEN = re.compile(r"^swapaware:v1 id=([0-9a-f]{16}) tbl=([0-9a-f]{16}):([0-9]{7})([snlua]) ")


# ----------------------------------------------------------------------------- the test
def test_the_table_path_decides_as_admit_or_declines(svc, slurm_jobs, tmp_path, release):
    s = svc
    release, jobs_per_phase, phases, learn_at = release
    h, publisher = s.handler, s.admission_publisher
    conf = plugin_conf(tmp_path, publisher.table, release)
    t0 = time.monotonic()

    pool = gen.spec_pool(SEED, POOL, release)
    users = sorted({gen.class_user(state, n) for state in gen.CLASS_STATES for n in range(gen.USERS_PER_STATE)})
    base_jobs = [gen.job_desc("gres_untyped", u, "", "plain", release=release) for u in users]
    facts_out, _ = run_lua(tmp_path, conf, [sp.job for sp in pool] + base_jobs, facts_only=True)
    pool_facts = [to_facts(o["facts"]) for o in facts_out[:len(pool)]]
    pool_keys = [o["key"] for o in facts_out[:len(pool)]]
    assert len(set(pool_keys)) == len(pool)  # distinct specs are distinct keys
    for f, key in zip(pool_facts, pool_keys):
        assert admission.table_key(f) == key  # the plugin's key is the service's
    base_facts = {u: to_facts(o["facts"]) for u, o in zip(users, facts_out[len(pool):])}
    train(s, slurm_jobs, base_facts)

    # the keys the history holds: trained ones and the held specs (Admit recorded them)
    refused = set()
    for sp, f, key in zip(pool, pool_facts, pool_keys):
        if sp.held and sp.shape != "no_gpu":
            try:
                h.admit(pb.AdmitRequest(job=f))
            except HandlerError:
                refused.add(key)
    h.flush()
    recorded = {admission.table_key(pb.JobFacts.FromString(r.facts_pb)) for r in h.store.decisions()}
    t_setup = time.monotonic() - t0

    order = gen.draw_jobs(pool, jobs_per_phase * len(phases), SEED + 1)
    per_qos = h.cfg.policy.queue_per_qos
    stats = collections.defaultdict(collections.Counter)  # shape -> counts
    by_state = collections.Counter()
    by_class = collections.defaultdict(collections.Counter)
    actions = collections.Counter()
    by_option, by_qos, sources = collections.Counter(), collections.Counter(), collections.Counter()
    mismatches: list = []
    mode = None
    relearned = dropped = window_jobs = window_hits = other_limit = 0
    t_lua = t_admit = 0.0
    for n, (phase_mode, queue) in enumerate(phases):
        if queue in QUEUES:
            slurm_jobs.pending = QUEUES[queue]
            h.queue.poll_once()  # the snapshot and the gate file now, rather than at the monitor's
            publisher.write_gate()  # next poll and the publisher's next tick
            want = {"short": ({"high": "short", "low": "short", "normal": "short", gen.PROTECTED_QOS: "short"},
                              "short"),
                    "mixed": ({"high": "short", "low": "long", "normal": "normal", gen.PROTECTED_QOS: "short"},
                              "long"),
                    "long": ({"high": "long", "low": "long", "normal": "long", gen.PROTECTED_QOS: "long"},
                             "long")}[queue]
            gate_doc = wait_gate(s, {"views": want[0], "other": want[1]}, queue)
        else:
            if queue in ("stale", "stopped"):
                slurm_jobs.pending = None  # squeue fails from now on: the last snapshot ages
                # The monitor's poll that read the queue before is over, its snapshot kept and its gate
                # written, once the monitor reads it again (its polls run one after another). Stopping
                # the publisher first let such a poll keep a snapshot newer than the gate it froze: the
                # gate past valid_until while the snapshot was 2 polls old (CI, 26.05).
                reads = slurm_jobs.queue_reads
                wait_for(lambda: slurm_jobs.queue_reads > reads, 20.0, "the queue monitor's next squeue")
            if queue == "stopped":
                publisher.stop()  # nothing rewrites the gate file from now on
                last = json.loads(publisher.gate.read_text())
            wait_for(lambda: publisher.gate.exists() and time.time() > json.loads(
                publisher.gate.read_text())["valid_until"] + 0.05, 20.0, "the gate file past valid_until")
            snap = h.queue.snapshot()
            assert snap is None if queue == "none" else snap.age_s > 3 * h.cfg.policy.queue_poll_s
            gate_doc = json.loads(publisher.gate.read_text())
            if queue == "stopped":  # the Lua's "unknown" comes from valid_until alone
                assert gate_doc == last and "unknown" not in set(gate_doc["views"].values()) | {gate_doc["other"]}
        learns = phase_mode == mode and n == learn_at
        if phase_mode != mode:
            mode = phase_mode
            h.set_mode(PolicyMode(mode))
            publisher.publish(f"differential test: mode {mode}")
        windows = ("published",)
        if learns:  # classes learn: the window before the next build, then the
            before = unversioned(publisher.table)  # build that decides their keys again
            train(s, slurm_jobs, base_facts, round_=1)
            dropped = len(before) - len(unversioned(publisher.table))
            assert dropped > 0  # each acknowledged observation dropped its class's entries at once
            windows = ("learned, not rebuilt", "rebuilt")
        for window in windows:
            if window == "rebuilt":
                publisher.publish("differential test: classes learned")
                relearned = sum(1 for k, v in unversioned(publisher.table).items() if k in before and v != before[k])
                assert relearned > 0  # what was learned changed some keys' decisions
            table = read_table(publisher.table.read_bytes())
            assert (table["mode"], table["per_qos"], table["dialect"]) == (mode, per_qos, release)
            entries = table["entries"]
            if n == 0:  # every recorded key Admit did not refuse is published
                missing = {k for k in recorded if k not in entries} - refused
                assert not missing, f"{len(missing)} recorded keys are not in the table"
            idx = order[n * jobs_per_phase:(n + 1) * jobs_per_phase]
            started = time.monotonic()
            # each job with a time limit of its own: the entry was decided for the spec's (60 min);
            # the time limit is no part of the key, and Admit must decide the job alike
            limits = [TIME_LIMITS[(i + n) % len(TIME_LIMITS)] for i in idx]
            outs, counters = run_lua(tmp_path, conf, [dict(pool[i].job, time_limit=lim) for i, lim in zip(idx, limits)])
            t_lua += time.monotonic() - started
            now = time.time()
            after = json.loads(publisher.gate.read_text())  # the gate did not move while the batch ran
            assert (now > after["valid_until"]) == (queue not in QUEUES)
            if queue in QUEUES:
                assert (after["views"], after["other"]) == (gate_doc["views"], gate_doc["other"])
            started = time.monotonic()
            for i, out, lim in zip(idx, outs, limits):
                sp, key = pool[i], pool_keys[i]
                assert out["key"] == key
                st = stats[sp.shape]
                st["jobs"] += 1
                assert out["wants_gpu"] == (sp.shape not in ("no_gpu", "shards")), sp
                if not out["wants_gpu"]:
                    # no GPU asked (no GPU, or shards already): the plugin lets it through, asking nobody
                    assert not out["rpc"] and out.get("set") is None
                    continue
                state = gate_state(after, sp.qos, per_qos, now)
                window_jobs += window == "learned, not rebuilt"
                entry = entries.get(key)
                decision = None if entry is None else entry.get(state, entry.get(admission.ALL_STATES))
                st["held"] += decision is not None
                if out["rpc"]:
                    st["rpc"] += 1
                    assert decision is None, (sp, state, "the table holds it but the plugin took the RPC path")
                    continue
                assert decision is not None, (sp, state, "decided by the table without an entry")
                st["hit"] += 1
                other_limit += lim != sp.job["time_limit"]
                window_hits += window == "learned, not rebuilt"
                by_state[state] += 1
                by_class[sp.class_state]["hit"] += 1
                by_option[sp.variant] += 1
                by_qos[sp.qos] += 1
                assert "set" in out, (sp, state, out)
                m = _TOKEN.match(out["set"]["admin_comment"])
                assert m and m.group(2) == table["version"] and int(m.group(3)) == entry["i"], out["set"]["admin_comment"]
                assert m.group(4) in (admission.STATE_LETTER[state], "a"), (state, m.group(4))
                d = h.admit(pb.AdmitRequest(job=to_facts(out["facts"]), dry_run=True)).decision
                got, want_set = lua_set(out["set"]), rpc_set(d)
                if got != want_set or out["user"] != ([d.rewrite.user_message] if d.rewrite.user_message else []):
                    mismatches.append((mode, queue, state, sp.shape, sp.class_state, sp.qos, sp.variant, got, want_set,
                                       out["user"], d.rewrite.user_message))
                actions[(mode, got["admin_comment"].get("action"))] += 1
                sources[(sp.class_state, got["admin_comment"].get("src"))] += 1
            t_admit += time.monotonic() - started
            assert counters["table_hit"] == sum(1 for o in outs if not o["rpc"] and o.get("set") is not None)
            if queue not in QUEUES:  # still past valid_until after Admit decided: the same state
                assert time.time() > json.loads(publisher.gate.read_text())["valid_until"]
            else:
                assert queue_state_of(h) == (gate_doc["views"], gate_doc["other"])

    print(f"\nadmission differential, Slurm {release}: {len(order)} jobs of {len(pool)} keys, {len(phases)} phases "
          f"(setup {t_setup:.1f} s, lua {t_lua:.1f} s, admit {t_admit:.1f} s)")
    print(f"table hits with a time limit other than their entry's job's: {other_limit}")
    print(f"entries dropped by observations before the next build: {dropped}; decided again by it: {relearned}; "
          f"jobs in the window between: {window_jobs} ({window_hits} from the table)")
    print(f"{'shape':18} {'jobs':>6} {'held':>6} {'hit':>6} {'rpc':>6} {'hit%':>6}")
    for shape in gen.SHAPES:
        st = stats[shape]
        gpu_jobs = st["jobs"] if shape not in ("no_gpu", "shards") else 0
        print(f"{shape:18} {st['jobs']:6d} {st['held']:6d} {st['hit']:6d} {st['rpc']:6d} "
              f"{(100 * st['hit'] / gpu_jobs if gpu_jobs else 0):6.1f}")
    print("hits by gate state:", dict(by_state), " by class state:", {k: v["hit"] for k, v in by_class.items()})
    print("hits by option:", dict(by_option), " by qos:", dict(by_qos))
    print("actions:", dict(actions))
    print("estimate sources by class state:", dict(sorted(sources.items())))
    assert not mismatches, f"{len(mismatches)} jobs decided differently, first: {mismatches[:3]}"
    assert other_limit > 0
    assert window_hits > 0 and window_hits < window_jobs  # the window was tried, with entries kept and dropped
    # the table covered a meaningful share: every common shape and class state hit in every gate state
    gpu = sum(stats[sh]["jobs"] for sh in gen.SHAPES if sh not in ("no_gpu", "shards"))
    hits = sum(stats[sh]["hit"] for sh in gen.SHAPES)
    assert gpu >= 0.7 * len(order) and hits >= gpu / 2, (hits, gpu)
    for shape in gen.COMMON_SHAPES:
        assert stats[shape]["hit"] > 0 and stats[shape]["rpc"] > 0, shape
    assert set(by_state) == {"short", "normal", "long", "unknown"}
    assert set(by_class) == set(gen.CLASS_STATES) and set(by_option) == set(gen.VARIANTS)
    assert set(by_qos) == set(gen.QOSES)
    # the decisions differ from one another (the table is not one answer for all)
    assert {a for (m_, a) in actions if m_ == "enforce"} >= {"share", "whole_gpu"}
