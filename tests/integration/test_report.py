"""``swapaware report`` on the real cluster: jobs run through job_submit.lua, the policy service,
prolog/epilog and slurmdbd/MariaDB; the report reads ``sacct --json`` and the service's history."""
import csv
import io
import json
import time
import uuid

import pytest

from tests.waiting import wait_for

from .conftest import GIB, decision_of, fake_alloc_script, job_field

pytestmark = pytest.mark.integration
# Explicit account and partition: the history's wide keys become "root" and "gpu", apart from the
# "(none)" / "(default)" keys that jobs submitted without them (test_end_to_end's) learn into.
WHERE = ("--account=root", "--partition=gpu")


def _report(stack, *args):
    return stack.swapaware("report", *args)


def _report_listing(stack, job_ids, *args, timeout_s: float = 30) -> dict:
    """``report --format json --jobs`` once accounting lists every one of ``job_ids``: a windowed
    sacct query can miss a job that ended in the last seconds (seen on 22.05 for up to ~3 s)."""
    def listing() -> dict | None:
        doc = json.loads(_report(stack, "--format", "json", "--jobs", *args).stdout)
        return doc if set(job_ids) <= {j["job_id"] for j in doc["jobs"]} else None

    return wait_for(listing, timeout_s, f"accounting to list jobs {sorted(job_ids)}", 1.0)


def _wait_for_decisions(stack) -> None:
    stack.wait_for_decisions(*WHERE)


def test_report_joins_slurmdbd_accounting_with_the_history(stack, tmp_path):
    since = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - 1))
    name = f"report-{uuid.uuid4().hex[:6]}"
    script = fake_alloc_script(stack, gib=3, hold_s=1.5)

    # 1. a GPU job submitted while the service is down: fails open, no swapaware record
    stack.stack("service-stop")
    try:
        unseen = stack.sbatch(fake_alloc_script(stack, gib=1, hold_s=0.5), "--gres=gpu:1", f"--job-name={name}-x",
                               *WHERE)
        assert job_field(stack.show_job(unseen), "AdminComment") in ("", "(null)")
        assert stack.wait_done(unseen) == "COMPLETED"
    finally:
        stack.stack("service-start")
    stack.swapaware("replay-spool")
    stack.wait_observation(unseen)
    _wait_for_decisions(stack)

    # 2. first run of a new class; 3. the same class again: shared (the class has a 3 GiB run)
    first = stack.sbatch(script, "--gres=gpu:1", f"--job-name={name}", *WHERE)
    assert decision_of(job_field(stack.show_job(first), "AdminComment"))
    assert stack.wait_done(first) == "COMPLETED"
    stack.wait_observation(first)
    shared = stack.sbatch(script, "--gres=gpu:1", f"--job-name={name}", *WHERE)
    d_shared = decision_of(job_field(stack.show_job(shared), "AdminComment"))
    assert d_shared["action"] == "share" and d_shared["shards"] == "1", d_shared
    assert stack.wait_done(shared) == "COMPLETED"
    stack.wait_observation(shared)

    # 4. shared too, then an admin rewrites its decision record in accounting (shards=1 -> 2)
    edited = stack.sbatch(script, "--gres=gpu:1", f"--job-name={name}", *WHERE)
    assert stack.wait_done(edited) == "COMPLETED"
    stack.wait_observation(edited)
    comment = stack.sacct_admin_comment(edited)
    assert decision_of(comment)["shards"] == "1"
    stack.run("sacctmgr", "-i", "modify", "job", "where", f"jobid={edited}", "set",
              f"AdminComment={comment.replace('shards=1', 'shards=2')}")
    assert decision_of(stack.sacct_admin_comment(edited))["shards"] == "2"  # (sacctmgr lowercases the text)

    doc = _report_listing(stack, [first, shared, edited, unseen], "--start", since)
    assert doc["meta"]["history"]["available"] is True, doc["meta"]
    assert doc["meta"]["slurm_backend"] == "CliSlurm" and doc["meta"]["shards_per_gpu"] == 8
    jobs = {j["job_id"]: j for j in doc["jobs"]}
    assert {first, shared, edited, unseen} <= set(jobs), sorted(jobs)

    # GPU-hours as sacct bills them: the dev cluster's GRES/gpu=8, GRES/shard=1 bill 8 per GPU-hour
    for job in (first, shared, unseen):
        tres = stack.run("sacct", "-X", "-n", "-P", "-j", str(job), "-o", "alloctres").stdout.strip()
        alloc = dict(kv.split("=", 1) for kv in tres.split(",") if "=" in kv)
        if jobs[job]["elapsed_s"]:
            per_hour = jobs[job]["gpu_hours_used"] * 3600 / jobs[job]["elapsed_s"]
            # (the report rounds GPU-hours to 1e-6 h: a few seconds' job is known to about 0.01 GPU)
            assert per_hour * 8 == pytest.approx(int(alloc["billing"]) - int(alloc["cpu"]), abs=0.1), (alloc, jobs[job])

    j = jobs[shared]
    assert j["shared"] and j["shards"] == 1 and j["gpus"] == 0 and j["status"] == "as_decided"
    assert j["decision_id"] == d_shared["id"] and j["in_history"]
    assert j["elapsed_s"] >= 1 and j["gpu_hours_saved"] == pytest.approx(j["elapsed_s"] / 3600 * 7 / 8, abs=1e-6)
    assert j["gpu_hours_saved"] > 0 and j["gpu_hours_used"] == pytest.approx(j["elapsed_s"] / 3600 / 8, abs=1e-6)
    assert j["observed_peak_bytes"] == 3 * GIB and j["oom"] is False
    assert j["predicted_peak_bytes"] == 3 * GIB and j["abs_pct_error"] == 0 and j["under_predicted"] is False
    assert j["wait_s"] is not None and j["wait_s"] >= 0

    j = jobs[first]
    assert j["observed_peak_bytes"] == 3 * GIB and j["status"] == "as_decided" and j["in_history"]
    assert j["shared"] == (j["action"] == "share")  # its decision depends on what the history held before

    j = jobs[edited]
    assert j["status"] == "overridden" and j["override_reason"] == "comment_edited" and j["shared"]

    j = jobs[unseen]
    assert j["status"] == "no_record" and j["decision_id"] == "" and j["whole_gpu"] and j["gpus"] == 1
    assert j["observed_peak_bytes"] == 1 * GIB and j["gpu_hours_saved"] == 0

    # the groups and the total add up to the jobs listed
    (root,) = [g for g in doc["groups"] if g["key"] == "root"]
    mine = [j for j in doc["jobs"] if j["user"] == "root"]
    assert root["jobs"] == len(mine) >= 4
    assert root["shared_jobs"] == sum(j["shared"] for j in mine) >= 2
    assert root["no_record"] == sum(j["status"] == "no_record" for j in mine) >= 1
    assert root["overridden"] == sum(j["status"] == "overridden" for j in mine) >= 1
    assert root["gpu_hours_saved"] == pytest.approx(sum(j["gpu_hours_saved"] for j in mine), abs=1e-5)
    assert root["gpu_hours_saved"] > 0 and root["observed_jobs"] >= 4
    assert root["observed_peak_max_bytes"] >= 3 * GIB and root["predicted_jobs"] >= 1
    assert doc["total"]["jobs"] == sum(g["jobs"] for g in doc["groups"])

    # the other formats and the plots, on the same data
    table = _report(stack, "--start", since, "--by", "partition", "--jobs").stdout
    print(table)  # shown when the test fails
    assert table.splitlines()[1].startswith("PARTITION") and any(ln.startswith("gpu ") for ln in table.splitlines())
    rows = list(csv.DictReader(io.StringIO(_report(stack, "--format", "csv", "--start", since).stdout)))
    assert rows[-1]["key"] == "(total)" and int(rows[-1]["shared_jobs"]) >= 2
    plots = tmp_path / "plots"
    shown = json.loads(_report(stack, "--start", since, "--format", "json", "--plot", str(plots)).stdout)
    # the interference plot only where the history holds shared runs (the suite's earlier tests may
    # have left some: it reads the newest interference.window, whatever --start says)
    shared = any(row["runs"] for row in (shown["interference"] or {}).get("summary", ()))
    assert {p.name for p in plots.glob("*.png")} == {"gpu_hours.png", "jobs.png", "memory_pred_vs_obs.png",
                                                     "queue_wait.png"} | ({"interference.png"} if shared else set())
