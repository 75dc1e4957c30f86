"""What the submit benches (submit_burst.py, submit_overhead.py) share for the admission table path
and for timing the plugin's Lua inside slurmctld.

- The dev stack must be up with SWAPAWARE_DEV_TABLE=1: the service publishes the table
  ([admission] table_path) and swapaware_plugin.conf names it (table=). Mode ``on`` (the round
  trip) comments the conf's table= out, mode ``table`` puts it back; slurmctld reads the conf
  when it loads job_submit.lua (every mode switch restarts it).
- ``warm``: one RPC decision per job name the bench submits, then wait until the published table
  holds each job's key (the facts the service recorded, through core.admission.table_key): in
  mode ``table`` every job of the bench is of a class the table knows.
- ``timed_lua_dir``: the plugin's Lua files with a job_submit.lua that times swapaware.submit
  (lua-socket's clock) and logs the sum every BATCH calls to slurmctld.log; ``lua_us`` reads the
  mean per call back from the log after an offset. The timing adds two clock reads per job.
"""
from __future__ import annotations

import json
import re
import sqlite3
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = ROOT / "slurm_plugin"
BATCH = 16
LUA_RE = re.compile(r"swapaware-bench lua n=(\d+) us=([0-9.]+)")
ID_RE = re.compile(r"swapaware:v1 id=([0-9a-f]{16})")
# A job_submit.lua that returns at once: what loading any job_submit.lua costs or saves in Slurm
# itself, apart from swapaware (the benches' mode noop).
NOOP_LUA = ("function slurm_job_submit(job_desc, part_list, submit_uid) return slurm.SUCCESS end\n"
            "function slurm_job_modify(job_desc, job_rec, part_list, modify_uid) return slurm.SUCCESS end\n")
TIMED = f"""
local bench_clock = require("socket").gettime
local bench_n, bench_s = 0, 0
function slurm_job_submit(job_desc, part_list, submit_uid)
  local t0 = bench_clock()
  local rc = swapaware.submit(job_desc, part_list, submit_uid)
  bench_s = bench_s + (bench_clock() - t0)
  bench_n = bench_n + 1
  if bench_n == {BATCH} then
    slurm.log_info("swapaware-bench lua n=%d us=%.1f", bench_n, bench_s * 1e6)
    bench_n, bench_s = 0, 0
  end
  return rc
end
"""


def dev_dir(env: dict[str, str]) -> Path:
    return Path(env["SWAPAWARE_DEV_DIR"])


def plugin_conf(env: dict[str, str]) -> Path:
    return dev_dir(env) / "etc" / "swapaware_plugin.conf"


def ctld_log(env: dict[str, str]) -> Path:
    return dev_dir(env) / "log" / "slurmctld.log"


def table_path(env: dict[str, str]) -> Path:
    """The table swapaware_plugin.conf names (commented out or not)."""
    found = re.findall(r"^(?:#bench-rpc )?table=(/\S+)$", plugin_conf(env).read_text(), re.M)
    if not found:
        raise SystemExit(f"{plugin_conf(env)} names no table: bring the dev stack up with SWAPAWARE_DEV_TABLE=1")
    return Path(found[-1])


def wait_gate_after(env: dict[str, str], since: float, timeout_s: float = 120) -> float:
    """Wait until the queue gate's snapshot was taken after ``since`` (a slurmctld (re)start: the
    plugin takes no decision from a gate older than its slurmctld, swapaware_table.lua); seconds
    waited."""
    table = table_path(env)
    gate = table.with_name(table.name + ".gate")
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            if json.loads(gate.read_text()).get("taken_at", 0) >= since + 1:
                break
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        time.sleep(0.2)
    else:
        raise SystemExit(f"{gate}: no queue snapshot after the restart in {timeout_s:.0f} s")
    return time.monotonic() - t0


def table_on(env: dict[str, str]) -> bool:
    """Whether swapaware_plugin.conf names a table now (the mode to put back after a bench)."""
    return re.search(r"^table=/", plugin_conf(env).read_text(), re.M) is not None


def set_table(env: dict[str, str], on: bool) -> None:
    """swapaware_plugin.conf's table= on (mode table) or off (mode on: the round trip): its path
    commented out and an empty table= after it (with no table= line the plugin looks beside its
    socket, where the service publishes by default); read by slurmctld at its next load of
    job_submit.lua. Off without a table named: nothing to do."""
    if on or table_on(env):
        table_path(env)
    conf = plugin_conf(env)
    text = conf.read_text()
    if on:
        text = re.sub(r"^#bench-rpc (table=.*)\ntable=$", r"\1", text, flags=re.M)
    else:
        text = re.sub(r"^(table=/.*)$", r"#bench-rpc \1\ntable=", text, flags=re.M)
    conf.write_text(text)


def plugin_files(rev: str = "") -> dict[str, str]:
    """The plugin's Lua files by name: the tree's, those of directory ``rev`` (its *.lua, or its
    slurm_plugin/*.lua), or those of git revision ``rev`` (git is not in the release roots: there
    pass a directory, e.g. `git archive REV slurm_plugin | tar -x -C base` inside the checkout)."""
    if not rev:
        return {f.name: f.read_text() for f in PLUGIN.glob("*.lua")}
    if Path(rev).is_dir():
        d = Path(rev) / "slurm_plugin" if (Path(rev) / "slurm_plugin").is_dir() else Path(rev)
        return {f.name: f.read_text() for f in d.glob("*.lua")}
    names = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", rev, "slurm_plugin/"], check=True,
                           capture_output=True, text=True).stdout.split()
    return {Path(n).name: subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{n}"], check=True,
                                         capture_output=True, text=True).stdout
            for n in names if n.endswith(".lua")}


def timed_lua_dir(dst: Path, rev: str = "", null: bool = False) -> Path:
    """``dst`` with the plugin's Lua files (the tree's, or those of ``rev``: plugin_files),
    job_submit.lua timing swapaware.submit (``null``: timing a call that returns at once instead,
    with swapaware's modules loaded all the same)."""
    dst.mkdir(parents=True, exist_ok=True)
    for name, text in plugin_files(rev).items():
        f = dst / name
        if f.name == "job_submit.lua":
            head, sep, tail = text.partition("function slurm_job_submit(")
            body_end = tail.index("\nend\n") + len("\nend\n")
            assert sep, "job_submit.lua defines slurm_job_submit"
            timed = TIMED.replace("swapaware.submit(job_desc, part_list, submit_uid)", "slurm.SUCCESS") if null else TIMED
            text = head + timed + tail[body_end:]
        f.write_text(text)
    return dst


def log_size(env: dict[str, str]) -> int:
    return ctld_log(env).stat().st_size


def lua_us(env: dict[str, str], offset: int) -> tuple[int, float]:
    """(calls, summed microseconds) the timed job_submit.lua logged since ``offset``."""
    with open(ctld_log(env), "rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace")
    n = s = 0.0
    for m in LUA_RE.finditer(text):
        n += int(m.group(1))
        s += float(m.group(2))
    return int(n), s


def submit_held(env: dict[str, str], name: str) -> str:
    r = subprocess.run(["sbatch", "--parsable", "--hold", "--gres=gpu:1", f"--job-name={name}", "--wrap=true",
                        "--output=/dev/null"], env=env, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise SystemExit(f"sbatch failed: {r.stderr.strip()}")
    return r.stdout.strip().split(";")[0]


def admin_comment(env: dict[str, str], job: str) -> str:
    from policy_service.slurm.slurm_text import scontrol_field

    r = subprocess.run(["scontrol", "show", "job", "-o", job], env=env, capture_output=True, text=True, timeout=60)
    return scontrol_field(r.stdout, "AdminComment") or ""


def history_db(env: dict[str, str]) -> Path:
    return dev_dir(env) / "lib" / "history.sqlite3"


def wait(predicate, timeout_s: float, what: str, interval_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while True:
        got = predicate()
        if got:
            return got
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)


def facts_of(env: dict[str, str], decision_id: str):
    from policy_service._generated.swapaware.v1 import policy_pb2 as pb

    def row():
        with sqlite3.connect(f"file:{history_db(env)}?mode=ro", uri=True) as db:
            return db.execute("SELECT facts_pb FROM decisions WHERE decision_id=?", (decision_id,)).fetchone()

    return pb.JobFacts.FromString(wait(row, 60, f"decision {decision_id} in the history")[0])


def warm(env: dict[str, str], names: list[str], timeout_s: float = 180, keys: dict | None = None) -> float:
    """One RPC decision per name (the plugin on, table= off), then wait until the published table
    holds every name's key. Returns the seconds the table took to hold them; ``keys`` (if given)
    gets each name's table key."""
    from policy_service.core.admission import table_key
    from policy_service.core.admission_format import read_table

    keys = {} if keys is None else keys
    for name in names:
        job = submit_held(env, name)
        try:
            m = ID_RE.search(admin_comment(env, job))
            if not m:
                raise SystemExit(f"job {job} ({name}) got no decision from the service")
            keys[name] = table_key(facts_of(env, m.group(1)))
        finally:
            subprocess.run(["scancel", job], env=env, timeout=60)
    path, t0 = table_path(env), time.monotonic()

    def held() -> bool:
        try:
            entries = read_table(path.read_bytes())["entries"]
        except (OSError, ValueError, KeyError):
            return False
        return all(k in entries for k in keys.values())

    wait(held, timeout_s, f"{path} to hold the keys of {len(names)} job names", 1.0)
    return time.monotonic() - t0


def table_sets(env: dict[str, str], keys: dict[str, str]) -> dict[str, dict]:
    """Per job name, the job_desc assignments the published table makes for its key (the entry's
    first state; the bench's gate state is not known here)."""
    from policy_service.core.admission_format import read_table

    entries = read_table(table_path(env).read_bytes())["entries"]
    return {name: next(d for s, d in entries[key].items() if s != "i")["set"] for name, key in keys.items()}


def rewrite_lua(sets: dict[str, dict]) -> str:
    """A job_submit.lua that, at once, makes the assignments ``sets`` gives for the job's name: the
    job slurmctld creates is shaped as a table decision would shape it (shards, site factor, an
    AdminComment of the same length), with no swapaware code run. The comment is disguised
    (``swapaware:v1`` and ``tbl=`` renamed, the same length) so the service's catch-up never takes
    it for a decision."""
    from policy_service.core.admission import PLACEHOLDER_ID

    def lua_str(v: str) -> str:
        return json.dumps(v)   # ASCII: a JSON string literal is a Lua one

    rows = []
    for name, st in sets.items():
        fields = []
        for k, v in st.items():
            if k == "admin_comment":
                v = v.replace("swapaware:v1", "benchmark:v0").replace(" tbl=", " tbX=").replace(PLACEHOLDER_ID, "0" * 16)
            fields.append(f"{k} = {v if isinstance(v, int) else lua_str(v)}")
        rows.append(f"  [{lua_str(name)}] = {{ {', '.join(fields)} }},")
    return ("local SETS = {\n" + "\n".join(rows) + "\n}\n"
            "function slurm_job_submit(job_desc, part_list, submit_uid)\n"
            "  local set = SETS[job_desc.name]\n"
            "  if set then for k, v in pairs(set) do job_desc[k] = v end end\n"
            "  return slurm.SUCCESS\n"
            "end\n"
            "function slurm_job_modify(job_desc, job_rec, part_list, modify_uid) return slurm.SUCCESS end\n")
