"""Safe to break (issue 21, item 4), inside the real slurmctld of the release under test: a broken
admission table (corrupt, truncated, foreign-owned, group-writable, missing, not a regular file, of
another dialect, expired), a missing lua-cjson, lua-socket or lua-posix, and a raising decide() or
table path all leave a GPU job ACCEPTED and UNCHANGED (no AdminComment, its GRES as asked).

Missing modules are simulated inside slurmctld's own Lua state: the test installs the real
job_submit.lua with a package.preload loader that raises for the module in front (require fails
as when the Debian package is absent); nothing is uninstalled. A broken table is shown unchanged by
pointing the plugin's socket at nothing (fail-open), so that only a usable table could change the
job; the same conf with a good table does change it (the control). Since 26.05 a Lua error that
escapes slurm_job_submit rejects the job: the control case raises outside the plugin's pcall and
is rejected there, while the plugin's own errors are not. Every case restores the cluster's
job_submit.lua and swapaware_plugin.conf (finally) and waits until jobs are decided again."""
from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import pytest

from policy_service.core.admission_format import render_table
from tests.slurm_stack import reload_job_submit
from tests.waiting import wait_for

from .conftest import decision_of, job_field
from .test_admission_table import recorded_facts

pytestmark = pytest.mark.integration
WHERE = ("--account=root", "--partition=gpu")
SCRIPT = "#!/bin/sh\ntrue\n"
NAME = f"luabrk-{uuid.uuid4().hex[:6]}"
JOB = ("--gres=gpu:1", f"--job-name={NAME}", *WHERE)
VERSION = "b4d0000" + uuid.uuid4().hex[:9]
DEAD_SOCKET = "/nonexistent/swapaware-breakage.sock"
FOREIGN_UID = 4242


def missing(*modules: str) -> str:
    """Lua that makes require(<module>) fail in this Lua state as when its package is absent."""
    return "".join(f'package.preload["{m}"] = function() error("module \'{m}\' not found (test: absent)") end\n'
                   for m in modules)


@dataclass(frozen=True)
class Submitted:
    rc: int
    shown: str        # scontrol show job -o of the (held, then cancelled) job; "" when rejected
    stderr: str

    @property
    def accepted(self) -> bool:
        return self.rc == 0 and bool(self.shown)


def submit(stack) -> Submitted:
    r = stack.run("sbatch", "--parsable", "--hold", "--output=/dev/null", f"--wrap={SCRIPT.splitlines()[1]}",
                  *JOB, check=False)
    if r.returncode != 0:
        return Submitted(r.returncode, "", r.stderr)
    job = r.stdout.strip().split(";")[0]
    try:
        return Submitted(0, stack.show_job(int(job)), r.stderr)
    finally:
        stack.run("scancel", job, check=False)


def assert_unchanged(stack, s: Submitted, case: str) -> None:
    assert s.accepted, f"{case}: rejected: {s.stderr}"
    comment = job_field(s.shown, "AdminComment")
    assert comment == "", f"{case}: the plugin changed the job: {comment}"
    assert job_field(s.shown, "TresPerNode") == stack.gres("gpu", 1), f"{case}: {s.shown}"


class Log:
    """slurmctld.log from a point on."""

    def __init__(self, stack) -> None:
        self.path = stack.state / "log" / "slurmctld.log"
        self.start = self.path.stat().st_size

    def text(self) -> str:
        with open(self.path, "rb") as f:
            f.seek(self.start)
            return f.read().decode(errors="replace")

    def has(self, *words: str) -> bool:
        return any(all(w in ln for w in words) for ln in self.text().splitlines())


@dataclass
class Lua:
    """Installs a variant of the cluster's job_submit.lua / swapaware_plugin.conf in slurmctld."""
    stack: object
    js: Path
    conf: Path
    js_text: str
    conf_text: str

    def install(self, conf: str, preamble: str = "", before_return: str = "") -> Log:
        """job_submit.lua = the real one with ``preamble`` at its top and ``before_return`` before
        its final return; swapaware_plugin.conf = the cluster's plus ``conf``. Returns slurmctld's log
        from before the load (the probe job that triggers it logs what the new state says once)."""
        token = uuid.uuid4().hex
        head, sep, tail = self.js_text.rpartition("return slurm.SUCCESS")
        assert sep, "job_submit.lua ends with return slurm.SUCCESS"
        before = self.js.stat().st_mtime
        self.conf.write_text(self.conf_text + "\n" + conf + "\n")
        self.js.write_text(f'slurm.log_info("swapaware-test job_submit.lua {token} loaded")\n{preamble}'
                           f"{head}{before_return}\n{sep}{tail}")
        log = Log(self.stack)
        reload_job_submit(self.js, before)

        def loaded() -> bool:
            submit(self.stack)
            return log.has(token)

        wait_for(loaded, 60, f"slurmctld to load job_submit.lua {token}", 1.0)
        return log

    def restore(self) -> None:
        before = self.js.stat().st_mtime
        self.conf.write_text(self.conf_text)
        self.js.write_text(self.js_text)
        reload_job_submit(self.js, before)


@pytest.fixture
def lua(stack) -> Iterator[Lua]:
    etc = stack.state / "etc"
    js, conf = etc / "job_submit.lua", etc / "swapaware_plugin.conf"
    l = Lua(stack, js, conf, js.read_text(), conf.read_text())
    try:
        yield l
    finally:
        l.restore()
        stack.wait_for_decisions(*WHERE)


@pytest.fixture(scope="module")
def key(stack) -> str:
    """The table key of the job submit() sends: the facts the service recorded when it decided
    one (the RPC path)."""
    from policy_service.core.admission import table_key

    s = submit(stack)
    d = decision_of(job_field(s.shown, "AdminComment"))
    assert d.get("id") and "tbl" not in d, s
    return table_key(recorded_facts(stack, d["id"]))


def table_doc(stack, key: str, **over) -> dict:
    shards = stack.gres("shard", 2)
    template = f"swapaware:v1 id=IDIDIDIDIDIDIDID tbl={VERSION}:0000001a mode=enforce action=share shards=2"
    doc = {"format": "swapaware-admission/2", "version": VERSION, "generated_at": time.time(),
           "valid_until": time.time() + 3600, "dialect": stack.dialect.name, "mode": "enforce", "per_qos": False,
           "entries": {key: {"i": 1, "*": {"set": {"tres_per_node": shards, "tres_per_job": "", "site_factor": 0,
                                                   "admin_comment": template}}}}}
    doc.update(over)
    return doc


def put(path: Path, data: bytes, mode: int = 0o644, uid: int = 0) -> None:
    """Replace ``path`` atomically, as the publisher does."""
    if path.is_dir():
        path.rmdir()
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.chmod(tmp, mode)
    os.chown(tmp, uid, uid)
    os.replace(tmp, path)


def table_conf(stack, table: Path, socket: str | None = DEAD_SOCKET) -> str:
    """The plugin reads ``table`` at every job; ``socket`` None: the service's, as configured."""
    conf = f"table={table}\ntable_check_ms=0\ntable_uids=0\nslurm_release={stack.dialect.name}\n"
    return conf if socket is None else conf + f"socket={socket}\n"


def by_table(s: Submitted) -> bool:
    return s.accepted and f"tbl={VERSION}:" in job_field(s.shown, "AdminComment")


@dataclass(frozen=True)
class Broken:
    name: str
    make: Callable[[object, str, Path], None]     # (stack, key, table path)
    reason: str                                    # what the one slurmctld.log line says


def _good(stack, key: str, path: Path) -> None:
    put(path, render_table(table_doc(stack, key)))


BROKEN = (
    Broken("corrupt", lambda st, k, p: put(p, (lambda t: t.replace(t.split(b"\n")[1], b'{"version": \x00\xff\xfe'))(
        render_table(table_doc(st, k)))), "corrupt or truncated"),
    Broken("truncated", lambda st, k, p: put(p, (lambda t: t[: len(t) // 2])(render_table(table_doc(st, k)))),
           "corrupt or truncated"),
    Broken("foreign-owned", lambda st, k, p: put(p, render_table(table_doc(st, k)), uid=FOREIGN_UID),
           f"owned by uid {FOREIGN_UID}"),
    Broken("group-writable", lambda st, k, p: put(p, render_table(table_doc(st, k)), mode=0o664),
           "group or other writable"),
    Broken("missing", lambda st, k, p: p.unlink(), "no such file"),
    Broken("not a regular file", lambda st, k, p: (p.unlink(), p.mkdir()), "not a regular file"),
    Broken("another dialect", lambda st, k, p: put(p, render_table(table_doc(st, k, dialect="21.08"))),
           "dialect 21.08"),
    Broken("expired", lambda st, k, p: put(p, render_table(table_doc(st, k, valid_until=time.time() - 60))),
           "expired"),
    Broken("unknown format", lambda st, k, p: put(p, render_table(table_doc(st, k, format="swapaware-admission/9"))),
           "format swapaware-admission/9 unknown"),
)


def test_a_broken_table_leaves_jobs_accepted_and_unchanged(stack, lua, key):
    """Each breakage in turn, a good table between them (the control: the same conf, the same job,
    decided by the table), the plugin's socket pointing at nothing so only the table could change
    the job."""
    table = stack.state / "run" / f"admission-{NAME}.json"
    _good(stack, key, table)
    lua.install(table_conf(stack, table))
    try:
        assert wait_for(lambda: by_table(submit(stack)), 30, "the good table to decide the job", 0.5)
        failures = []
        for b in BROKEN:
            log = Log(stack)
            b.make(stack, key, table)
            for _ in range(2):
                s = submit(stack)
                try:
                    assert_unchanged(stack, s, b.name)
                except AssertionError as e:
                    failures.append(str(e))
            lines = [ln for ln in log.text().splitlines() if str(table) in ln and b.reason in ln]
            if len(lines) != 1:
                failures.append(f"{b.name}: {len(lines)} log lines saying {b.reason!r}")
            _good(stack, key, table)
            good = submit(stack)
            if not by_table(good):
                failures.append(f"{b.name}: the good table put back did not decide the job: {good}")
        assert not failures, "\n".join(failures)
    finally:
        if table.is_dir():
            table.rmdir()
        table.unlink(missing_ok=True)


def test_a_raising_table_path_leaves_jobs_accepted_and_unchanged(stack, lua, key):
    table = stack.state / "run" / f"admission-{NAME}-raise.json"
    _good(stack, key, table)
    try:
        log = lua.install(table_conf(stack, table), before_return=(
            'package.loaded["swapaware_table"].decide = function() error("swapaware-test: table path raises") end\n'))
        for _ in range(3):
            assert_unchanged(stack, submit(stack), "table path raises")
        assert log.has("admission table path failed", "swapaware-test: table path raises"), log.text()[-3000:]
    finally:
        table.unlink(missing_ok=True)


def test_a_raising_decide_leaves_jobs_accepted_and_unchanged(stack, lua):
    """decide() raises inside the plugin (the facts module's wants_gpu, which it calls, replaced by
    one that errors), the service up: M.submit's pcall holds and the job passes, also on 26.05
    where an escaping error rejects."""
    log = lua.install("", before_return='require("swapaware_facts").wants_gpu = function() '
                                        'error("swapaware-test: decide raises") end\n')
    for _ in range(3):
        assert_unchanged(stack, submit(stack), "decide raises")
    assert log.has("internal error, job passes unchanged", "swapaware-test: decide raises"), log.text()[-3000:]


def test_an_error_escaping_job_submit_is_what_the_pcall_holds_back(stack, lua):
    """The control of the case above: the same error raised by slurm_job_submit itself (outside
    swapaware.submit's pcall). Since 26.05 slurmctld rejects such a job; the plugin's own errors
    never reach it."""
    lua.install("", before_return='function slurm_job_submit() error("swapaware-test: escapes") end\n')
    s = submit(stack)
    if stack.dialect.release >= (26, 5):
        assert not s.accepted, f"an error escaping job_submit was let through on {stack.dialect.name}: {s}"
    else:
        assert s.accepted, f"an error escaping job_submit rejected the job on {stack.dialect.name}: {s.stderr}"
        assert_unchanged(stack, s, "error escaping job_submit")


def test_without_lua_cjson_jobs_pass_unchanged(stack, lua, key):
    """A good table and the service up, both of which would change the job: without lua-cjson
    neither is used."""
    table = stack.state / "run" / f"admission-{NAME}-cjson.json"
    _good(stack, key, table)
    try:
        log = lua.install(table_conf(stack, table, socket=None), preamble=missing("cjson", "cjson.safe"))
        for _ in range(3):
            assert_unchanged(stack, submit(stack), "no lua-cjson")
        assert log.has("lua-cjson is not installed"), log.text()[-3000:]
    finally:
        table.unlink(missing_ok=True)


def test_without_lua_socket_jobs_pass_unchanged(stack, lua):
    """The service up, no table: without lua-socket the plugin cannot reach the service and fails
    open."""
    log = lua.install("table=", preamble=missing("socket", "socket.core", "socket.unix"))
    for _ in range(3):
        assert_unchanged(stack, submit(stack), "no lua-socket")
    assert log.has("lua-socket", "not installed"), log.text()[-3000:]


def test_without_swapaware_facts_jobs_pass_unchanged(stack, lua, key):
    """An upgrade that left swapaware_facts.lua out, a good table and the service up: slurmctld
    still loads job_submit.lua and every job passes as typed (26.05 would reject a job on a Lua
    error escaping job_submit), the log says why."""
    table = stack.state / "run" / f"admission-{NAME}-facts.json"
    _good(stack, key, table)
    try:
        log = lua.install(table_conf(stack, table, socket=None), preamble=missing("swapaware_facts"))
        for _ in range(3):
            assert_unchanged(stack, submit(stack), "no swapaware_facts.lua")
        assert log.has("swapaware_facts.lua cannot be loaded"), log.text()[-3000:]
    finally:
        table.unlink(missing_ok=True)


def test_without_lua_posix_a_table_is_not_used(stack, lua, key):
    table = stack.state / "run" / f"admission-{NAME}-posix.json"
    _good(stack, key, table)
    try:
        log = lua.install(table_conf(stack, table), preamble=missing("posix", "posix.sys.stat"))
        for _ in range(3):
            assert_unchanged(stack, submit(stack), "no lua-posix")
        assert log.has(str(table), "lua-posix"), log.text()[-3000:]
    finally:
        table.unlink(missing_ok=True)

