"""doctor's ``table_decisions`` check: did slurmctld decide recent jobs from the admission table?

The other table checks (``plugin_table``, ``slurmuser_table``, ``job_submit_files``) look at what
should make the plugin use the table; this one looks at what it did. A job the plugin decided from
the class table carries ``tbl=<version>:<entry><state>`` in its AdminComment
(core/admission.parse_table_ref); a job the service decided (the Admit round trip, or a re-decision
of a pending job) carries none. The jobs are read as the service's catch-up reads them
(admission/catchup.py: ``live_commented_jobs``, one squeue, and
``accounted_commented_jobs(since)``, one sacct), over the catch-up's and the reconciler's window,
``service.reconcile_window_s`` (24 h): long enough to hold decisions on a quiet cluster, and the
query the service itself makes at start. A decision counts once (its id), by its job's submit time
(the time catch-up records it at); jobs submitted before the window are left out.

Shown on the controller only where both sides have a table: ``Config.table_path`` and the plugin's
``table=`` (swapaware_plugin.conf). OK: some recent decisions came from the table. WARN (jobs are
still decided, by the round trip: ``plugin_enabled=0`` and a table owner outside ``table_uids``
warn alike): decisions, none from the table. SKIP: Slurm could not be asked, or it shows no
recent decision to this user."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

from policy_service.admin.check import Check
from policy_service.admin.wiring import PLUGIN_CONF, plugin_table_path, table_uids
from policy_service.admission.catchup import table_made
from policy_service.slurm.slurm_comments import CommentedJob
from policy_service.slurm.slurm_text import SlurmError, decision_ids_in
from policy_service.config import Config
from policy_service.core.admission import TableRef
from policy_service.core.dialect import SlurmDialect

NAME = "table_decisions"


@dataclass(frozen=True)
class Decided:
    """One swapaware decision Slurm shows: its id, its job, and its table reference (None: the
    service decided it)."""

    decision_id: str
    job: CommentedJob
    ref: TableRef | None


def recent_decisions(jobs: Iterable[CommentedJob], since: float) -> list[Decided]:
    """The distinct swapaware decisions among ``jobs`` whose job was submitted at or after
    ``since``, newest first (a job squeue and sacct both show counts once)."""
    seen: dict[str, Decided] = {}
    for job in jobs:
        if job.submit_time < since:
            continue
        ids = decision_ids_in(job.admin_comment)
        if len(ids) != 1:
            continue
        d_id = next(iter(ids))
        if d_id not in seen:
            made = table_made(job.admin_comment)
            seen[d_id] = Decided(d_id, job, made[1] if made is not None and made[0] == d_id else None)
    return sorted(seen.values(), key=lambda d: (d.job.submit_time, d.job.job_id), reverse=True)


def _span(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:g} h"
    return f"{seconds:.0f} s"


def table_decisions_check(jobs: Sequence[CommentedJob] | None, error: str, *, table: str, plugin_conf: str,
                          uids: Iterable[int], now: float, window_s: float, user: str) -> Check:
    """The check over what Slurm showed (``jobs``; None with ``error``: it could not be asked).
    ``table``: the class table's path; ``plugin_conf``: swapaware_plugin.conf's; ``uids``: its
    table_uids as swapaware_table.lua reads them; ``user``: who runs doctor."""
    window = f"the last {_span(window_s)} (service.reconcile_window_s)"
    if jobs is None:
        return Check(NAME, True, f"not checked: Slurm could not be asked for the jobs of {window} as {user} "
                     f"({error}); run doctor as the service's user on the controller", skipped=True)
    decided = recent_decisions(jobs, now - window_s)
    if not decided:
        return Check(NAME, True, f"no swapaware decision in {window} that squeue and sacct show to {user}: nothing "
                     "to judge; run it again after GPU jobs were submitted, as the service's user (with "
                     "PrivateData=jobs, Slurm shows other users' jobs only to operators)", skipped=True)
    made = [d for d in decided if d.ref is not None]
    if made:
        newest = made[0]
        later = decided.index(newest)
        return Check(NAME, True, f"{len(made)} of {len(decided)} recent swapaware decisions came from the table "
                     f"(newest job {newest.job.job_id}, version {newest.ref.version}) in {window}"
                     + (f"; the {later} newer one(s) took the round trip (classes not in the table yet, or "
                        "re-decided while pending)" if later else ""))
    newest = decided[0]
    return Check(
        NAME, True,
        f"none of the {len(decided)} swapaware decision(s) in {window} came from the table {table} (newest job "
        f"{newest.job.job_id}, decided by the service): every one took the round trip, which only the first job of "
        "a class within [admission] horizon_s should",
        f"slurmctld.log names why, once: 'swapaware: admission file {table} not used (jobs take the RPC path): "
        f"<reason>'. Likely: table= in {plugin_conf} is not [admission] table_path (plugin_table above); SlurmUser "
        "cannot read the table, or its owner is not in table_uids="
        f"{','.join(map(str, sorted(uids)))} (slurmuser_table above); lua-posix (posix.sys.stat) or lua-cjson is "
        "not installed for slurmctld's Lua; the table's valid_until passed (the service re-publishes it every "
        "admission.valid_s / 2: is it running, and does its log show 'admission table' errors?); swapaware_table.lua "
        "is missing (job_submit_files above). Then touch job_submit.lua beside slurm.conf (slurmctld reloads it)",
        warn=True)


def read_recent(slurm, since: float) -> tuple[list[CommentedJob] | None, str]:
    """What catch-up reads: every job slurmctld holds (squeue) and the accounting's since ``since``
    (sacct); (None, why) when Slurm could not be asked."""
    try:
        return slurm.live_commented_jobs() + slurm.accounted_commented_jobs(since), ""
    except SlurmError as exc:
        return None, str(exc)


def table_decisions_checks(cfg: Config, settings: Mapping[str, str], conf_dir: str, user: str, slurm_uid: int | None,
                           dialect: SlurmDialect | None = None, slurm=None,
                           clock: Callable[[], float] = time.time) -> list[Check]:
    """The check where both the service and the plugin have a table, else none. ``slurm``: the
    Slurm access (default: the command-line tools, as the service's catch-up reads them)."""
    table = plugin_table_path(settings)
    if not (cfg.table_path and table):
        return []
    if slurm is None:
        from policy_service.slurm.slurm import CliSlurm

        slurm = CliSlurm(cfg.service.slurm_timeout_s, dialect=dialect)
    now, window_s = clock(), cfg.service.reconcile_window_s
    jobs, error = read_recent(slurm, now - window_s)
    return [table_decisions_check(jobs, error, table=table, plugin_conf=f"{conf_dir}/{PLUGIN_CONF}",
                                  uids=table_uids(settings, slurm_uid), now=now, window_s=window_s, user=user)]
