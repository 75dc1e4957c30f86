"""The job_submit plugin's admission table path inside the real slurmctld (slurm_plugin/
swapaware_table.lua with Debian's lua-posix): a job whose key the table holds is decided with no
call to the service; a job it does not hold, and every job once the table may not be used, takes
the RPC path. The table is written here (keyed by the facts the service recorded for the same job
through the RPC path), so this runs without the service's publisher."""
from __future__ import annotations

import os
import re
import time
import uuid
from pathlib import Path

import pytest

from policy_service.core.admission_format import read_table, render_table
from tests.slurm_stack import plugin_table
from tests.waiting import wait_for

from .conftest import decision_of, job_field

pytestmark = pytest.mark.integration
WHERE = ("--account=root", "--partition=gpu")
VERSION = "5eed0000" + uuid.uuid4().hex[:8]
SCRIPT = "#!/bin/sh\ntrue\n"


def plugin_release(stack) -> str:
    """swapaware_plugin.conf's slurm_release (cluster.sh writes it with SWAPAWARE_DEV_TABLE=1): the
    dialect a table must name; "" when absent (not checked)."""
    conf = (stack.state / "etc" / "swapaware_plugin.conf").read_text()
    found = re.findall(r"^slurm_release=(.*)$", conf, re.M)
    return found[-1].strip() if found else ""


def recorded_facts(stack, decision_id: str):
    from policy_service._generated.swapaware.v1 import policy_pb2 as pb

    def row():
        with stack.history() as db:
            return db.execute("SELECT facts_pb FROM decisions WHERE decision_id=?", (decision_id,)).fetchone()

    return pb.JobFacts.FromString(wait_for(row, 30, f"decision {decision_id} in the history", 0.3)[0])


def asked(stack, decision_id: str) -> bool:
    """The history holds the decision as one the service made when asked (an Admit). A table-made
    decision may be there too, learned from Slurm by catch-up after a queue poll that came
    between the job's submission and this look: its reasons then name the table (table_decided,
    or table_gone for a version the service never published)."""
    from policy_service._generated.swapaware.v1 import policy_pb2 as pb
    from policy_service.core.types import ReasonCode

    with stack.history() as db:
        row = db.execute("SELECT decision_pb FROM decisions WHERE decision_id=?", (decision_id,)).fetchone()
    if row is None:
        return False
    codes = {r.code for r in pb.Decision.FromString(row[0]).reasons}
    return not codes & {ReasonCode.TABLE_DECIDED.value, ReasonCode.TABLE_GONE.value}


def test_a_job_the_table_holds_is_decided_in_slurmctld_without_the_service(stack):
    from policy_service.core.admission import table_key

    name = f"tbl-{uuid.uuid4().hex[:6]}"
    args = ("--gres=gpu:1", f"--job-name={name}", *WHERE)
    rpc = decision_of(job_field(stack.held(SCRIPT, *args), "AdminComment"))
    assert rpc.get("id") and "tbl" not in rpc          # decided by the service (RPC path)
    key = table_key(recorded_facts(stack, rpc["id"]))
    shards = stack.gres("shard", 2)
    template = f"swapaware:v1 id=IDIDIDIDIDIDIDID tbl={VERSION}:0000001a mode=enforce action=share shards=2"
    doc = {"format": "swapaware-admission/2", "version": VERSION, "generated_at": time.time(),
           "valid_until": time.time() + 3600, "dialect": plugin_release(stack), "mode": "enforce", "per_qos": False,
           "entries": {key: {"i": 1, "*": {"set": {"tres_per_node": shards, "tres_per_job": "", "site_factor": 0,
                                                   "admin_comment": template}}}}}
    table = stack.state / "run" / f"admission-{name}.json"
    tmp = table.with_name(table.name + ".tmp")
    tmp.write_bytes(render_table(doc))
    os.chmod(tmp, 0o644)
    os.replace(tmp, table)
    log = stack.state / "log" / "slurmctld.log"

    with plugin_table(stack, table):
        def by_table():
            shown = stack.held(SCRIPT, *args)
            return shown if f"tbl={VERSION}:" in job_field(shown, "AdminComment") else None

        shown = wait_for(by_table, 60, "slurmctld to load job_submit.lua with the table", 1.0)
        comment = job_field(shown, "AdminComment")
        d = decision_of(comment)
        assert re.fullmatch(r"[0-9a-f]{16}", d["id"]) and d["id"] != rpc["id"], comment
        assert comment == template.replace("IDIDIDIDIDIDIDID", d["id"])
        assert shards in job_field(shown, "TresPerNode")
        assert not asked(stack, d["id"])                  # the service was not asked
        # another class: the RPC path, as before
        other = decision_of(job_field(stack.held(SCRIPT, "--gres=gpu:1", f"--job-name={name}-x", *WHERE),
                                      "AdminComment"))
        assert "tbl" not in other and other.get("id")
        recorded_facts(stack, other["id"])
        # a table that may not be used is not: the RPC path, one log line
        os.chmod(table, 0o664)
        spoiled = [decision_of(job_field(stack.held(SCRIPT, *args), "AdminComment")) for _ in range(2)]
        assert all("tbl" not in d and d.get("id") for d in spoiled), spoiled
        lines = [ln for ln in log.read_text(errors="replace").splitlines()
                 if str(table) in ln and "group or other writable" in ln]
        assert len(lines) == 1, lines


def test_the_services_published_table_decides_a_job_in_slurmctld(stack):
    """End to end: the service (table_path set, refresh 2 s) publishes the key of a job it decided;
    the same job submitted again is decided by slurmctld's Lua from that table."""
    from policy_service.core.admission import table_key

    table = stack.state / "run" / "admission-e2e.json"
    name = f"tble2e-{uuid.uuid4().hex[:6]}"
    args = ("--gres=gpu:1", f"--job-name={name}", *WHERE)
    with stack.service_with(SWAPAWARE_ADMISSION__TABLE_PATH=str(table), SWAPAWARE_ADMISSION__REFRESH_S="2"), \
            plugin_table(stack, table):
        rpc = decision_of(job_field(stack.held(SCRIPT, *args), "AdminComment"))
        key = table_key(recorded_facts(stack, rpc["id"]))

        def published():
            try:
                doc = read_table(table.read_bytes())
            except (OSError, ValueError):
                return None
            return doc if key in doc["entries"] else None

        doc = wait_for(published, 60, f"the key of {name} in {table}", 0.5)
        assert table.stat().st_mode & 0o022 == 0 and table.stat().st_uid == 0

        def by_table():
            shown = stack.held(SCRIPT, *args)
            return shown if " tbl=" in job_field(shown, "AdminComment") else None

        comment = job_field(wait_for(by_table, 30, "a job decided from the published table", 1.0), "AdminComment")
        d = decision_of(comment)
        version, entry = d["tbl"][:16], int(d["tbl"][17:-1])
        assert re.fullmatch(r"[0-9a-f]{16}", d["id"]) and d["id"] != rpc["id"], comment
        assert d["action"] == rpc["action"] and d["shards"] == rpc["shards"] and d["why"] == rpc["why"], (rpc, d)
        # the publication read above or a later one: its entry for this key is the one named
        named = [v for v in (doc, read_table(table.read_bytes())) if v["version"] == version]
        assert named and named[0]["entries"][key]["i"] == entry, (comment, doc["version"])
