"""Slurm through pyslurm, used only where pyslurm's version matches the cluster's (``open_slurm``):
the accounting reads and the AdminComment write go through pyslurm's API; everything else (the
queue snapshot, job updates, requeue, access checks) through the command-line tools, as on every
release."""
from __future__ import annotations

from typing import Sequence

from policy_service.slurm.slurm import CliSlurm
from policy_service.slurm.slurm_text import AccountingJob
from policy_service.core.dialect import SlurmDialect


class PyslurmSlurm(CliSlurm):
    def __init__(self, timeout_s: float = 5.0, dialect: SlurmDialect | None = None) -> None:
        import pyslurm  # ImportError -> open_slurm falls back to the command-line tools

        super().__init__(timeout_s, dialect=dialect)
        self._pyslurm = pyslurm

    def job_admin_comment(self, job_id: int) -> str | None:
        try:
            return self._pyslurm.Job.load(job_id).admin_comment
        except Exception:  # pyslurm raises RPCError for unknown/finished jobs
            jobs = self.accounting_jobs(job_ids=[job_id])
            return jobs[0].admin_comment if jobs else None

    def accounting_jobs(self, job_ids: Sequence[int] = (), start: str = "", end: str = "") -> list[AccountingJob]:
        flt = self._pyslurm.db.JobFilter(ids=list(job_ids) or None, start_time=start or None, end_time=end or None)
        return [AccountingJob(
            job_id=j.id, user=j.user_name or "", account=j.account or "", partition=j.partition or "",
            job_name=j.name or "", state=j.state or "", exit_code=int(j.exit_code or 0),
            submit_time=int(j.submit_time or 0), start_time=int(j.start_time or 0), end_time=int(j.end_time or 0),
            admin_comment=j.admin_comment or "", tres_alloc=str(j.allocated_tres or ""),
            tres_req=str(j.requested_tres or "")) for j in self._pyslurm.db.Jobs.load(flt).values()]

    def set_admin_comment(self, job_id: int, text: str) -> None:
        self._pyslurm.db.Job(job_id).modify(self._pyslurm.db.Job(admin_comment=text))
