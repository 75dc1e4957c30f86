"""Shadow mode on the real cluster: every job is decided and recorded, nothing about it changes
but its AdminComment (mode=shadow), it runs on the whole GPU it asked for, and the report's shadow
figures are the sums over the jobs."""
import json
import time
import uuid

import pytest

from tests.waiting import wait_for

from .conftest import decision_of, fake_alloc_script, job_field

pytestmark = pytest.mark.integration
WHERE = ("--account=root", "--partition=gpu")


def test_shadow_mode_leaves_jobs_alone_and_reports_what_sharing_would_have_done(stack):
    since = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - 1))
    name = f"shadow-{uuid.uuid4().hex[:6]}"
    first = stack.sbatch(fake_alloc_script(stack, gib=3, hold_s=1.0), "--gres=gpu:1", f"--job-name={name}", *WHERE)
    assert stack.wait_done(first) == "COMPLETED"  # enforce: learns the class (3 GiB)
    stack.wait_observation(first)
    stack.wait_for_decisions(*WHERE)

    jobs = {}
    with stack.service_with(SWAPAWARE_POLICY__MODE="shadow"):
        for gib in (3, 20):  # within the shard it would get, and far above it
            job = stack.sbatch(fake_alloc_script(stack, gib=gib, hold_s=1.0), "--gres=gpu:1", f"--job-name={name}",
                               *WHERE)
            shown = stack.show_job(job)
            comment = job_field(shown, "AdminComment")
            d = decision_of(comment)
            assert d["mode"] == "shadow" and d["action"] in ("share", "share_oversubscribed"), comment
            assert stack.gres("gpu", 1) in job_field(shown, "TresPerNode")  # the request as submitted
            assert "shard" not in job_field(shown, "TresPerNode")
            assert job_field(shown, "SiteFactor") in ("0", "")  # no priority change
            jobs[job] = d
            assert stack.wait_done(job) == "COMPLETED"
            stack.wait_observation(job)
        stack.wait_for_decisions(*WHERE)
        with stack.history() as db:
            recorded = {r[0] for r in db.execute("SELECT decision_id FROM decisions WHERE job_name=?", (name,))}
        assert {d["id"] for d in jobs.values()} <= recorded

    def listing():
        doc = json.loads(stack.swapaware("report", "--format", "json", "--jobs", "--start", since).stdout)
        return doc if set(jobs) <= {j["job_id"] for j in doc["jobs"]} else None

    doc = wait_for(listing, 30, f"accounting to list jobs {sorted(jobs)}", 1.0)
    rows = {j["job_id"]: j for j in doc["jobs"] if j["job_id"] in jobs or j["job_id"] == first}
    assert not rows[first]["shadow"]
    for job, d in jobs.items():
        r = rows[job]
        assert r["shadow"] and r["whole_gpu"] and not r["shared"] and r["status"] == "as_decided", r
        assert r["shadow_would_share"] and r["decided_shards"] == int(d["shards"])
        assert r["shadow_gpu_hours_freed"] == pytest.approx(r["elapsed_s"] / 3600 * (1 - int(d["shards"]) / 8), abs=1e-5)  # JSON: 6 decimals
    small, big = sorted(jobs)
    assert rows[small]["shadow_would_oom"] is False and rows[big]["shadow_would_oom"] is True
    shadow_rows = [j for j in doc["jobs"] if j["shadow"]]
    total = doc["total"]
    assert total["shadow_jobs"] == len(shadow_rows)
    assert total["shadow_would_share"] == sum(j["shadow_would_share"] for j in shadow_rows)
    assert total["shadow_would_oom"] == sum(bool(j["shadow_would_oom"]) for j in shadow_rows)
    assert total["shadow_gpu_hours_freed"] == pytest.approx(sum(j["shadow_gpu_hours_freed"] for j in shadow_rows), abs=1e-5)
