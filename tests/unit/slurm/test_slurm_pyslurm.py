"""The pyslurm backend (slurm/slurm_pyslurm.py) against a stateful stand-in for pyslurm 25.11's API
(no Slurm 25.11 runs here): open_slurm picks it only where the versions match, falls back to the
command-line tools where pyslurm does not import, and the backend sends only the accounting reads
and the AdminComment write through pyslurm."""
from __future__ import annotations

import importlib.metadata
import sys
import types

import pytest

from policy_service.slurm import slurm as S
from policy_service.slurm.slurm import CliSlurm, SlurmError
from policy_service.config import SlurmBackend


class _RPCError(Exception):
    pass


def _fake_pyslurm(jobs: dict[int, dict], live: set[int], filters: list) -> types.ModuleType:
    """``jobs``: job id -> accounting fields (the database); ``live``: ids slurmctld still holds."""

    class Job:
        @staticmethod
        def load(job_id):
            if job_id not in live:
                raise _RPCError(f"job {job_id} not found")
            return types.SimpleNamespace(admin_comment=jobs[job_id].get("admin_comment"))

    class DbJob:
        def __init__(self, job_id=None, admin_comment=None):
            self.id, self.admin_comment = job_id, admin_comment

        def modify(self, changes):
            jobs[self.id]["admin_comment"] = changes.admin_comment

    class JobFilter:
        def __init__(self, **kw):
            self.kw = kw

    class Jobs:
        @staticmethod
        def load(flt):
            filters.append(flt.kw)
            ids = flt.kw["ids"]
            return {i: types.SimpleNamespace(id=i, **f) for i, f in jobs.items() if ids is None or i in ids}

    mod = types.ModuleType("pyslurm")
    mod.Job = Job
    mod.db = types.SimpleNamespace(Job=DbJob, Jobs=Jobs, JobFilter=JobFilter)
    return mod


def _record(**kw):
    base = dict(user_name="alice", account="a", partition="gpu", name="train", state="COMPLETED", exit_code=0,
                submit_time=10, start_time=11, end_time=20, admin_comment=None, allocated_tres="gres/gpu=1",
                requested_tres="gres/gpu=1")
    return {**base, **kw}


@pytest.fixture
def pyslurm(monkeypatch):
    jobs = {7: _record(), 8: _record(user_name="bob", admin_comment="swapaware:v1 id=x")}
    live, filters = {7}, []
    monkeypatch.setitem(sys.modules, "pyslurm", _fake_pyslurm(jobs, live, filters))
    return types.SimpleNamespace(jobs=jobs, live=live, filters=filters)


def _versions(monkeypatch, pyslurm_version):
    def version(name):
        if name == "pyslurm" and pyslurm_version:
            return pyslurm_version
        raise importlib.metadata.PackageNotFoundError(name)
    monkeypatch.setattr(importlib.metadata, "version", version)


def test_pyslurm_only_where_its_release_is_the_clusters(pyslurm, monkeypatch):
    from policy_service.slurm.slurm_pyslurm import PyslurmSlurm
    _versions(monkeypatch, "25.11.0")
    chosen = S.open_slurm(SlurmBackend.AUTO, 1.0, S.ClusterRelease((25, 11), "test"))
    assert isinstance(chosen, PyslurmSlurm) and chosen.sacct_json_arg.startswith("--json")
    other = S.open_slurm(SlurmBackend.AUTO, 1.0, S.ClusterRelease((24, 11), "test"))
    assert type(other) is CliSlurm and other.sacct_json_arg == "--json=v0.0.42"


def test_without_an_importable_pyslurm_auto_falls_back_and_a_demand_for_it_fails(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyslurm", None)  # import raises ImportError
    _versions(monkeypatch, "25.11.0")
    assert type(S.open_slurm(SlurmBackend.AUTO, 1.0, S.ClusterRelease((25, 11), "test"))) is CliSlurm
    with pytest.raises(SlurmError, match="pyslurm does not import"):
        S.open_slurm(SlurmBackend.PYSLURM, 1.0, S.ClusterRelease((25, 11), "test"))


def test_accounting_and_admin_comment_through_pyslurm_the_rest_through_the_tools(pyslurm, monkeypatch):
    from policy_service.slurm.slurm_pyslurm import PyslurmSlurm
    backend = PyslurmSlurm(1.0)
    ran = []
    monkeypatch.setattr(backend, "_run", lambda argv, env_extra=None: ran.append(argv) or "")

    rows = backend.accounting_jobs(job_ids=[8], start="2026-12-01")
    assert [(r.job_id, r.user, r.admin_comment, r.tres_alloc) for r in rows] == [(8, "bob", "swapaware:v1 id=x",
                                                                                   "gres/gpu=1")]
    assert pyslurm.filters[-1] == {"ids": [8], "start_time": "2026-12-01", "end_time": None}

    backend.set_admin_comment(7, "swapaware:v1 id=y")
    assert backend.job_admin_comment(7) == "swapaware:v1 id=y"          # live: read from slurmctld
    assert backend.job_admin_comment(8) == "swapaware:v1 id=x"          # ended: read from accounting
    assert backend.job_admin_comment(9) is None                          # neither
    assert ran == []

    assert backend.pending_jobs() == [] and ran and ran[0][0] == "squeue"  # the queue: the tools
