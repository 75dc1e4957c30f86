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
and 26.05. The hit rate per shape is printed (-s)."""
from __future__ import annotations

import collections
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from google.protobuf import json_format

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.slurm.slurm import PendingJob
from policy_service.config import PolicyMode, load_config
from policy_service.core import admission
from policy_service.core.admission_format import read_table
from policy_service.core.types import ReasonCode
from policy_service.serving.handler_error import HandlerError
from policy_service.serving.server import start_service
from tests import admission_jobs as gen
from tests.waiting import wait_for

from tests.adapter.admission.test_admission_publish import plain, rpc_set

ROOT = Path(__file__).resolve().parents[3]
DRIVER = Path(__file__).parents[1] / "admission_diff_driver.lua"
GIB = 1024 ** 3
UID = 1000
SEED = 21
POOL = 1500  # distinct jobs (keys)
POLL_S = 1.5  # policy.queue_poll_s: the gate file is valid 3 x this after its snapshot

if shutil.which("lua5.1") is None or subprocess.run(["lua5.1", "-e", 'require("posix.sys.stat") require("cjson")'],
                                                     capture_output=True).returncode != 0:
    if os.environ.get("CI"):
        raise RuntimeError("lua5.1 with lua-posix and lua-cjson is missing: contrib/dev-cluster/cluster.sh install")
    pytest.skip("lua5.1 with lua-posix and lua-cjson not installed", allow_module_level=True)

# (mode, queue) in the order they run; "none": no snapshot was ever taken, "stale": the last one
# is older than 3 x queue_poll_s (the publisher rewrites the gate file naming every view
# "unknown"), "stopped": the same with the publisher stopped first (the service died): the gate
# file still names the last states, past its valid_until
ALL_PHASES = (("enforce", "none"), ("enforce", "short"), ("enforce", "mixed"), ("enforce", "long"),
              ("enforce", "stale"), ("shadow", "short"), ("shadow", "mixed"), ("shadow", "long"),
              ("shadow", "stopped"))
# the other releases wait out 3 x queue_poll_s once, not twice (a release's own part is its keys and
# rewrites, not how the gate goes stale)
FEWER_PHASES = ALL_PHASES[:4] + ALL_PHASES[5:]
# (release, jobs per phase, phases, the phase before which classes learn more and the table is
# published again: same mode as the phase before it): 12,600 jobs spelled as 22.05 spells them,
# 4,000 each as 24.11 and 26.05 do
RELEASES = (("22.05", 1400, ALL_PHASES, 4), ("24.11", 500, FEWER_PHASES, 3), ("26.05", 500, FEWER_PHASES, 3))


# time limits the differential jobs carry in turn (minutes; NO_VAL: none given)
TIME_LIMITS = (gen.NO_VAL, 1, 60, 240, 1440, 43200)

def pending(gpus_by_qos: dict[str, int]) -> list[PendingJob]:
    out, n = [], 0
    for qos, gpus in gpus_by_qos.items():
        for _ in range(gpus):
            n += 1
            out.append(PendingJob(9000 + n, "gres:gpu:1", "", "", 1, 1, "Resources", qos))
    return out


# 4 GPUs; share_min_queue 0.25, overcommit_compute_min_queue 0.75 (the fixture's env)
QUEUES = {
    "short": pending({}),
    # ahead of high and protected: 0 (short); of normal: 2 of 4 (normal); of low and of any QoS
    # not in the QoS table, the whole queue: 4 of 4 (long)
    "mixed": pending({"normal": 2, "low": 2}),
    "long": pending({"high": 8}),
}


@pytest.fixture(params=RELEASES, ids=[r[0] for r in RELEASES])
def release(request):
    return request.param


@pytest.fixture
def svc(service_env, slurm_jobs, tmp_path, release):
    (tmp_path / "run").mkdir()
    env = dict(service_env, SWAPAWARE_SERVICE__SLURM_RELEASE=release[0], SWAPAWARE_ADMISSION__TABLE_PATH=str(tmp_path / "run" / "admission.json"),
               SWAPAWARE_ADMISSION__REFRESH_S="1000", SWAPAWARE_ADMISSION__VALID_S="3000",
               SWAPAWARE_POLICY__SHARE_MIN_QUEUE="0.25", SWAPAWARE_POLICY__OVERCOMMIT_COMPUTE_MIN_QUEUE="0.75",
               SWAPAWARE_POLICY__QUEUE_POLL_S=str(POLL_S), SWAPAWARE_POLICY__WHOLE_GPU_QOS=gen.PROTECTED_QOS,
               SWAPAWARE_ESTIMATOR__MIN_SAMPLES="3")
    slurm_jobs.qos_table = dict(gen.QOS_PRIORITIES)
    slurm_jobs.pending = None  # squeue fails until a phase gives it a queue: no snapshot yet
    s = start_service(load_config(env=env), slurm=slurm_jobs)
    try:
        yield s
    finally:
        s.stop(0)


def plugin_conf(tmp_path: Path, table: Path, release: str) -> Path:
    conf = tmp_path / "etc"
    conf.mkdir(exist_ok=True)
    (conf / "swapaware_plugin.conf").write_text(
        f"socket={tmp_path}/none.sock\ntable={table}\ntable_check_ms=0\ntable_uids=0,{os.getuid()}\n"
        f"slurm_release={release}\n")
    return conf


def run_lua(tmp_path: Path, conf: Path, jobs: list[dict], facts_only: bool = False) -> tuple[list[dict], dict]:
    """One Lua state over ``jobs``: one answer per job, and the table path's counters."""
    path = tmp_path / "jobs.jsonl"
    path.write_text("".join(json.dumps({"job": j, "uid": UID}) + "\n" for j in jobs))
    args = ["lua5.1", str(DRIVER), str(ROOT / "slurm_plugin"), str(conf), str(path)] + (["facts"] if facts_only else [])
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(lines) == len(jobs) + 1, proc.stderr
    for out in lines[:-1]:
        out["user"] = out.get("user") or []  # lua-cjson writes an empty list as {}
    return lines[:-1], lines[-1]["counters"]


def to_facts(lua_facts: dict) -> pb.JobFacts:
    return json_format.ParseDict(lua_facts, pb.JobFacts())


# ----------------------------------------------------------------------------- the history
def train(s, slurm_jobs, base_facts: dict[str, pb.JobFacts], round_: int = 0) -> None:
    """Teach the class states through the handler's own Admit / JobStarted / JobFinished path.
    Round 0 makes them (users of state "unknown" run nothing); round 1, after the table was
    published, moves some (few -> enough, an OOM of a shared run for "enough", the first runs
    of "unknown0", compute-bound runs for "util"), so the publisher must decide those keys again."""
    h = s.handler
    job_id = 100 + 1000 * round_
    enforcement = pb.NodeEnforcement(backend="nvml-cgroup", hard_cap=True, victim=True)

    def run(facts, peak, util=None, oom=False):
        nonlocal job_id
        job_id += 1
        d = h.admit(pb.AdmitRequest(job=facts)).decision
        slurm_jobs.comments[job_id] = d.rewrite.admin_comment
        start = 1000.0 + 100 * job_id
        h.job_started(pb.JobStartedRequest(job_id=job_id, node="n1", gpu_indices=[job_id % 4], started_at=start,
                                           event_id=f"s{job_id}", enforcement=enforcement))
        fin = pb.JobFinishedRequest(job_id=job_id, node="n1", gpu_indices=[job_id % 4], finished_at=start + 60,
                                    exit_code=1 if oom else 0, event_id=f"f{job_id}", oom_detected=oom,
                                    peak_gpu_bytes=peak, telemetry_source="fake-nvml")
        if util is not None:
            fin.gpus.append(pb.GpuUsage(gpu_index=job_id % 4, peak_bytes=peak, util_mean_pct=util,
                                        total_bytes=80 * GIB))
        assert h.job_finished(fin).applied
        return d

    for user, facts in base_facts.items():
        state = user.rstrip("0123456789")
        if round_ == 0:
            if state == "few":
                run(facts, 3 * GIB)
            elif state == "enough":
                for peak in (3.0, 3.2, 2.8, 3.1):
                    run(facts, int(peak * GIB))
            elif state == "oom":
                for _ in range(4):
                    run(facts, 2 * GIB)
                assert run(facts, 4 * GIB, oom=True).action == pb.ACTION_SHARE  # a shared run's OOM: the penalty
            elif state == "util":
                for _ in range(4):
                    run(facts, 2 * GIB, util=62.0)
        elif state == "few":
            for _ in range(2):
                run(facts, 3 * GIB)
        elif state == "enough":
            run(facts, 5 * GIB, oom=True)
        elif user == "unknown0":
            for _ in range(3):
                run(facts, 1 * GIB)
        elif state == "util":
            for _ in range(2):
                run(facts, 2 * GIB, util=96.0)
    h.flush()


# ----------------------------------------------------------------------------- comparing
def lua_set(applied: dict) -> dict:
    out = dict(applied)
    out["admin_comment"] = plain(out["admin_comment"])
    return out


_TOKEN = re.compile(r"^swapaware:v1 id=([0-9a-f]{16}) tbl=([0-9a-f]{16}):([0-9]{7})([snlua]) ")


def wait_gate(s, want: dict, what: str) -> dict:
    """The gate file once it names ``want`` ({"views": ..., "other": ...})."""
    gate = s.admission_publisher.gate

    def read():
        try:
            doc = json.loads(gate.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        return doc if {"views": doc["views"], "other": doc["other"]} == want else None
    return wait_for(read, 20.0, f"gate file {what}: {want}")


def gate_state(doc: dict, qos: str, per_qos: bool, now: float) -> str:
    """The state the plugin reads for a job of ``qos`` (swapaware_table.lua's T.gate_state)."""
    if now > doc["valid_until"]:
        return "unknown"
    return doc["views"].get(qos if per_qos else "", doc["other"])


def unversioned(table: Path) -> dict[str, str]:
    """The class table's entries without the version in their tokens."""
    return {k: re.sub(r"tbl=[0-9a-f]{16}:", "tbl=", json.dumps(v, sort_keys=True))
            for k, v in read_table(table.read_bytes())["entries"].items()}


def queue_state_of(h) -> tuple[dict, str]:
    """The gate states decide() sees now (views and other), from the queue monitor's snapshot."""
    doc = admission.gate_file(h.queue.snapshot(), h.cfg, time.time())
    return doc["views"], doc["other"]


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
            if queue == "stopped":
                publisher.stop()  # nothing rewrites the gate file from now on
                last = json.loads(publisher.gate.read_text())
            if queue in ("stale", "stopped"):
                slurm_jobs.pending = None  # squeue fails from now on: the last snapshot ages
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


# The queue gate's reasons: Admit words them with the snapshot's figures, a table-made decision
# with the gate state the job was decided in (core/admission.template_reasons): compared by code.
QUEUE_FIGURE_CODES = {ReasonCode.QUEUE_SHORT.value, ReasonCode.COMPUTE_OVERCOMMITTED.value}


def record_view(decision_pb: bytes) -> dict:
    """A recorded decision as its user and `swapaware explain` see it, less what differs by
    construction between a table-made one and Admit's (id, time, the table token, the queue
    figures of the moment)."""
    d = pb.Decision.FromString(decision_pb)
    d.ClearField("decision_id")
    d.ClearField("decided_at")  # catch-up fills both in from Slurm
    for r in d.reasons:
        if r.code in QUEUE_FIGURE_CODES:
            r.message = ""
    d.rewrite.admin_comment = " ".join(f"{k}={v}" for k, v in sorted(plain(d.rewrite.admin_comment).items()))
    return json_format.MessageToDict(d)


@pytest.mark.parametrize("release", [("22.05", 0)], indirect=True)
def test_the_archived_template_is_what_admit_records(svc, slurm_jobs, release):
    """What catch-up records for a table-made decision (the archived template) is what Admit
    records for the same job in the same queue state, but for its id, time and table token."""
    s = svc
    h, publisher = s.handler, s.admission_publisher
    job = pb.JobFacts(user="enough0", account="proj", partition="gpu", job_name="train", tres_per_node="gres:gpu:1",
                      script_fingerprint="00000001deadbeef")
    train(s, slurm_jobs, {"enough0": job})  # a class that shares where the queue lets it
    pub = publisher.publish("test")
    entry = read_table(publisher.table.read_bytes())["entries"][admission.table_key(job)]
    seen, gated = set(), 0
    for queue in ("short", "mixed", "long"):
        slurm_jobs.pending = QUEUES[queue]
        h.queue.poll_once()
        state = queue_state_of(h)[1]  # the whole queue's (the job gives no QoS)
        slot = state if state in entry else admission.ALL_STATES
        template = s.admission_archive.lookup(pub.version, entry["i"], slot)
        d = h.admit(pb.AdmitRequest(job=job)).decision
        h.flush()
        recorded = h.store.decision(d.decision_id)
        seen.add(state)
        assert record_view(template.decision_pb) == record_view(recorded.decision_pb), state
        said = [r.message for r in pb.Decision.FromString(template.decision_pb).reasons if r.code in QUEUE_FIGURE_CODES]
        assert all(f"queue gate '{state}'" in m for m in said), (state, said)  # the state it was decided in
        gated += len(said)
    assert gated  # a queue reason was compared at all (the short queue keeps the GPU whole)
    assert seen == {"short", "long"}
