"""One squeue per queue poll (slurm_comments.queue_argv / parse_queue): the pending jobs the queue
monitor counts and every job's AdminComment the admission catch-up reads, from the same rows, the
same as the two squeues they replace (parse_squeue_pending, parse_commented) read them; a row
unchanged since the last poll is not parsed again (parse_queue_rows)."""
from __future__ import annotations

import pytest

from policy_service.slurm.slurm_comments import (QUEUE_FIELDS, SQUEUE_FIELDS, parse_commented, parse_queue,
                                                 parse_queue_rows, queue_argv, squeue_argv)
from policy_service.slurm.slurm_text import SQUEUE_PENDING_FORMAT, SlurmError, parse_squeue_pending

# (the commented columns, the pending job's columns) of each job, as squeue -O prints them
JOBS = [
    (["41", "1796418925", "1001", "alice", "proj", "gpu", "RUNNING", "1:00:00"],
     ["gres/gpu:1", "N/A", "N/A", "1", "1", "normal", "None"], "swapaware:v1 id=0123456789abcdef why=a|b"),
    (["42", "1796418926", "bob(1002)", "bob", "proj", "gpu", "PENDING", "2-00:00:30"],
     ["gres/gpu:a100:2", "N/A", "N/A", "1", "2", "high", "Resources"], "(null)"),
    (["43_[1-4]", "1796418927", "1003", "carol", "(null)", "gpu", "PENDING", "UNLIMITED"],
     ["N/A", "gres/gpu:2", "N/A", "2", "4", "normal", "Priority"], "swapaware:v1 id=00000000000000aa tbl=x"),
    (["44", "1796418928", "1004", "dave", "proj", "gpu", "PENDING", "30:00"],
     ["gres/shard:2", "N/A", "N/A", "", "", "(null)", "JobHeldUser"], "site note | swapaware:v1 id=00000000000000bb"),
    (["45+1", "N/A", "N/A", "erin", "proj", "gpu", "COMPLETING", "30:00"],
     ["N/A", "N/A", "gres/gpu:1", "1", "1", "normal", "None"], "x"),
]


def rows(which: str) -> str:
    out = []
    for commented, pending, comment in JOBS:
        if which == "queue":
            out.append("|".join(commented + pending + [comment]))
        elif which == "commented":
            out.append("|".join(commented + [comment]))
        elif commented[6] == "PENDING":  # squeue -t PENDING -O SQUEUE_PENDING_FORMAT: job id, GRES, ..., reason
            out.append("|".join([commented[0]] + pending[:6] + [pending[6]]))
    return "\n".join(out) + "\n"


def test_one_squeue_reads_what_the_two_it_replaces_read():
    pending, commented = parse_queue(rows("queue"))
    assert commented == parse_commented(rows("commented"), "squeue")
    assert pending == parse_squeue_pending(rows("pending"))
    assert [j.job_id for j in pending] == [42, 43, 44] and [j.job_id for j in commented] == [41, 42, 43, 44, 45]
    assert pending[0].tres_per_node == "gres/gpu:a100:2" and pending[0].qos == "high" and pending[0].tasks == 2
    assert pending[2].reason == "JobHeldUser" and pending[2].qos == "" and (pending[2].nodes, pending[2].tasks) == (1, 1)
    assert commented[0].admin_comment == "swapaware:v1 id=0123456789abcdef why=a|b"  # "|" in the comment kept
    assert commented[3].admin_comment == "site note | swapaware:v1 id=00000000000000bb"


def test_the_argv_asks_for_each_field_once_the_admin_comment_last():
    argv = queue_argv()
    assert argv[:6] == ["squeue", "-h", "-a", "-t", "all", "-O"] == squeue_argv()[:6]
    fields = [f.rstrip(":|") for f in argv[6].split(",")]
    assert fields == list(QUEUE_FIELDS) and fields[-1] == SQUEUE_FIELDS[-1] == "admin_comment"
    assert argv[6].endswith(",admin_comment:") and argv[6].count(":|") == len(QUEUE_FIELDS) - 1
    pending_fields = [f.rstrip(":|").lower() for f in SQUEUE_PENDING_FORMAT.split(",")][1:]
    assert [f.lower() for f in QUEUE_FIELDS[len(SQUEUE_FIELDS) - 1:-1]] == pending_fields


def test_a_reason_with_a_bar_cuts_the_reason_not_the_admin_comment():
    line = "46|1796418929|1005|fay|proj|gpu|PENDING|30:00|gres/gpu:1|N/A|N/A|1|1|normal|odd|reason|" \
           "swapaware:v1 id=00000000000000cc tbl=y\n"
    (job,), (c,) = parse_queue(line)
    assert job.reason == "odd"  # no waiting reason: the job is not counted as waiting
    assert c.admin_comment.endswith("swapaware:v1 id=00000000000000cc tbl=y")


@pytest.mark.parametrize("line", ["garbage", "x|1|2|3|4|5|PENDING|30|a|b|c|1|1|q|r|c",
                                  "47|1|2|3|4|5|PENDING|30|a|b|c|many|1|q|r|c"])
def test_a_row_it_cannot_read_raises(line):
    with pytest.raises(SlurmError):
        parse_queue(line + "\n")


def test_a_poll_reuses_the_rows_it_read_last_and_parses_what_changed():
    first = rows("queue")
    pending, commented, last = parse_queue_rows(first, {})
    assert (pending, commented) == parse_queue(first) and len(last) == len(JOBS)
    # the next poll: job 42 started (its row changed), 43 left the queue, 46 came
    started = first.replace("|PENDING|2-00:00:30|gres/gpu:a100:2|N/A|N/A|1|2|high|Resources|",
                            "|RUNNING|2-00:00:30|gres/gpu:a100:2|N/A|N/A|1|2|high|None|")
    lines = [ln for ln in started.splitlines() if not ln.startswith("43_")]
    lines.append("46|1796418929|1005|fay|proj|gpu|PENDING|30:00|gres/gpu:1|N/A|N/A|1|1|normal|Priority|(null)")
    second = "\n".join(lines) + "\n"
    pending2, commented2, rows2 = parse_queue_rows(second, last)
    assert (pending2, commented2) == parse_queue(second)  # the same as a fresh parse
    assert [j.job_id for j in pending2] == [44, 46] and commented2[1].state == "RUNNING"
    assert commented2[0] is commented[0] and pending2[0] is pending[2]  # unchanged rows: not parsed again
    assert commented2[1] is not commented[1]  # a changed row is
    assert len(rows2) == 5 and not any(ln.startswith("43_") for ln in rows2)  # what left is forgotten
    with pytest.raises(SlurmError):  # a row it cannot read still raises, whatever it read before
        parse_queue_rows(second + "garbage\n", rows2)
