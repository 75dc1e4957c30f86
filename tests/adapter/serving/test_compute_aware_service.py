"""Compute-aware sizing through the real service over real gRPC: a JobFinished carrying the node
agent's GPU utilisation teaches the class, the next Admit charges shards for its compute."""
import pytest

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.slurm.slurm import PendingJob
from policy_service.core.request import history_keys, job_request
from policy_service.core.types import KeyLevel
from policy_service.serving.events import gpu_utilisation
from slurm_plugin.hooks.run import apply_telemetry
from tests.adapter.conftest import served
from tests.waiting import wait_for

from tests.adapter.serving.test_service import GIB, facts

COMPUTE_CODES = {"compute_shards", "compute_bound", "compute_overcommitted"}


def run_solo(client, slurm_jobs, job_id, job, *, util_pct, source="fake-nvml", peak=2 * GIB, gpus=(0,),
             start=1000.0, end=1100.0):
    """Admit, 'submit', start and finish a job whose JobFinished carries the agent's per-GPU figures."""
    d = client.admit(job).decision
    slurm_jobs.comments[job_id] = d.rewrite.admin_comment
    client.call("JobStarted", pb.JobStartedRequest(job_id=job_id, node="n1", gpu_indices=list(gpus),
                                                   started_at=start, event_id=f"s{job_id}"))
    fin = pb.JobFinishedRequest(
        job_id=job_id, node="n1", gpu_indices=list(gpus), finished_at=end, exit_code=0, event_id=f"f{job_id}",
        peak_gpu_bytes=peak, telemetry_source=source,
        gpus=[pb.GpuUsage(gpu_index=g, peak_bytes=peak, util_mean_pct=util_pct, total_bytes=80 * GIB) for g in gpus])
    resp = client.call("JobFinished", fin)
    assert resp.applied and resp.decision_id == d.decision_id
    return d


def class_stats(service, job: pb.JobFacts):
    jr, _ = job_request(user=job.user, account=job.account, partition=job.partition, job_name=job.job_name,
                        script_fingerprint=job.script_fingerprint,
                        gres_fields={"tres_per_node": job.tres_per_node})
    keys = history_keys(jr)
    stats = service.store.stats(keys)
    return stats[KeyLevel.CLASS], stats[KeyLevel.USER_NAME]


def codes(decision):
    return {r.code for r in decision.reasons}


def message(decision, code):
    (m,) = [r.message for r in decision.reasons if r.code == code]
    return m


def test_solo_utilisation_raises_the_charge_to_compute_shards(client, slurm_jobs, service):
    job = facts(name="busy")
    first = run_solo(client, slurm_jobs, 41, job, util_pct=62.0)
    assert first.action == pb.ACTION_WHOLE_GPU  # no history yet
    cls, user_name = class_stats(service, job)
    assert (cls.util_runs, cls.ewma_solo_util, cls.solo_runs) == (1, 0.62, 1)
    assert (user_name.util_runs, user_name.ewma_solo_util) == (1, 0.62)
    d = client.admit(job).decision
    assert (d.action, d.shards) == (pb.ACTION_SHARE, 5)  # memory alone: 1 shard (2 GiB + margin)
    assert d.rewrite.tres_per_node == "gres:shard:5"
    assert d.estimate.peak_bytes == 2 * GIB
    assert codes(d) & COMPUTE_CODES == {"compute_shards"}
    assert message(d, "compute_shards").startswith("alone on a GPU it kept it 62% busy (class history): charged 5 of "
                                                   "8 shards")
    assert "compute_shards" in d.rewrite.admin_comment


def test_compute_bound_class_stays_whole(client, slurm_jobs, service):
    job = facts(name="hot")
    run_solo(client, slurm_jobs, 42, job, util_pct=97.0)
    d = client.admit(job).decision
    assert (d.action, d.shards) == (pb.ACTION_WHOLE_GPU, 8)
    assert d.rewrite.tres_per_node == "gres:shard:8"
    assert codes(d) & COMPUTE_CODES == {"compute_bound"}
    assert "fits_in_shards" not in codes(d)
    assert message(d, "compute_bound").startswith("alone on a GPU it kept it 97% busy (class history)")


@pytest.mark.parametrize("source", ["none", ""])
def test_no_telemetry_teaches_no_utilisation(client, slurm_jobs, service, source):
    job = facts(name=f"quiet{source}")
    run_solo(client, slurm_jobs, 43, job, util_pct=62.0, source=source)
    cls, _ = class_stats(service, job)
    assert (cls.util_runs, cls.ewma_solo_util, cls.samples) == (0, 0.0, 1)
    d = client.admit(job).decision
    assert (d.action, d.shards) == (pb.ACTION_SHARE, 1)  # memory decides
    assert "fits_in_shards" in codes(d) and not codes(d) & COMPUTE_CODES


def test_runs_beside_a_co_runner_teach_no_utilisation(client, slurm_jobs, service):
    # two jobs of one class overlap on GPU 0: the device-wide 97 % is not either job's own
    job = facts(name="pair")
    for jid in (44, 45):
        slurm_jobs.comments[jid] = client.admit(job).decision.rewrite.admin_comment
    for jid, start in ((44, 1000.0), (45, 1050.0)):
        client.call("JobStarted", pb.JobStartedRequest(job_id=jid, node="n1", gpu_indices=[0], started_at=start,
                                                       event_id=f"s{jid}"))
    for jid, end in ((44, 1100.0), (45, 1150.0)):
        client.call("JobFinished", pb.JobFinishedRequest(
            job_id=jid, node="n1", finished_at=end, exit_code=0, event_id=f"f{jid}", peak_gpu_bytes=2 * GIB,
            telemetry_source="fake-nvml",
            gpus=[pb.GpuUsage(gpu_index=0, peak_bytes=4 * GIB, util_mean_pct=97.0, total_bytes=80 * GIB)]))
    assert [o.co_runners for o in sorted(service.store.observations(), key=lambda o: o.job_id)] == [1, 1]
    cls, _ = class_stats(service, job)
    assert (cls.util_runs, cls.shared_runs, cls.solo_runs) == (0, 2, 0)
    d = client.admit(job).decision
    assert (d.action, d.shards) == (pb.ACTION_SHARE, 1)
    assert not codes(d) & COMPUTE_CODES


def test_failed_run_teaches_no_utilisation(client, slurm_jobs, service):
    job = facts(name="crash")
    d = client.admit(job).decision
    slurm_jobs.comments[46] = d.rewrite.admin_comment
    client.call("JobFinished", pb.JobFinishedRequest(
        job_id=46, node="n1", gpu_indices=[0], started_at=1000.0, finished_at=1100.0, exit_code=1, event_id="f46",
        peak_gpu_bytes=2 * GIB, telemetry_source="nvml",
        gpus=[pb.GpuUsage(gpu_index=0, peak_bytes=2 * GIB, util_mean_pct=97.0, total_bytes=80 * GIB)]))
    cls, _ = class_stats(service, job)
    assert (cls.runs, cls.util_runs) == (1, 0)
    assert not codes(client.admit(job).decision) & COMPUTE_CODES


def test_utilisation_of_user_and_name_sizes_a_new_class(client, slurm_jobs, service):
    run_solo(client, slurm_jobs, 47, facts(name="sweep"), util_pct=62.0)
    other_class = facts(name="sweep")
    other_class.script_fingerprint = "00000002deadbeef"  # same user+name, another script
    d = client.admit(other_class).decision
    assert d.estimate.source == pb.ESTIMATE_SOURCE_USER_NAME
    assert (d.action, d.shards) == (pb.ACTION_SHARE, 5)
    assert "62% busy (user_name history)" in message(d, "compute_shards")


def test_several_gpus_are_averaged_into_the_learned_figure(client, slurm_jobs, service):
    job = facts(name="multi")
    run_solo(client, slurm_jobs, 48, job, util_pct=0.0, gpus=(0,))  # first figure: 0.0
    d = client.admit(job).decision
    slurm_jobs.comments[49] = d.rewrite.admin_comment
    client.call("JobFinished", pb.JobFinishedRequest(
        job_id=49, node="n1", gpu_indices=[2, 3], started_at=2000.0, finished_at=2100.0, exit_code=0,
        event_id="f49", peak_gpu_bytes=2 * GIB, telemetry_source="nvml",
        gpus=[pb.GpuUsage(gpu_index=2, util_mean_pct=100.0), pb.GpuUsage(gpu_index=3, util_mean_pct=60.0)]))
    cls, _ = class_stats(service, job)
    assert cls.util_runs == 2
    assert cls.ewma_solo_util == pytest.approx(0.7 * 0.0 + 0.3 * 0.8, abs=1e-12)  # mean 80 %, alpha 0.3
    assert client.admit(job).decision.shards == 2  # ceil(0.24 x 8)


# ----------------------------------------------------------------------------- the long queue
def waiting(n, first_id=500):
    return [PendingJob(first_id + i, "gres:gpu:1", "", "", 1, 1, "Priority") for i in range(n)]


@pytest.fixture
def queue_service(service_env, slurm_jobs):
    # no interference budget: the lift as such (with it, a class as busy as 0.8 is not lifted under
    # the default prior: test_long_queue_overcommits_compute_with_the_queue_rule_off[budget])
    env = dict(service_env, SWAPAWARE_POLICY__SHARE_MIN_QUEUE="0.05", SWAPAWARE_POLICY__QUEUE_POLL_S="0.05",
               SWAPAWARE_POLICY__OVERCOMMIT_COMPUTE_MIN_QUEUE="1.0", SWAPAWARE_POLICY__MAX_INTERFERENCE_SLOWDOWN="0")
    with served(env, slurm_jobs) as sc:
        yield sc


def test_long_queue_overcommits_compute_end_to_end(queue_service, slurm_jobs):
    svc, client = queue_service
    job = facts(name="busy")
    run_solo(client, slurm_jobs, 51, job, util_pct=62.0)
    slurm_jobs.gpus = 4
    slurm_jobs.pending = waiting(4)  # 4 of 4 GPUs: pressure 1.0
    wait_for(lambda: (s := svc.queue_monitor.snapshot()) is not None and s.pending_gpus == 4.0, 5.0, "4 GPUs waiting")
    d = client.admit(job).decision
    assert (d.action, d.shards) == (pb.ACTION_SHARE, 1)
    assert codes(d) & COMPUTE_CODES == {"compute_overcommitted"}
    assert message(d, "compute_overcommitted").startswith("pending GPU jobs ask for 100% of the cluster's GPUs")
    slurm_jobs.pending = waiting(2)  # pressure 0.5: the floor is back
    wait_for(lambda: svc.queue_monitor.snapshot().pending_gpus == 2.0, 5.0, "2 GPUs waiting")
    d = client.admit(job).decision
    assert (d.action, d.shards) == (pb.ACTION_SHARE, 5)
    assert codes(d) & COMPUTE_CODES == {"compute_shards"}


@pytest.mark.parametrize("budget,shards,code", [("0", 1, "compute_overcommitted"),
                                                 ("2", 7, "long_queue_over_budget")], ids=["no-budget", "budget"])
def test_long_queue_overcommits_compute_with_the_queue_rule_off(service_env, slurm_jobs, budget, shards, code):
    """With the default budget (2) the default prior (no shared runs: one co-runner 50 % busy) predicts
    the class 80 % busy 1 + 0.58 x 0.5 + 2.9 x 0.3 = 2.16x slower: the long queue keeps its floor of
    ceil(6.4) = 7 shards; with no budget it lifts it to memory's 1."""
    env = dict(service_env, SWAPAWARE_POLICY__QUEUE_POLL_S="0.05",  # share_min_queue = 0 from service_env
               SWAPAWARE_POLICY__OVERCOMMIT_COMPUTE_MIN_QUEUE="1.0", SWAPAWARE_POLICY__MAX_INTERFERENCE_SLOWDOWN=budget)
    with served(env, slurm_jobs) as (svc, client):
        job = facts(name="busy")
        run_solo(client, slurm_jobs, 52, job, util_pct=80.0)
        slurm_jobs.pending = waiting(8)  # 8 GPUs for 4: pressure 2.0
        assert svc.queue_monitor is not None, "no queue monitor runs"
        wait_for(lambda: (s := svc.queue_monitor.snapshot()) is not None and s.pending_gpus == 8.0, 5.0,
                 "8 GPUs waiting")
        d = client.admit(job).decision
        assert (d.action, d.shards) == (pb.ACTION_SHARE, shards)
        assert code in codes(d)


# ----------------------------------------------------------------------------- gpu_utilisation
def finished(source="nvml", *pcts):
    return pb.JobFinishedRequest(job_id=1, event_id="e", telemetry_source=source,
                                 gpus=[pb.GpuUsage(gpu_index=i, util_mean_pct=p) for i, p in enumerate(pcts)])


@pytest.mark.parametrize("req,expected", [
    (finished("nvml", 62.0), 0.62),
    (finished("fake-nvml", 90.0, 30.0), 0.6),  # the mean of the job's GPUs
    (finished("nvml", 100.0, 50.0, 0.0, 10.0), 0.4),
    (finished("nvml", 0.0), 0.0),  # an idle GPU is a figure
    (finished("nvml", 100.0), 1.0),
    (finished("nvml", 150.0), 1.0),  # clamped
    (finished("nvml", 150.0, 90.0), 1.0),  # the mean (120 %), clamped
    (finished("nvml", -5.0), 0.0),
    (finished("nvml"), None),  # no GPU entries
    (finished("none", 62.0), None),  # no telemetry
    (finished("", 62.0), None),
    (finished("none"), None),
], ids=["one", "two-averaged", "four-averaged", "zero", "hundred", "above-100", "mean-above-100", "negative",
        "no-gpus", "source-none", "source-empty", "none-and-empty"])
def test_gpu_utilisation(req, expected):
    got = gpu_utilisation(req)
    if expected is None:
        assert got is None
    else:
        assert got == pytest.approx(expected, abs=1e-12)


def test_unmeasured_utilisation_is_not_learned_as_idle():
    req = pb.JobFinishedRequest(job_id=1, event_id="e", exit_code=0)
    apply_telemetry(req, {"source": "nvml", "peak_bytes": 2 * GIB,
                          "gpus": [{"index": 0, "peak_bytes": 2 * GIB, "util_mean_pct": None}]})
    assert req.telemetry_source == "nvml" and len(req.gpus) == 1
    assert gpu_utilisation(req) is None
