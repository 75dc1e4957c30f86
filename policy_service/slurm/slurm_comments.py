"""Every job's AdminComment with what names the job, as ``squeue`` and ``sacct`` print them: what
the reconciler (which decisions Slurm held) and the admission catch-up (which decisions the
job_submit plugin made from the published table) read. Pure parsers of text output that every
release prints alike (22.05, 24.11, 26.05: ``squeue -O`` with "|" after each field, ``sacct -P``),
times as Unix seconds (``SLURM_TIME_FORMAT=%s``, honoured by both). The AdminComment is the last
column: it may hold "|" itself."""
from __future__ import annotations

import re
import time
from dataclasses import dataclass

from policy_service.slurm.slurm_text import SQUEUE_TIME_ENV, PendingJob, SlurmError

# Every job state sacct knows (the short codes of 22.05 to 26.05), for "any state" queries:
# without -s sacct lists only jobs that became eligible, and a job held and cancelled never did
# (measured on 22.05).
SACCT_ALL_STATES = "PD,R,RQ,RS,S,CA,CD,DL,F,NF,OOM,PR,TO,BF,RV"
TIME_ENV = SQUEUE_TIME_ENV  # squeue and sacct both print times as Unix seconds with it

# squeue -O: UserId prints the uid ("1001", measured on 24.11; "alice(1001)" is read as well).
# TimeLimit: the job's own limit, which a table-made decision is recorded with (the class key leaves
# it out: admission/catchup.py).
SQUEUE_FIELDS = ("JobId", "SubmitTime", "UserId", "UserName", "Account", "Partition", "State", "TimeLimit",
                 "admin_comment")
SACCT_FIELDS = ("JobIDRaw", "Submit", "UID", "User", "Account", "Partition", "State", "Timelimit", "AdminComment")


@dataclass(frozen=True)
class CommentedJob:
    """One job with its AdminComment, as squeue (live) or sacct (accounting) shows it."""

    job_id: int
    submit_time: int  # Unix seconds; 0: unknown
    uid: int | None  # None: the source did not say
    user: str
    account: str
    partition: str
    state: str
    admin_comment: str
    source: str  # "squeue", "sacct", or "event" (a hook event's job, read by correlation.py)
    time_limit_min: int | None = None  # None: not said, or no limit (UNLIMITED)


def squeue_argv() -> list[str]:
    return ["squeue", "-h", "-a", "-t", "all", "-O", ",".join(f"{f}:|" for f in SQUEUE_FIELDS[:-1])
            + f",{SQUEUE_FIELDS[-1]}:"]


def sacct_argv(since: float) -> list[str]:
    start = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(since))
    return ["sacct", "-a", "-X", "-n", "-P", "-D", "-S", start, "-E", "now", "-s", SACCT_ALL_STATES,
            "-o", ",".join(SACCT_FIELDS)]


def _uid(text: str) -> int | None:
    m = re.fullmatch(r"\s*(?:[^()]*\()?(\d+)\)?\s*", text)
    return int(m.group(1)) if m else None


def _seconds(text: str) -> int:
    text = text.strip()
    return int(text) if text.isdigit() else 0  # "N/A", "Unknown", "None": not known


def _na(text: str) -> str:
    text = text.strip()
    return "" if text in ("N/A", "(null)") else text


def limit_minutes(text: str) -> int | None:
    """Slurm's time limit as squeue and sacct print it ("30", "30:00", "1:00:00", "2-00:00:00",
    "2-12", "2-12:30") in whole minutes, seconds rounded up; None for UNLIMITED, Partition_Limit,
    INVALID, N/A or anything else."""
    m = re.fullmatch(r"\s*(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?\s*", text or "")
    if m is None:
        return None
    days, a, b, c = (int(g) if g is not None else None for g in m.groups())
    if days is not None:  # days-hours[:minutes[:seconds]]
        seconds = ((days * 24 + a) * 60 + (b or 0)) * 60 + (c or 0)
    elif c is not None:  # hours:minutes:seconds
        seconds = (a * 60 + b) * 60 + c
    elif b is not None:  # minutes:seconds
        seconds = a * 60 + b
    else:  # minutes
        seconds = a * 60
    return -(-seconds // 60)


def parse_commented(text: str, source: str) -> list[CommentedJob]:
    """Rows of ``squeue_argv()`` (source "squeue") or ``sacct_argv()`` (source "sacct") output."""
    width = len(SQUEUE_FIELDS)
    out = []
    for line in text.splitlines():
        if line.strip():
            out.append(_commented(line, line.split("|", width - 1), width, source))
    return out


def _commented(line: str, cols: list[str], width: int, source: str) -> CommentedJob:
    """The CommentedJob of a row's columns: SQUEUE_FIELDS' first eight, the AdminComment last."""
    job = cols[0].strip().split("_")[0].split("+")[0]
    if len(cols) < width or not job.isdigit():
        raise SlurmError(f"unexpected {source} line: {line!r}")
    state = cols[6].strip().split()[0] if cols[6].strip() else ""
    comment = cols[-1].strip()
    return CommentedJob(int(job), _seconds(cols[1]), _uid(cols[2]), _na(cols[3]), _na(cols[4]), _na(cols[5]),
                        state, "" if comment == "(null)" else comment, source, limit_minutes(cols[7]))


# One squeue for both the queue monitor and the catch-up (queue_argv): SQUEUE_FIELDS with the
# pending jobs' fields (slurm_text.SQUEUE_PENDING_FORMAT's) before the AdminComment, which stays
# last (it may hold "|"). A reason holding "|" (none of Slurm's own does) is cut there and the rest
# goes before the AdminComment: such a job is no waiting one (queue.WAITING_REASONS), and the
# AdminComment is read from its "swapaware:" prefix on (core/policy.parse_admin_comment).
QUEUE_FIELDS = SQUEUE_FIELDS[:-1] + ("tres-per-node", "tres-per-job", "tres-per-task", "NumNodes", "NumTasks",
                                     "QOS", "Reason", SQUEUE_FIELDS[-1])


def queue_argv() -> list[str]:
    return ["squeue", "-h", "-a", "-t", "all", "-O", ",".join(f"{f}:|" for f in QUEUE_FIELDS[:-1])
            + f",{QUEUE_FIELDS[-1]}:"]


QueueRows = dict[str, tuple[CommentedJob, "PendingJob | None"]]  # a queue row's text -> its parse


def parse_queue(text: str) -> tuple[list[PendingJob], list[CommentedJob]]:
    """Rows of ``queue_argv()`` output: (the pending jobs, as ``squeue -t PENDING`` with
    SQUEUE_PENDING_FORMAT gives them; every job with its AdminComment, source "squeue")."""
    pending, commented, _ = parse_queue_rows(text, {})
    return pending, commented


def parse_queue_rows(text: str, previous: QueueRows) -> tuple[list[PendingJob], list[CommentedJob], QueueRows]:
    """``parse_queue`` and this poll's rows, for the next: a row whose text is the same as in
    ``previous`` (the last poll's) is the same job in the same state and is not parsed again. A
    row costs about 10 us to parse, and every poll reads every job Slurm holds: a queue of
    thousands of held jobs would be parsed whole every queue_poll_s."""
    width = len(QUEUE_FIELDS)
    pending, commented = [], []
    rows: QueueRows = {}
    for line in text.splitlines():
        parsed = previous.get(line)
        if parsed is None:
            if not line.strip():
                continue
            parsed = _queue_row(line, line.split("|", width - 1), width)
        rows[line] = parsed
        commented.append(parsed[0])
        if parsed[1] is not None:
            pending.append(parsed[1])
    return pending, commented, rows


def _queue_row(line: str, cols: list[str], width: int) -> tuple[CommentedJob, PendingJob | None]:
    job = _commented(line, cols, width, "squeue")
    if job.state != "PENDING":
        return job, None
    try:
        nodes, tasks = int(cols[11] or 1), int(cols[12] or 1)
    except ValueError:
        raise SlurmError(f"unexpected squeue line: {line!r}") from None
    return job, PendingJob(job.job_id, _na(cols[8]), _na(cols[9]), _na(cols[10]), max(1, nodes), max(1, tasks),
                           cols[14].strip(), _na(cols[13]))
