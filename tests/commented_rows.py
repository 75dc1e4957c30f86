"""Rows of jobs with their AdminComment as ``squeue_argv()`` and ``sacct_argv()``
(policy_service/slurm/slurm_comments.py) print them, for the fakes of the catch-up's and doctor's
tests."""
from __future__ import annotations

from policy_service.slurm.slurm_comments import CommentedJob


def limit_text(minutes: int | None) -> str:
    """A time limit as squeue and sacct print it ("UNLIMITED", "4:00:00", "2-00:00:00")."""
    if minutes is None:
        return "UNLIMITED"
    days, rest = divmod(minutes, 24 * 60)
    return (f"{days}-" if days else "") + f"{rest // 60}:{rest % 60:02d}:00"


def commented_row(j: CommentedJob, empty: str) -> str:
    """One row as squeue -O (empty AdminComment: "(null)") or sacct -P (empty: "") prints it."""
    return "|".join([str(j.job_id), str(j.submit_time), str(j.uid), j.user, j.account, j.partition, j.state,
                     limit_text(j.time_limit_min), j.admin_comment or empty])
