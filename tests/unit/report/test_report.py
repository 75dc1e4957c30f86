"""``swapaware report``: pure join/aggregation on real-shaped ``sacct --json`` (Slurm 22.05) and a
real SQLite history written by the service's own handler and HistoryStore.

This module holds the shared world (the real record, FakeSlurm, World, the ``world`` fixture, the
scenario) and the whole report: accounting joined with the history, grouped, live jobs' comments,
shadow mode. The rest is split by subject: test_report_parsing.py, test_report_judging.py,
test_report_history_file.py, test_report_formats.py, test_report_command.py."""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from policy_service import report as R
from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.history.store import HistoryStore
from policy_service.slurm.slurm import JobInstance, parse_sacct_instances, parse_sacct_json
from policy_service.config import load_config
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
