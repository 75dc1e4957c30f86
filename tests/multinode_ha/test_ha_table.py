"""The admission table with two controllers (docs/ha.md), on real daemons: both services publish
to one path that both controllers' plugins read (beside the shared StateSaveLocation); only the
writer's service writes it. A class the table knows is decided by job_submit.lua alone on the
primary (AdminComment ``tbl=``), then, after ``scontrol takeover``, on the backup; each of those
decisions reaches the one MariaDB history exactly once, recorded by the service that holds the
writer lease when its catch-up finds it (its ``decision {...}`` log line), and the table file is republished by the new
writer while the standby never writes it (the services' ``admission table <version> published``
log lines). Printed: table hits before/after the switch, which table version the backup used,
how soon the new writer published, catch-up time."""
from __future__ import annotations

import collections
import json
import re
import time
import uuid
from pathlib import Path

from policy_service.core.admission_format import read_table
from tests.multinode_ha.bursts import Submission, rows_per, submit_one
from tests.multinode_ha.controllers import in_control, restore_primary, takeover, wait_writer
from tests.slurm_stack import Stack, plugin_table
from tests.waiting import wait_for

PUBLISHED = re.compile(r"admission table ([0-9a-f]+) (?:re-)?published")
NOTE = re.compile(r" decision (\{.*\})\s*$")
REPUBLISH_S = 5.0  # a new writer's first publication: its publisher ticks at least every second


def shared_table(stack: Stack) -> Path:
    """Where contrib/dev-stack.sh puts the table with two controllers (its table_path)."""
    return stack.state / "spool" / "admission.json"


def service_log(stack: Stack, ctl: str) -> Path:
    return stack.state / "log" / f"swapaware-{ctl}.log"


def log_size(stack: Stack, ctl: str) -> int:
    return service_log(stack, ctl).stat().st_size


def log_since(stack: Stack, ctl: str, offset: int) -> str:
    with service_log(stack, ctl).open("rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


def published(stack: Stack, ctl: str, offset: int) -> list[str]:
    """Versions ``ctl``'s service wrote to the table file since ``offset`` of its log."""
    return PUBLISHED.findall(log_since(stack, ctl, offset))


def noted(stack: Stack, ctl: str, offset: int) -> dict[str, dict]:
    """decision id -> the note ``ctl``'s service logged once the decision was in the history."""
    out = {}
    for line in log_since(stack, ctl, offset).splitlines():
        m = NOTE.search(line)
        if m:
            note = json.loads(m.group(1))
            out[note["decision_id"]] = note
    return out


def file_version(table: Path) -> str:
    try:
        return read_table(table.read_bytes())["version"]
    except (OSError, ValueError):  # not there yet
        return ""


def history_count(stack: Stack, ids: list[str]) -> dict[str, int]:
    return rows_per(stack, "decisions", "decision_id", ids)


def plugin_said(stack: Stack, ctl: str, offset: int) -> list[str]:
    """What job_submit.lua on ``ctl`` logged about the table or gate files since ``offset`` of its
    slurmctld log (once per distinct reason), time stamps left out."""
    with (stack.state / "nodes" / ctl / "run" / "slurmctld.log").open("rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace")
    return [line[line.index("admission "):] for line in text.splitlines()
            if "admission file" in line or "admission gate" in line]


def table_version_of(s: Submission) -> str:
    return s.table.split(":")[0]


def gate_states(subs: list[Submission]) -> dict[str, int]:
    """How many table-made decisions per gate state letter (the last character of tbl=)."""
    return dict(collections.Counter(s.table[-1] for s in subs if s.table))


def test_table_decides_on_both_controllers_across_a_takeover(ha_cluster: Stack) -> None:
    stack = ha_cluster
    table = shared_table(stack)
    restore_primary(stack)
    env = {"SWAPAWARE_ADMISSION__TABLE_PATH": str(table), "SWAPAWARE_ADMISSION__REFRESH_S": "1"}
    name = f"ha-tbl-{uuid.uuid4().hex[:6]}"  # one class: the table's key holds the job name
    start2 = log_size(stack, "ctl2")
    with stack.service_with(**env), plugin_table(stack, table):
        restore_primary(stack)
        subs: list[Submission] = []

        def submit() -> Submission:
            s = submit_one(stack, name)
            subs.append(s)
            return s

        first = submit()
        assert first.decision_id and not first.table, first  # a class the table does not know: RPC
        # ... recorded, published by ctl1's service, then decided by slurmctld on ctl1 alone
        wait_for(lambda: submit().table, 90, "the class in ctl1's table, used by job_submit.lua", 1.0)
        learned = len(subs)
        before = [submit() for _ in range(8)]
        assert in_control(stack) == "ctl1"
        ctl1_versions = set(published(stack, "ctl1", 0))
        assert all(s.table and table_version_of(s) in ctl1_versions for s in before), (before, ctl1_versions)
        assert not published(stack, "ctl2", start2), "the standby published the table"

        # scontrol takeover: submissions go on until 8 more were decided from a table on ctl2. Where
        # the backup in control refuses shards after a takeover (22.05: takeover_zero_shards), the
        # gate sends every job to the RPC path there (rpc_only) until ctl1 is back: 8 decided, none
        # from the table.
        zero_shards = stack.dialect.takeover_zero_shards
        off1, off2 = log_size(stack, "ctl1"), log_size(stack, "ctl2")
        ctld2 = (stack.state / "nodes" / "ctl2" / "run" / "slurmctld.log").stat().st_size
        switch_at = time.time()
        takeover(stack)
        wait_for(lambda: in_control(stack) == "ctl2", 30, "ctl2 in control", 0.2)
        after: list[Submission] = []
        while (sum(1 for s in after if (s.decision_id if zero_shards else s.table)) < 8
               and time.time() - switch_at < 90):
            after.append(submit())
        wait_writer(stack, "ctl2")
        writer_at, off1w = time.time(), log_size(stack, "ctl1")
        # the new writer republishes; the file then holds a version ctl2 wrote
        wait_for(lambda: file_version(table) in published(stack, "ctl2", off2), 60,
                 lambda: f"ctl2's version in {table} (file {file_version(table)}, ctl2 "
                         f"{published(stack, 'ctl2', off2)})", 0.2)
        ctl2_first_at = time.time()
        later: list[Submission] = []  # from ctl2's own table
        if not zero_shards:
            wait_for(lambda: (later.append(submit()) or later[-1].table
                              and table_version_of(later[-1]) in published(stack, "ctl2", off2)), 60,
                     lambda: f"a job decided from ctl2's table: {later[-3:]}", 0.5)
        on_backup = [s for s in after + later if s.decision_id]
        made = [s for s in after + later if s.table]

        # each decision (the primary's and the backup's) in the history once
        ids = [s.decision_id for s in before + on_backup]
        last_submitted = max(s.ended for s in on_backup)
        done_at = wait_for(lambda: set(history_count(stack, ids)) == set(ids) and time.time(), 90,
                           lambda: f"{sorted(set(ids) - set(history_count(stack, ids)))} in the history", 0.2)
        counts = history_count(stack, ids)
        # ctl1's service may catch up a decision of the backup's while it still holds the lease (until
        # ctl1's PrimaryOffProg), from its own archive; once ctl2 holds it, only ctl2's service writes
        notes2, notes1 = noted(stack, "ctl2", off2), noted(stack, "ctl1", off1)
        notes1_late = noted(stack, "ctl1", off1w)
        archived = sum(1 for s in made if {**notes1, **notes2}.get(s.decision_id, {}).get("archived"))
        standby_published = published(stack, "ctl1", off1w)
        print(f"\n[ha-table] {learned} submissions until the class was in ctl1's table; on ctl1: "
              f"{sum(1 for s in before if s.table)}/{len(before)} from the table (gate {gate_states(before)}); "
              f"after the takeover: {len(after)} submissions until 8 table hits, "
              f"{sum(1 for s in after if s.table)} from a table ({sum(1 for s in after if not s.decision_id)} "
              f"undecided), of ctl1's version {sum(1 for s in made if table_version_of(s) in ctl1_versions)}, "
              f"of ctl2's {sum(1 for s in made if table_version_of(s) not in ctl1_versions)} (gate "
              f"{gate_states(after + later)}); ctl2 the writer +{writer_at - switch_at:.1f} s, its table in the "
              f"file +{ctl2_first_at - switch_at:.1f} s; all {len(on_backup)} decisions of the backup (and the "
              f"primary's {len(before)}) in the history +{done_at - switch_at:.1f} s after the switch "
              f"({done_at - last_submitted:.1f} s after the last submission); table-made recorded by ctl2 "
              f"{sum(1 for s in made if s.decision_id in notes2)}/{len(made)}, by ctl1 (before ctl2 held the lease) "
              f"{sum(1 for s in made if s.decision_id in notes1)}; "
              f"from an archived template {archived}, from the AdminComment alone {len(made) - archived}; "
              f"ctl1 published after the switch "
              f"{published(stack, 'ctl1', off1)}, after ctl2 held the lease {standby_published}")
        rpc = [s for s in after if s.decision_id and not s.table]
        print(f"[ha-table] on ctl2 after the takeover: {len(rpc)} by the RPC path"
              + (f" (submitted +{min(s.started for s in rpc) - switch_at:.1f} to +"
                 f"{max(s.ended for s in rpc) - switch_at:.1f} s)" if rpc else "")
              + f"; its plugin said: {plugin_said(stack, 'ctl2', ctld2)}")
        if zero_shards:
            assert not made and len(on_backup) >= 8, after
        else:
            assert len(made) >= 8, after
        assert set(counts.values()) == {1}, counts
        # the catch-up archive lives in the MariaDB history, shared: whichever service records a
        # table-made decision finds its version there, ctl1's too (none from the AdminComment alone)
        assert archived == len(made), (archived, made, notes1, notes2)
        # each recorded by one service, the one holding the lease then
        assert all((s.decision_id in notes1) != (s.decision_id in notes2) for s in made), (made, notes1, notes2)
        assert not [s for s in made if s.decision_id in notes1_late], (made, notes1_late)
        assert not standby_published, standby_published  # the standby never writes the table

        # control back to ctl1: its service, the writer again, republishes at once
        off1r = log_size(stack, "ctl1")
        back_at = time.time()
        restore_primary(stack)  # returns once ctl1 holds the writer lease
        lease_back_at = time.time()
        wait_for(lambda: file_version(table) in published(stack, "ctl1", off1r), 60,
                 lambda: f"ctl1's version in {table} again (file {file_version(table)})", 0.2)
        republished_at = time.time()
        back = wait_for(lambda: (lambda s: s.table and s)(submit()), 60, "a job decided from ctl1's table again", 0.5)
        assert table_version_of(back) in published(stack, "ctl1", off1r), back
        print(f"[ha-table] control back to ctl1: the writer lease +{lease_back_at - back_at:.1f} s, its table in "
              f"the file {republished_at - lease_back_at:.1f} s after that")
        # a new writer publishes at its first tick (at most 1 s) whatever the table file holds
        assert ctl2_first_at - writer_at <= REPUBLISH_S and republished_at - lease_back_at <= REPUBLISH_S
