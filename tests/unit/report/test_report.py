"""``swapaware report``: pure join/aggregation on real-shaped ``sacct --json`` (Slurm 22.05) and a
real SQLite history written by the service's own handler and HistoryStore."""
from __future__ import annotations

import copy
import csv
import hashlib
import io
import json
import sqlite3
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from click.testing import CliRunner

from policy_service import report as R
from policy_service.report import command as report_cli
from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.history.store import HistoryStore
from policy_service.slurm.slurm import ClusterRelease, JobInstance, parse_sacct_instances, parse_sacct_json
from policy_service.core.dialect import parse_release
from policy_service.config import load_config
from policy_service.core.types import GresKind
from policy_service.serving.handler import PolicyHandler

GIB = 1024**3
T0 = 1_796_238_000

# `sacct --json -X --allusers -j 3` on the dev cluster (Slurm 22.05.8, slurmdbd + MariaDB): a job
# that swapaware rewrote from gpu:1 to shard:1. Shapes seen there: `comment.administrator` is null
# until the job ends; a pending job has `allocated: []` and start/end 0; a running one end 0.
REAL_SACCT = {
    'meta': {'plugin': {'type': 'openapi/dbv0.0.38', 'name': 'Slurm OpenAPI DB v0.0.38'},
             'Slurm': {'version': {'major': 22, 'micro': 8, 'minor': 5}, 'release': '22.05.8'}},
    'errors': [],
    'jobs': [{'account': 'root',
              'comment': {'administrator': 'swapaware:v1 id=83ca41d906784792 model=swapaware-model/1+248fdee9 '
                                           'action=share shards=1 pred=3.0GiB+0.3GiB src=class n=1 sf=0 '
                                           'why=fits_in_shards,estimate_from_history,priority_default',
                          'job': None,
                          'system': None},
              'allocation_nodes': 1,
              'array': {'job_id': 0, 'limits': {'max': {'running': {'tasks': 0}}}, 'task': None, 'task_id': None},
              'association': {'account': 'root', 'cluster': 'swapaware-dev', 'partition': None, 'user': 'root'},
              'cluster': 'swapaware-dev',
              'constraints': '',
              'container': None,
              'derived_exit_code': {'status': 'SUCCESS', 'return_code': 0},
              'time': {'elapsed': 2,
                       'eligible': 1796238101,
                       'end': 1796238103,
                       'start': 1796238101,
                       'submission': 1796238101,
                       'suspended': 0,
                       'system': {'seconds': 0, 'microseconds': 0},
                       'limit': None,
                       'total': {'seconds': 0, 'microseconds': 0},
                       'user': {'seconds': 0, 'microseconds': 0}},
              'exit_code': {'status': 'SUCCESS', 'return_code': 0},
              'flags': ['CLEAR_SCHEDULING', 'STARTED_ON_SCHEDULE'],
              'group': 'root',
              'het': {'job_id': 0, 'job_offset': None},
              'job_id': 3,
              'name': 'train-8771d0',
              'mcs': {'label': ''},
              'nodes': 'vm',
              'partition': 'gpu',
              'priority': 1,
              'qos': 'normal',
              'required': {'CPUs': 1, 'memory': 256},
              'kill_request_user': None,
              'reservation': {'id': 0, 'name': 0},
              'state': {'current': 'COMPLETED', 'reason': 'None'},
              'steps': [],
              'tres': {'allocated': [{'type': 'cpu', 'name': None, 'id': 1, 'count': 1},
                                     {'type': 'mem', 'name': None, 'id': 2, 'count': 256},
                                     {'type': 'energy', 'name': None, 'id': 3, 'count': None},
                                     {'type': 'node', 'name': None, 'id': 4, 'count': 1},
                                     {'type': 'billing', 'name': None, 'id': 5, 'count': 1},
                                     {'type': 'gres', 'name': 'shard', 'id': 1002, 'count': 1}],
                       'requested': [{'type': 'cpu', 'name': None, 'id': 1, 'count': 1},
                                     {'type': 'mem', 'name': None, 'id': 2, 'count': 256},
                                     {'type': 'node', 'name': None, 'id': 4, 'count': 1},
                                     {'type': 'billing', 'name': None, 'id': 5, 'count': 1},
                                     {'type': 'gres', 'name': 'shard', 'id': 1002, 'count': 1}]},
              'user': 'root',
              'wckey': {'wckey': '', 'flags': []},
              'working_directory': '/var/tmp/swapaware-test/jobs'}]}
GRES_IDS = {"gpu": 1001, "shard": 1002}


def sacct_record(job_id: int, *, user: str, account: str = "proj", partition: str = "gpu", name: str = "train",
                 comment: str | None = None, alloc: dict[str, int] | None = None, req: dict[str, int] | None = None,
                 submit: int = 0, start: int = 0, end: int = 0, state: str = "COMPLETED") -> dict:
    """The real record above with this job's values (same schema, same field shapes)."""
    j = copy.deepcopy(REAL_SACCT["jobs"][0])
    j.update(job_id=job_id, user=user, account=account, partition=partition, name=name)
    j["association"].update(account=account, user=user)
    j["comment"]["administrator"] = comment
    j["time"].update(submission=submit, eligible=submit, start=start, end=end,
                     elapsed=(end or start) - start if start else 0)
    j["state"] = {"current": state, "reason": "None"}
    base = [t for t in j["tres"]["allocated"] if t["type"] != "gres"]

    def gres(counts):
        return [{"type": "gres", "name": n, "id": GRES_IDS[n], "count": c} for n, c in counts.items()]

    req = req if req is not None else (alloc or {})
    j["tres"]["requested"] = [t for t in base if t["type"] != "energy"] + gres(req)
    j["tres"]["allocated"] = [] if not start else base + gres(alloc or {})
    if not start:
        j["nodes"] = "None assigned"
    return j


def sacct_text(records: list[dict]) -> str:
    return json.dumps({**REAL_SACCT, "jobs": records})


# ----------------------------------------------------------------------------- a small real world
@dataclass
class FakeSlurm:
    """What slurmctld/slurmdbd know: AdminComments (scontrol) and accounting records (sacct)."""

    comments: dict[int, str] = field(default_factory=dict)
    records: list[dict] = field(default_factory=list)
    queries: list[tuple[str, str]] = field(default_factory=list)
    lookups: list[int] = field(default_factory=list)

    def job_admin_comment(self, job_id: int) -> str | None:
        """Like CliSlurm: scontrol's AdminComment, else accounting's ('' for a job it knows)."""
        self.lookups.append(job_id)
        known = any(r["job_id"] == job_id for r in self.records)
        return self.comments.get(job_id, "" if known else None)

    def accounting_jobs(self, job_ids=(), start="", end=""):
        self.queries.append((start, end))
        return parse_sacct_json(sacct_text(self.records))

    def set_admin_comment(self, job_id: int, text: str) -> None:
        self.comments[job_id] = text

    # Job instances, for the service's correlation of hook events: squeue's (live) and sacct's.
    live: dict[int, JobInstance] = field(default_factory=dict)

    def live_instances(self, job_ids):
        return [inst for j, inst in self.live.items() if j in job_ids]

    def ended_instances(self, job_ids):
        return [inst for inst in parse_sacct_instances(sacct_text(self.records)) if inst.job_id in job_ids]


@dataclass
class World:
    db: Path
    store: HistoryStore
    handler: PolicyHandler
    slurm: FakeSlurm
    decisions: dict[int, pb.Decision] = field(default_factory=dict)
    # The service's clock: it has seen every event the world sent (the service refuses events
    # from its future).
    now: float = float(T0)

    def flush(self) -> None:
        """The handler records decisions on a writer thread: wait until they are in the file."""
        getattr(self.handler, "flush", lambda: None)()

    def job(self, job_id: int, *, user: str = "alice", name: str = "train", gres: str = "gres:gpu:1",
            admit: bool = True, alloc: dict[str, int] | None = None, submit: int = 0, wait_s: int = 0,
            run_s: int = 0, peak: int | None = None, oom: bool = False, state: str = "COMPLETED",
            account: str = "proj", accounting_comment: str | None = "same") -> pb.Decision | None:
        """Submit (through the handler, as job_submit.lua would), run (prolog/epilog events) and
        record the job as slurmdbd would show it."""
        d = None
        comment = None
        if admit:
            facts = pb.JobFacts(user=user, account=account, partition="gpu", job_name=name, tres_per_node=gres,
                                script_fingerprint="00000001deadbeef", min_nodes=1)
            d = self.handler.admit(pb.AdmitRequest(job=facts)).decision
            comment = d.rewrite.admin_comment
            self.slurm.comments[job_id] = comment
            self.decisions[job_id] = d
        if alloc is None:
            alloc = {"shard": d.shards} if d is not None and d.shards else {"gpu": 1}
        start = submit + wait_s if state != "PENDING" else 0
        end = start + run_s if state not in ("PENDING", "RUNNING") else 0
        self.slurm.live[job_id] = JobInstance(job_id, "swapaware-dev", submit, start, 0, comment or "", "RUNNING",
                                              source="squeue")
        self.now = max(self.now, float(start), float(end))
        if start:
            self.handler.job_started(pb.JobStartedRequest(job_id=job_id, node="vm", gpu_indices=[0],
                                                          started_at=start, event_id=f"s{job_id}"))
        if end:
            fin = pb.JobFinishedRequest(job_id=job_id, node="vm", gpu_indices=[0], finished_at=end, exit_code=0,
                                        event_id=f"f{job_id}", oom_detected=oom,
                                        telemetry_source="fake-nvml" if peak else "none")
            if peak is not None:
                fin.peak_gpu_bytes = peak
            self.handler.job_finished(fin)
        shown = comment if accounting_comment == "same" else accounting_comment
        if not end:
            shown = None  # slurmdbd has no AdminComment before the job ends (22.05)
        self.slurm.records.append(sacct_record(job_id, user=user, account=account, name=name, comment=shown,
                                               alloc=alloc, req=alloc, submit=submit, start=start, end=end,
                                               state=state))
        return d


@pytest.fixture
def world(tmp_path):
    # The scenario's classes share from their second run (estimator.min_samples 1; the default waits
    # for 3), and its shared job that ran out of memory ends there (no whole-GPU requeue: this fake
    # Slurm cannot requeue; how a requeued run is reported is not what these tests check).
    cfg = load_config(env={"SWAPAWARE_SERVICE__DB_PATH": str(tmp_path / "history.sqlite3"),
                           "SWAPAWARE_ESTIMATOR__MIN_SAMPLES": "1", "SWAPAWARE_POLICY__REQUEUE_AFTER_OOM": "false"})
    store = HistoryStore(cfg.service.db_path)
    slurm = FakeSlurm()
    ids = iter(f"d{i:015d}" for i in range(1, 1000))
    handler = PolicyHandler(cfg, store, slurm, clock=lambda: w.now, new_id=lambda: next(ids))
    w = World(db=cfg.service.db_path, store=store, handler=handler, slurm=slurm)
    yield w
    w.flush()
    getattr(handler, "close", lambda: None)()
    w.store.close()


def scenario(w: World) -> None:
    """alice: whole GPU (no history), then shared; one shared job overridden to a GPU by an admin;
    one shared job that ran out of memory; one job whose AdminComment was removed afterwards.
    bob: a GPU job the plugin never saw (failed open) and a pending one. carol: no GPU."""
    w.job(101, submit=T0, wait_s=60, run_s=3600, peak=3 * GIB)                      # whole_gpu
    w.job(102, submit=T0 + 4000, wait_s=30, run_s=7200, peak=int(3.2 * GIB))         # share 1
    w.job(104, submit=T0 + 12000, wait_s=10, run_s=1800, alloc={"gpu": 1})           # share, ran on a GPU
    w.job(103, submit=T0 + 14000, wait_s=20, run_s=3600, peak=5 * GIB, oom=True)     # share, OOM
    w.job(108, submit=T0 + 18000, wait_s=0, run_s=600, peak=2 * GIB, accounting_comment="")  # comment removed
    w.job(105, user="bob", admit=False, submit=T0 + 100, wait_s=0, run_s=600, peak=1 * GIB)  # no record
    w.job(106, user="bob", admit=False, submit=T0 + 200, state="PENDING")            # pending, no record
    w.slurm.records.append(sacct_record(107, user="carol", alloc={}, submit=T0, start=T0 + 1, end=T0 + 50))


def build(w: World, **kw) -> R.Report:
    w.flush()
    accounting = w.slurm.accounting_jobs()
    return R.load_report(accounting, w.db, by=kw.pop("by", "user"), shards_per_gpu=8, now=float(T0 + 90000),
                         start="now-7days", end="now", **kw)


# ----------------------------------------------------------------------------- parsing
@pytest.mark.parametrize("text, gpus, shards", [
    ("billing=1,cpu=1,gres/gpu=1,mem=256M,node=1", 1, 0),
    ("billing=1,cpu=1,gres/shard=2,mem=256M,node=1", 0, 2),
    ("billing=1,cpu=1,mem=256M,node=1", 0, 0),
    ("cpu=1,mem=256,energy=None,node=1,billing=1,gres/shard=1", 0, 1),  # _tres_text of a 22.05 list
    ("gres/gpu=2,gres/gpu:a100=2", 2, 0),  # typed entries repeat the untyped total
    ("gres/gpu:a100=1,gres/gpu:h100=2", 3, 0),  # typed only: summed
    ("gres/gpumem=81920M,gres/gpu=4,gres/shard=0", 4, 0),
    ("", 0, 0),
])
def test_parse_tres(text, gpus, shards):
    assert R.parse_tres(text) == R.TresCounts(gpus=gpus, shards=shards)


def test_real_sacct_record_parses_to_a_shared_job_with_its_decision():
    (job,) = parse_sacct_json(json.dumps(REAL_SACCT))
    assert R.parse_tres(job.tres_alloc) == R.TresCounts(0, 1)
    row = R.join_job(job, R.HistorySnapshot(), shards_per_gpu=8, now=0.0)
    assert row.shared and not row.whole_gpu and row.elapsed_s == 2 and row.wait_s == 0
    assert row.decision_id == "83ca41d906784792" and row.action == "share" and row.decided_shards == 1
    assert row.status is R.RecordStatus.AS_DECIDED and not row.in_history
    # not in the history: the share action alone says it asked for one whole GPU
    assert row.gpu_hours_saved == pytest.approx(2 / 3600 * 7 / 8)


def test_decision_row_reads_proto3_json_written_by_the_service(world):
    d = world.job(1, submit=T0, run_s=10, peak=3 * GIB)
    d2 = world.job(2, submit=T0 + 20, run_s=10)
    world.flush()
    from policy_service.history.store import ReadOnlyHistory

    with ReadOnlyHistory(world.db) as h:
        r = h.decisions_by_id([d2.decision_id])[d2.decision_id]
    row = (r.decision_id, r.action, r.shards, r.facts_json, r.decision_json)
    assert '"peakBytes": "' in row[4] or '"peakBytes":"' in row[4]  # uint64 as a JSON string
    hd = R.decision_from_row(*row)
    assert hd.action == "share" and hd.shards == d2.shards == 1
    assert hd.peak_bytes == d2.estimate.peak_bytes == 3 * GIB and hd.margin_bytes == d2.estimate.margin_bytes
    assert hd.asked_kind is GresKind.GPU and hd.asked_gpus == 1
    assert d.action == pb.ACTION_WHOLE_GPU
    assert hd.whole_because == ""  # shared
    with ReadOnlyHistory(world.db) as h:
        r1 = h.decisions_by_id([d.decision_id])[d.decision_id]
    assert R.decision_from_row(r1.decision_id, r1.action, r1.shards, r1.facts_json,
                               r1.decision_json).whole_because == "no_history"


@pytest.mark.parametrize("action,codes,expected", [
    ("whole_gpu", ["no_history", "whole_gpu_as_shards", "priority_default"], "no_history"),
    ("whole_gpu", ["queue_short", "estimate_from_history", "whole_gpu_as_shards"], "queue_short"),
    ("whole_gpu", ["raised_to_observed_max", "too_large_to_share", "estimate_from_history"], "too_large_to_share"),
    ("whole_gpu", ["compute_bound", "estimate_from_history"], "compute_bound"),
    ("whole_gpu", ["protected_qos"], "protected_qos"),
    ("whole_gpu", ["typed_gpu", "estimate_from_history"], "typed_gpu"),
    ("whole_gpu", ["interactive", "no_history"], "interactive"),
    ("whole_gpu", ["priority_default"], ""),
    ("share", ["fits_in_shards", "queue_unknown"], ""),
])
def test_whole_because_is_the_reason_that_kept_the_gpu_whole(action, codes, expected):
    assert R.whole_because(action, codes) == expected
    decision = json.dumps({"reasons": [{"code": c, "message": "m"} for c in codes]})
    assert R.decision_from_row("d", action, 0, "{}", decision).whole_because == expected


# ----------------------------------------------------------------------------- judging
def _hd(action, shards=0, asked=GresKind.GPU, asked_gpus=1):
    return R.HistoryDecision("d1", action, shards, 3 * GIB, GIB // 3, asked, asked_gpus)


S, O, N, J = R.RecordStatus.AS_DECIDED, R.RecordStatus.OVERRIDDEN, R.RecordStatus.NO_RECORD, R.RecordStatus.NOT_JUDGED
Why = R.OverrideReason
SHARE2 = {"id": "d1", "action": "share", "shards": "2"}
WHOLE = {"id": "d1", "action": "whole_gpu", "shards": "0"}
WHOLE8 = {"id": "d1", "action": "whole_gpu", "shards": "8"}  # held as all shards of one GPU
PASS = {"id": "d1", "action": "pass_through", "shards": "0"}


@pytest.mark.parametrize("case, started, tres, comment, hist, run_id, expected", [
    ("shared as decided", True, (0, 2), SHARE2, _hd("share", 2), "d1", (S, None)),
    ("oversubscribed as decided", True, (0, 2), {**SHARE2, "action": "share_oversubscribed"},
     _hd("share_oversubscribed", 2), "", (S, None)),
    ("decided shards, ran on a GPU", True, (1, 0), SHARE2, _hd("share", 2), "d1", (O, Why.RAN_WHOLE_GPU_NOT_SHARDS)),
    ("decided 2 shards, ran on 4", True, (0, 4), SHARE2, _hd("share", 2), "d1", (O, Why.RAN_OTHER_SHARD_COUNT)),
    ("decided shards, ran without GPU", True, (0, 0), SHARE2, None, "", (O, Why.RAN_WITHOUT_GPU)),
    ("whole GPU as decided", True, (1, 0), WHOLE, _hd("whole_gpu"), "d1", (S, None)),
    ("two whole GPUs as decided", True, (2, 0), WHOLE, _hd("whole_gpu", asked_gpus=2), "d1", (S, None)),
    ("decided whole GPU, ran on shards", True, (0, 8), WHOLE, _hd("whole_gpu"), "d1",
     (O, Why.RAN_SHARDS_NOT_WHOLE_GPU)),
    ("whole GPU held as all shards", True, (0, 8), WHOLE8, _hd("whole_gpu", 8), "d1", (S, None)),
    ("whole GPU as shards, ran on a gpu", True, (1, 0), WHOLE8, _hd("whole_gpu", 8), "d1",
     (O, Why.RAN_WHOLE_GPU_NOT_SHARDS)),
    ("whole GPU as shards, ran on 2 shards", True, (0, 2), WHOLE8, _hd("whole_gpu", 8), "d1",
     (O, Why.RAN_OTHER_SHARD_COUNT)),
    ("comment edited after the decision", True, (0, 2), SHARE2, _hd("share", 1), "d1", (O, Why.COMMENT_EDITED)),
    ("comment names another decision", True, (0, 2), SHARE2, _hd("share", 2), "d9", (O, Why.COMMENT_REPLACED)),
    ("comment removed, history knows", True, (1, 0), {}, _hd("whole_gpu"), "d1", (O, Why.COMMENT_REMOVED)),
    ("no record at all", True, (1, 0), {}, None, "", (N, None)),
    ("pending without record", False, (0, 0), {}, None, "", (N, None)),
    ("pending with a decision", False, (0, 0), SHARE2, _hd("share", 2), "", (J, None)),
    ("pass-through of a shard request", True, (0, 3), PASS, _hd("pass_through", asked=GresKind.SHARD), "", (S, None)),
    ("pass-through of shards, ran on a GPU", True, (1, 0), PASS, _hd("pass_through", asked=GresKind.SHARD), "",
     (O, Why.RAN_WHOLE_GPU_NOT_SHARDS)),
    ("pass-through, facts unknown", True, (1, 0), PASS, None, "", (J, None)),
    ("unknown comment (live job), history run", True, (0, 2), None, _hd("share", 2), "d1", (S, None)),
    ("unknown comment (live job), run on a GPU", True, (1, 0), None, _hd("share", 2), "d1",
     (O, Why.RAN_WHOLE_GPU_NOT_SHARDS)),
    ("unknown comment (live job), no history", True, (1, 0), None, None, "", (J, None)),
])
def test_judge(case, started, tres, comment, hist, run_id, expected):
    got = R.judge(started=started, tres=R.TresCounts(*tres), comment=comment, hist=hist, run_decision_id=run_id)
    assert got == expected, case


@pytest.mark.parametrize("case, start, alloc_list", [
    ("pending", 0, []),
    ("held, cancelled", 0, []),
    ("cancelled while pending: start = cancel time, nothing allocated", T0 + 30, []),
])
def test_jobs_that_never_ran_are_not_judged_nor_counted(case, start, alloc_list):
    rec = sacct_record(9, user="u", comment="swapaware:v1 id=dx action=share shards=1", alloc={"shard": 1},
                       submit=T0, start=start, end=start, state="CANCELLED")
    rec["tres"]["allocated"] = alloc_list
    row = R.join_job(parse_sacct_json(sacct_text([rec]))[0], R.HistorySnapshot(), shards_per_gpu=8, now=0.0)
    assert not row.started and row.wait_s is None and row.elapsed_s == 0, case
    assert row.status is R.RecordStatus.NOT_JUDGED and not row.shared and not row.whole_gpu
    assert row.gpu_hours_used == 0 and row.gpu_hours_saved == 0


@pytest.mark.parametrize("text, held", [("billing=1,cpu=1,mem=256M,node=1", True), ("", False),
                                        ("energy=None", False), ("cpu=0,mem=0", False), ("mem=1.5G", True)])
def test_allocated_anything(text, held):
    assert R.allocated_anything(text) is held


@pytest.mark.parametrize("alloc, shared, whole", [
    ({"shard": 1}, True, False), ({"shard": 7}, True, False),
    ({"shard": 8}, False, True),  # all shards of one GPU: a whole GPU (whole_gpu_as_shards)
    ({"gpu": 1}, False, True), ({"gpu": 2}, False, True),
])
def test_shared_means_part_of_one_gpu(alloc, shared, whole):
    job = parse_sacct_json(sacct_text([sacct_record(9, user="u", alloc=alloc, submit=T0, start=T0, end=T0 + 60)]))[0]
    row = R.join_job(job, R.HistorySnapshot(), shards_per_gpu=8, now=0.0)
    assert (row.shared, row.whole_gpu) == (shared, whole)
    assert row.gpu_hours_used == pytest.approx(60 / 3600 * (alloc.get("gpu", 0) + alloc.get("shard", 0) / 8))


@pytest.mark.parametrize("facts, kind, gpus", [
    ({"tresPerNode": "gres:gpu:1"}, GresKind.GPU, 1),
    ({"tresPerJob": "gres:gpu:1"}, GresKind.GPU, 1),
    ({"tresPerNode": "gres:gpu:1", "minNodes": 2}, GresKind.GPU, 2),
    ({"tresPerTask": "gres:gpu:1", "numTasks": 4}, GresKind.GPU, 4),
    ({"tresPerNode": "gres:gpu:a100:2"}, GresKind.GPU, 2),
    ({"tresPerNode": "gres:shard:3"}, GresKind.SHARD, 0),
    ({}, GresKind.NONE, 0),
])
def test_decision_facts_give_what_the_job_asked_for(facts, kind, gpus):
    hd = R.decision_from_row("d", "whole_gpu", 0, json.dumps({"user": "u", **facts}), "{}")
    assert (hd.asked_kind, hd.asked_gpus, hd.peak_bytes) == (kind, gpus, 0)


@pytest.mark.parametrize("k, saved_frac", [(1, 7 / 8), (2, 6 / 8), (4, 4 / 8), (8, 0.0)])
def test_gpu_hours_saved_is_elapsed_times_unused_fraction(k, saved_frac):
    job = parse_sacct_json(sacct_text([sacct_record(
        9, user="u", comment=f"swapaware:v1 id=dx action=share shards={k}", alloc={"shard": k},
        submit=T0, start=T0, end=T0 + 7200)]))[0]
    hist = R.HistorySnapshot(decisions={"dx": _hd("share", k)})
    row = R.join_job(job, hist, shards_per_gpu=8, now=0.0)
    assert row.gpu_hours_used == pytest.approx(2 * k / 8)
    assert row.gpu_hours_saved == pytest.approx(2 * saved_frac)


@pytest.mark.parametrize("asked, asked_gpus, alloc, saved", [
    (GresKind.GPU, 1, {"shard": 2}, True),   # asked one GPU, ran on shards
    (GresKind.SHARD, 0, {"shard": 2}, False),  # asked shards itself: nothing saved by swapaware
    (GresKind.GPU, 2, {"shard": 2}, False),  # asked two GPUs (not a case the policy shares)
    (GresKind.GPU, 1, {"gpu": 1}, False),    # ran on a GPU
])
def test_saved_only_for_one_whole_gpu_asked_and_shards_allocated(asked, asked_gpus, alloc, saved):
    job = parse_sacct_json(sacct_text([sacct_record(9, user="u", comment="swapaware:v1 id=dx action=share shards=2",
                                                    alloc=alloc, submit=T0, start=T0, end=T0 + 3600)]))[0]
    hist = R.HistorySnapshot(decisions={"dx": _hd("share", 2, asked, asked_gpus)})
    row = R.join_job(job, hist, shards_per_gpu=8, now=0.0)
    assert (row.gpu_hours_saved > 0) is saved


def test_observation_of_an_earlier_job_with_the_same_id_is_not_joined():
    job = parse_sacct_json(sacct_text([sacct_record(9, user="u", comment="swapaware:v1 id=dnew action=whole_gpu "
                                                    "shards=0", alloc={"gpu": 1}, submit=T0, start=T0,
                                                    end=T0 + 60)]))[0]
    old = R.HistoryObservation(9, "dold", T0 + 50, 5 * GIB, True, "nvml")  # other decision
    ancient = R.HistoryObservation(9, "", T0 - 86400, 6 * GIB, True, "nvml")  # long before this job started
    row = R.join_job(job, R.HistorySnapshot(observations={9: (old, ancient)}), shards_per_gpu=8, now=0.0)
    assert row.observed_peak_bytes is None and row.oom is None
    mine = R.HistoryObservation(9, "dnew", T0 + 60, 2 * GIB, False, "nvml")
    row = R.join_job(job, R.HistorySnapshot(observations={9: (old, mine, ancient)}), shards_per_gpu=8, now=0.0)
    assert row.observed_peak_bytes == 2 * GIB and row.oom is False


# ----------------------------------------------------------------------------- the whole report
def test_report_joins_accounting_with_history(world):
    scenario(world)
    rep = build(world)
    d = world.decisions
    assert [d[i].action for i in (101, 102, 104, 103)] == [pb.ACTION_WHOLE_GPU] + [pb.ACTION_SHARE] * 3
    jobs = {j.job_id: j for j in rep.jobs}
    assert set(jobs) == {101, 102, 103, 104, 105, 106, 108} and rep.non_gpu_jobs == 1  # carol's job skipped
    assert not rep.history_error

    j = jobs[101]
    assert j.whole_gpu and j.status is R.RecordStatus.AS_DECIDED and j.wait_s == 60
    assert j.gpu_hours_used == pytest.approx(1.0) and j.gpu_hours_saved == 0
    assert j.predicted_peak_bytes is None and j.observed_peak_bytes == 3 * GIB  # no prediction without history

    j = jobs[102]
    k = d[102].shards
    assert j.shared and j.shards == k == 1 and j.status is R.RecordStatus.AS_DECIDED and j.in_history
    assert j.gpu_hours_used == pytest.approx(2 * k / 8) and j.gpu_hours_saved == pytest.approx(2 * (1 - k / 8))
    pred = d[102].estimate.peak_bytes
    assert j.predicted_peak_bytes == pred == 3 * GIB and j.observed_peak_bytes == int(3.2 * GIB)
    assert j.abs_pct_error == pytest.approx(abs(pred - 3.2 * GIB) / (3.2 * GIB) * 100)
    assert j.under_predicted is False  # 3.2 GiB <= 3 GiB + 0.3 GiB margin

    j = jobs[104]
    assert j.status is R.RecordStatus.OVERRIDDEN and j.override_reason is R.OverrideReason.RAN_WHOLE_GPU_NOT_SHARDS
    assert j.whole_gpu and j.gpu_hours_saved == 0 and j.observed_peak_bytes is None

    j = jobs[103]
    assert j.shared and j.oom is True and j.under_predicted is True
    assert j.predicted_peak_bytes == d[103].estimate.peak_bytes < 5 * GIB

    j = jobs[108]
    assert j.status is R.RecordStatus.OVERRIDDEN and j.override_reason is R.OverrideReason.COMMENT_REMOVED
    assert j.decision_id == d[108].decision_id  # found through the history's run record

    assert jobs[105].status is R.RecordStatus.NO_RECORD and jobs[105].observed_peak_bytes == GIB
    assert jobs[106].status is R.RecordStatus.NOT_JUDGED and not jobs[106].started  # pending, comment unknown

    alice, bob = rep.groups
    assert (alice.key, alice.jobs, alice.shared_jobs, alice.whole_gpu_jobs) == ("alice", 5, 2, 3)
    assert (alice.as_decided, alice.overridden, alice.no_record, alice.not_started) == (3, 2, 0, 0)
    assert alice.gpu_hours_saved == pytest.approx(jobs[102].gpu_hours_saved + jobs[103].gpu_hours_saved)
    assert alice.gpu_hours_used == pytest.approx(sum(jobs[i].gpu_hours_used for i in (101, 102, 103, 104, 108)))
    assert alice.gpu_hours_shared == pytest.approx(jobs[102].gpu_hours_used + jobs[103].gpu_hours_used)
    assert alice.wait_median_s == 20 and alice.wait_max_s == 60 and alice.wait_mean_s == pytest.approx(24)
    assert (alice.observed_jobs, alice.observed_peak_max_bytes, alice.ooms) == (4, 5 * GIB, 1)
    assert alice.predicted_jobs == 3 and alice.under_predicted == 1  # 102, 103 and 108 (108 was predicted too)
    assert alice.abs_pct_error_median == pytest.approx(sorted(
        jobs[i].abs_pct_error for i in (102, 103, 108))[1])
    assert (bob.key, bob.jobs, bob.no_record, bob.not_started, bob.whole_gpu_jobs) == ("bob", 2, 1, 1, 1)
    assert bob.predicted_jobs == 0 and bob.abs_pct_error_median is None and bob.wait_median_s == 0
    total = rep.total
    assert total.jobs == 7 and total.shared_jobs == 2 and total.overridden == 2 and total.no_record == 1
    assert jobs[101].whole_because == "no_history" and jobs[102].whole_because == ""
    # 101: nothing known yet; 108: after 103's OOM while shared (104 was decided share)
    assert jobs[108].whole_because == "oom_penalty"
    assert alice.whole_because == total.whole_because == "no_history=1;oom_penalty=1"
    assert "whole-GPU decisions by reason: no_history 1, oom_penalty 1" in R.format_table(rep)
    assert total.gpu_hours_saved == pytest.approx(alice.gpu_hours_saved)


def test_report_by_account_and_partition(world):
    scenario(world)
    world.job(201, user="dave", account="other", submit=T0, run_s=60, peak=GIB)
    by_account = build(world, by="account")
    assert [g.key for g in by_account.groups] == ["other", "proj"]
    assert by_account.groups[1].jobs == 7
    by_partition = build(world, by="partition")
    assert [(g.key, g.jobs) for g in by_partition.groups] == [("gpu", 8)]
    with pytest.raises(ValueError):
        R.build_report([], R.HistorySnapshot(), by="qos", shards_per_gpu=8, now=0.0)


def test_live_jobs_take_their_comment_from_slurmctld(world):
    world.job(101, submit=T0, wait_s=1, run_s=600, peak=3 * GIB)
    world.job(301, submit=T0 + 700, wait_s=5, state="RUNNING")  # shared, running: accounting has no comment
    world.job(302, user="bob", admit=False, submit=T0 + 700, state="PENDING")  # failed open, pending
    world.job(303, submit=T0 + 700, state="PENDING")  # decided, pending
    accounting = world.slurm.accounting_jobs()
    assert all(not j.admin_comment for j in accounting if j.job_id > 300)

    rep = build(world)
    jobs = {j.job_id: j for j in rep.jobs}
    assert jobs[301].status is R.RecordStatus.AS_DECIDED  # through the history's run record
    assert jobs[301].elapsed_s == 90000 - 705 and jobs[301].shared
    assert jobs[302].status is R.RecordStatus.NOT_JUDGED and jobs[303].status is R.RecordStatus.NOT_JUDGED

    world.slurm.lookups.clear()  # (the handler looked up comments too, as the service does)
    live = R.live_admin_comments(world.slurm, accounting)
    assert sorted(world.slurm.lookups) == [301, 302, 303]
    assert live == {301: world.slurm.comments[301], 302: "", 303: world.slurm.comments[303]}
    rep = build(world, live_comments=live)
    jobs = {j.job_id: j for j in rep.jobs}
    assert jobs[301].status is R.RecordStatus.AS_DECIDED
    assert jobs[302].status is R.RecordStatus.NO_RECORD and jobs[303].status is R.RecordStatus.NOT_JUDGED
    assert jobs[303].decision_id == world.decisions[303].decision_id and rep.total.not_started == 2
    world.slurm.lookups.clear()
    assert len(R.live_admin_comments(world.slurm, accounting, limit=1)) <= 1 and len(world.slurm.lookups) == 1


# ----------------------------------------------------------------------------- the history file
def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _files(db: Path) -> dict[str, str]:
    return {p.name: _digest(p) for p in sorted(db.parent.iterdir()) if p.name.startswith(db.name)}


def test_history_is_read_read_only(world):
    scenario(world)
    world.flush()
    # while the service holds it open (WAL): database and log unchanged by the reader
    before = _files(world.db)
    snap = R.read_history(world.db, [101, 102, 999], ["nope"])
    assert set(snap.run_decisions) == {101, 102} and set(snap.observations) == {101, 102}
    assert set(snap.decisions) == {world.decisions[101].decision_id, world.decisions[102].decision_id}
    after = _files(world.db)
    assert after[world.db.name] == before[world.db.name]
    assert after[world.db.name + "-wal"] == before[world.db.name + "-wal"]
    # service stopped (log checkpointed away): SQLite may recreate an empty -wal/-shm, nothing else
    world.store.close()
    before = _files(world.db)
    R.read_history(world.db, [101])
    after = _files(world.db)
    assert after[world.db.name] == before[world.db.name]
    empty = hashlib.sha256(b"").hexdigest()
    assert all(v == empty for k, v in after.items() if k.endswith("-wal") and k not in before)
    world.store = HistoryStore(world.db)  # the fixture closes it


def test_missing_or_foreign_history_leaves_an_accounting_only_report(world, tmp_path):
    scenario(world)
    rep = R.load_report(world.slurm.accounting_jobs(), tmp_path / "nowhere.sqlite3", by="user", shards_per_gpu=8,
                        now=float(T0 + 90000))
    assert "no history database" in rep.history_error and rep.total.jobs == 7
    assert rep.total.predicted_jobs == 0 and rep.total.observed_jobs == 0
    # 108's removed comment cannot be told from a job that never had one without the history
    assert rep.total.no_record == 2 and rep.total.shared_jobs == 2
    foreign = tmp_path / "foreign.sqlite3"
    with sqlite3.connect(foreign) as c:
        c.execute("CREATE TABLE t (x)")
    with pytest.raises(R.HistoryUnavailable, match="not a swapaware history"):
        R.read_history(foreign, [1])
    with sqlite3.connect(foreign) as c:
        assert [r[0] for r in c.execute("SELECT name FROM sqlite_master")] == ["t"]  # nothing created


# ----------------------------------------------------------------------------- rendering
def test_json_csv_and_table(world):
    scenario(world)
    rep = build(world)
    doc = json.loads(R.format_json(rep, with_jobs=True))
    assert doc["meta"]["by"] == "user" and doc["meta"]["shards_per_gpu"] == 8
    assert doc["meta"]["history"]["available"] is True and doc["meta"]["non_gpu_jobs_skipped"] == 1
    assert [g["key"] for g in doc["groups"]] == ["alice", "bob"] and doc["total"]["jobs"] == 7
    j104 = next(j for j in doc["jobs"] if j["job_id"] == 104)
    assert j104["status"] == "overridden" and j104["override_reason"] == "ran_whole_gpu_not_shards"
    assert "jobs" not in json.loads(R.format_json(rep))

    rows = list(csv.DictReader(io.StringIO(R.format_csv(rep))))
    assert [r["key"] for r in rows] == ["alice", "bob", "(total)"]
    assert float(rows[0]["gpu_hours_saved"]) == pytest.approx(rep.groups[0].gpu_hours_saved, abs=1e-6)
    assert rows[1]["abs_pct_error_median"] == ""  # None -> empty cell
    job_rows = list(csv.DictReader(io.StringIO(R.format_csv(rep, with_jobs=True))))
    assert len(job_rows) == 7 and job_rows[0]["group"] == "alice"

    table = R.format_table(rep, with_jobs=True)
    lines = table.splitlines()
    assert lines[0].startswith("swapaware report  now-7days .. now  by user  (7 GPU jobs, 1 non-GPU")
    assert lines[1].split()[:4] == ["USER", "jobs", "shared", "whole"]
    alice = next(ln for ln in lines if ln.startswith("alice "))
    assert alice.split()[1:7] == ["5", "2", "3", "0", "0", "2"]
    assert any(ln.startswith("(total)") for ln in lines)
    assert any(ln.startswith("104 ") and "ran_whole_gpu_not_shards" in ln for ln in lines)


@pytest.mark.parametrize("seconds, text", [(None, "-"), (0, "0s"), (119, "119s"), (600, "10.0m"),
                                           (3 * 3600, "3.0h"), (3 * 86400, "3.0d")])
def test_fmt_duration(seconds, text):
    assert R.fmt_duration(seconds) == text


# ----------------------------------------------------------------------------- the command
@pytest.fixture
def cli_world(world, tmp_path, monkeypatch):
    scenario(world)
    world.flush()
    conf = tmp_path / "swapaware.toml"
    conf.write_text(f'[service]\ndb_path = "{world.db}"\nslurm_backend = "cli"\nslurm_release = "24.11"\n'
                    '[gpu]\nshards_per_gpu = 8\n')
    opened = []

    def fake_release(configured, timeout_s):  # never this host's scontrol
        return ClusterRelease(parse_release(configured) if configured else None, "test")

    def fake_open(backend, timeout_s, release):
        opened.append((backend, timeout_s))
        world.release = release
        return world.slurm

    monkeypatch.setattr(report_cli, "cluster_release", fake_release)
    monkeypatch.setattr(report_cli, "open_slurm", fake_open)
    monkeypatch.delenv("SWAPAWARE_CONFIG", raising=False)
    world.conf, world.opened = conf, opened
    world.slurm.lookups.clear()
    return world


def _invoke(w, *args):
    return CliRunner().invoke(R.report_command, [*args, "--config", str(w.conf)],
                                              catch_exceptions=False)


def test_command_json(cli_world):
    res = _invoke(cli_world, "--format", "json", "--by", "account", "--start", "2026-11-01", "--end", "now")
    assert res.exit_code == 0, res.output + res.stderr
    doc = json.loads(res.stdout)
    assert cli_world.slurm.queries == [("2026-11-01", "now")]
    assert cli_world.opened[0][0].value == "cli" and cli_world.opened[0][1] == 120.0
    assert cli_world.release.dialect.sacct_json_arg == "--json=v0.0.42"  # service.slurm_release = "24.11"
    assert doc["meta"]["start"] == "2026-11-01" and doc["meta"]["slurm_backend"] == "FakeSlurm"
    assert [g["key"] for g in doc["groups"]] == ["proj"] and doc["total"]["shared_jobs"] == 2
    assert doc["total"]["gpu_hours_saved"] > 0 and doc["total"]["observed_jobs"] == 5
    assert cli_world.slurm.lookups == [106]  # the pending GPU job's comment, read live


def test_command_defaults_table_and_csv(cli_world):
    res = _invoke(cli_world)
    assert res.exit_code == 0, res.stderr
    assert cli_world.slurm.queries == [("now-7days", "now")]
    assert res.stdout.splitlines()[1].startswith("USER")
    res = _invoke(cli_world, "--format", "csv", "--jobs")
    rows = list(csv.DictReader(io.StringIO(res.stdout)))
    assert {int(r["job_id"]) for r in rows} == {101, 102, 103, 104, 105, 106, 108}
    assert next(r for r in rows if r["job_id"] == "106")["status"] == "no_record"  # read live: none


def test_command_warns_without_history(cli_world, tmp_path):
    cli_world.conf.write_text(f'[service]\ndb_path = "{tmp_path / "gone.sqlite3"}"\n')
    res = _invoke(cli_world, "--format", "json")
    assert res.exit_code == 0
    assert "WARNING: no history database" in res.stderr
    assert json.loads(res.stdout)["meta"]["history"]["available"] is False


def test_command_plots(cli_world, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "plots"
    res = _invoke(cli_world, "--plot", str(out))
    assert res.exit_code == 0, res.stderr
    for name in ("gpu_hours.png", "jobs.png", "memory_pred_vs_obs.png", "queue_wait.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name
    assert "wrote" in res.stderr


def test_command_plots_without_matplotlib(cli_world, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    res = _invoke(cli_world, "--plot", str(tmp_path / "plots"))
    assert res.exit_code != 0
    assert "pip install 'swapaware[plots]'" in res.stderr
    assert cli_world.slurm.queries == []  # failed before asking accounting


def test_command_is_registered_in_the_cli():
    from policy_service.cli import main

    assert "report" in main.commands


def test_report_joins_a_reused_job_id_by_instance(world):
    """Job 1 ran twice (ids restart after a Slurm state reset): each accounting record is joined with
    its own instance's run and observation (job id + submit time), not with the newest job 1."""
    h = world.handler
    runs = {}
    for tag, submit, peak in (("old", T0, 2 * GIB), ("new", T0 + 1000, 5 * GIB)):
        world.now = float(submit)
        d = h.admit(pb.AdmitRequest(job=pb.JobFacts(user="alice", job_name=tag, tres_per_node="gres:gpu:1"))).decision
        world.slurm.live[1] = JobInstance(1, "swapaware-dev", submit, submit + 10, 0, d.rewrite.admin_comment,
                                          "RUNNING", source="squeue")
        h.report_events(pb.ReportEventsRequest(events=[
            pb.JobEvent(started=pb.JobStartedRequest(job_id=1, node="vm", gpu_indices=[0], started_at=submit + 10,
                                                     event_id=f"s-{tag}")),
            pb.JobEvent(finished=pb.JobFinishedRequest(job_id=1, node="vm", gpu_indices=[0], finished_at=submit + 100,
                                                       event_id=f"f-{tag}", peak_gpu_bytes=peak,
                                                       telemetry_source="fake-nvml"))]))
        runs[tag] = (d, submit, peak)
        world.now = submit + 100.0  # the service's clock moves on (it refuses events from its future)
    world.flush()
    for tag in ("old", "new"):
        d, submit, peak = runs[tag]
        # the AdminComment was removed from accounting afterwards: only the history links the job
        world.slurm.records = [sacct_record(1, user="alice", comment="", alloc={"gpu": 1}, submit=submit,
                                            start=submit + 10, end=submit + 100)]
        (job,) = build(world).jobs
        assert (job.decision_id, job.observed_peak_bytes) == (d.decision_id, peak), tag


# ----------------------------------------------------------------------------- shadow mode
def test_shadow_decisions_report_what_sharing_would_have_done(world):
    """In shadow mode jobs run on the whole GPU they asked for: the report judges them as decided
    (left alone) and sums what the decisions would have done."""
    from policy_service.config import PolicyMode

    world.job(201, submit=T0, wait_s=10, run_s=3600, peak=3 * GIB)  # enforce, no history: whole GPU
    world.handler.set_mode(PolicyMode.SHADOW)
    shard = world.handler.cfg.gpu.shard_bytes
    fits = world.job(202, submit=T0 + 4000, run_s=7200, peak=3 * GIB, alloc={"gpu": 1})
    above = world.job(203, submit=T0 + 12000, run_s=3600, peak=30 * GIB, alloc={"gpu": 1})
    unseen = world.job(204, submit=T0 + 16000, run_s=1800, alloc={"gpu": 1})
    for d in (fits, above, unseen):
        assert d.mode == "shadow" and d.action in (pb.ACTION_SHARE, pb.ACTION_SHARE_OVERSUBSCRIBED)
        assert [f.name for f, _ in d.rewrite.ListFields()] == ["admin_comment"]
    rep = build(world, shard_bytes=shard)
    jobs = {j.job_id: j for j in rep.jobs}
    assert not jobs[201].shadow and jobs[201].shadow_gpu_hours_freed == 0
    for i, d in ((202, fits), (203, above), (204, unseen)):
        j = jobs[i]
        assert j.shadow and j.whole_gpu and not j.shared and j.status is R.RecordStatus.AS_DECIDED
        assert j.shadow_would_share and j.decided_shards == d.shards
        assert j.shadow_gpu_hours_freed == pytest.approx(j.elapsed_s / 3600 * (1 - d.shards / 8))
    assert jobs[202].shadow_would_oom is False and jobs[203].shadow_would_oom is True
    assert jobs[204].shadow_would_oom is None  # no observed peak
    t = rep.total
    assert (t.shadow_jobs, t.shadow_would_share, t.shadow_would_oom) == (3, 3, 1)
    assert t.shadow_gpu_hours_freed == pytest.approx(sum(j.shadow_gpu_hours_freed for j in rep.jobs))
    assert t.gpu_hours_saved == 0 and t.overridden == 0  # nothing was shared for real
    assert "shadow mode: 3 decision(s), 3 would have shared" in R.format_table(rep)


# ----------------------------------------------------------------------------- the HTML page
def test_command_writes_one_self_contained_html_page(cli_world, tmp_path):
    out = tmp_path / "site" / "report.html"
    res = _invoke(cli_world, "--html", str(out), "--jobs")
    assert res.exit_code == 0, res.output
    page = out.read_text()
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert page.count('src="data:image/png;base64,') == 4  # the four plots, inline
    assert "src=\"http" not in page and "<link" not in page and "<script" not in page  # nothing fetched
    rep = build(cli_world)
    for g in (*rep.groups, rep.total):
        assert f"<td>{g.key}</td>" in page
    assert page.count("<tr") == 1 + len(rep.groups) + 1 + 1 + len(rep.jobs)  # summary header+rows, jobs header+rows


def test_html_page_escapes_what_users_typed_and_says_when_plots_are_missing(world, monkeypatch, tmp_path):
    from policy_service.report.command import write_html

    world.job(301, name="<script>alert(1)</script>", submit=T0, run_s=60, peak=GIB)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    out = tmp_path / "r.html"
    write_html(out, build(world), with_jobs=True)
    page = out.read_text()
    assert "<script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "plots not drawn" in page and "pip install" in page and "data:image/png" not in page
