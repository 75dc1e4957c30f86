"""job_submit's Lua module, run by the real Lua 5.1 with Debian's lua-socket and lua-cjson,
against the real service's local socket."""
import json
import os
import shutil
import socket
import subprocess
import threading
from pathlib import Path

import pytest

from policy_service.core.request import script_fingerprint

ROOT = Path(__file__).resolve().parents[3]
DRIVER = Path(__file__).parents[1] / "lua_driver.lua"
GIB = 1024**3

if shutil.which("lua5.1") is None:
    if os.environ.get("CI"):
        raise RuntimeError("lua5.1 is missing: contrib/dev-cluster/cluster.sh install provides it")
    pytest.skip("lua5.1 not installed (run contrib/dev-cluster/cluster.sh install)", allow_module_level=True)


# The plugin's deadline in these tests: long enough for a real service on a loaded 2-core CI machine
# (at 500 ms, an Admit under load 6 once came back too late and the job passed undecided); the tests
# of the deadline itself (a hung service) set their own.
DEADLINE_MS = 5000


def run_lua(settings_dir: Path, jobs: list[dict], sock: Path, timeout_ms: int = DEADLINE_MS) -> dict:
    settings_dir.mkdir(parents=True, exist_ok=True)
    (settings_dir / "swapaware_plugin.conf").write_text(f"socket={sock}\ntimeout_ms={timeout_ms}\nbreaker_s=30\n")
    r = subprocess.run(["lua5.1", str(DRIVER), str(ROOT / "slurm_plugin"), str(settings_dir)],
                       input=json.dumps(jobs), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


SCRIPT = "#!/bin/bash\n#SBATCH --gres=gpu:1\npython train.py --epochs 3  # caf\u00e9\n" + "x" * 200


def gpu_job(**kw):
    job = {"user_name": "alice", "account": "proj", "partition": "gpu", "name": "train",
           "tres_per_node": "gres:gpu:1", "time_limit": 60, "min_nodes": 4294967294, "script": SCRIPT,
           "work_dir": "/home/alice", "comment": ""}
    job.update(kw)
    return job


def teach(service, client, slurm_jobs, fingerprint, peak):
    """One observed run of alice/train with this script, so the next submission can share."""
    from policy_service._generated.swapaware.v1 import policy_pb2 as pb
    d = client.admit(pb.JobFacts(user="alice", account="proj", partition="gpu", job_name="train",
                                 tres_per_node="gres:gpu:1", script_fingerprint=fingerprint)).decision
    slurm_jobs.comments[1] = d.rewrite.admin_comment
    client.call("JobFinished", pb.JobFinishedRequest(job_id=1, node="n", finished_at=2000.0, started_at=1000.0,
                                                     event_id="teach", peak_gpu_bytes=peak))


def test_fingerprint_matches_python(tmp_path):
    scripts = ["", "a", SCRIPT, "\x00\xff" * 100, "y" * 70_000]
    out = run_lua(tmp_path, [{"script": s} for s in scripts], tmp_path / "none.sock")
    got = [r["fingerprint"] for r in out["results"]]
    # the driver hands Lua the UTF-8 bytes of each string, as a script file would hold them
    assert got == [script_fingerprint(s.encode()) for s in scripts]


def test_fingerprint_matches_python_at_every_length_and_byte(tmp_path):
    """The Lua fingerprint works twelve bytes at a time and reduces once per three or four bytes:
    the same value as Python's byte at a time, for every length around the chunk size and the 4 KiB
    read limit, and for bytes up to the largest UTF-8 has."""
    import random
    rng = random.Random(21)
    alphabet = [chr(c) for c in range(1, 128)] + ["ÿ", "߿", "￿", "􏿿"]
    lengths = list(range(0, 40)) + list(range(4080, 4112)) + [5000, 12 * 1000 + 7]
    scripts = ["".join(rng.choice(alphabet) for _ in range(n)) for n in lengths]
    scripts += ["􏿿" * 1100, "" * 4097]      # every byte 0xf4/0x8f/0xbf, the limit + 1
    scripts += scripts[::-1]      # seen again: from the plugin's memo of the last 16, or hashed again
    out = run_lua(tmp_path, [{"script": s} for s in scripts], tmp_path / "none.sock")
    got = [r["fingerprint"] for r in out["results"]]
    assert got == [script_fingerprint(s.encode()) for s in scripts]


def test_unknown_job_gets_record_and_a_whole_gpu(service, tmp_path):
    out = run_lua(tmp_path, [gpu_job()], service.socket_path)
    (res,) = out["results"]
    assert res["rc"] == 0
    assert res["job"]["tres_per_node"] == "gres:shard:8"  # the whole GPU, as all of its shards
    assert res["job"]["admin_comment"].startswith("swapaware:v1 id=")
    assert res["job"]["site_factor"] == 0  # the plain value: slurmctld's setter adds its offset
    d_id = res["job"]["admin_comment"].split()[1].removeprefix("id=")
    service.handler.flush()
    row = service.store.decision(d_id)
    assert json.loads(row.facts_json)["scriptFingerprint"] == script_fingerprint(SCRIPT.encode())
    assert "script" not in json.loads(row.facts_json)  # the script's text never leaves slurmctld
    assert json.loads(row.facts_json).get("qos", "") == ""  # no --qos: the association's default


def test_the_jobs_qos_reaches_the_service(service, tmp_path):
    out = run_lua(tmp_path, [gpu_job(qos="high")], service.socket_path)
    d_id = out["results"][0]["job"]["admin_comment"].split()[1].removeprefix("id=")
    service.handler.flush()
    assert json.loads(service.store.decision(d_id).facts_json)["qos"] == "high"


@pytest.mark.parametrize("tell", [False, True])
def test_known_job_is_rewritten_to_shards(tell, service_env, slurm_jobs, tmp_path):
    """The user is told of the rewrite (slurm.log_user: sbatch's stderr) only where the site asks
    (policy.tell_users); by default sbatch prints what it prints without swapaware."""
    from policy_service.serving.client import PolicyClient
    from policy_service.config import load_config
    from policy_service.serving.server import start_service
    service = start_service(load_config(env={**service_env, "SWAPAWARE_POLICY__TELL_USERS": str(tell).lower()}),
                            slurm=slurm_jobs)
    try:
        with PolicyClient(f"127.0.0.1:{service.grpc_port}", 5.0) as client:
            teach(service, client, slurm_jobs, script_fingerprint(SCRIPT.encode()), 3 * GIB)
        out = run_lua(tmp_path, [gpu_job(), gpu_job(tres_per_node="", tres_per_job="gres:gpu:1")],
                      service.socket_path)
    finally:
        service.stop(0)
    first, second = out["results"]
    assert first["job"]["tres_per_node"] == "gres:shard:1"
    assert second["job"]["tres_per_node"] == "gres:shard:1" and second["job"]["tres_per_job"] == ""
    if tell:
        assert len(out["user"]) == 2 and all("rewritten to 1 shard" in m for m in out["user"]), out["user"]
    else:
        assert not out["user"], out["user"]


def test_a_test_only_query_is_left_as_typed_and_records_nothing(service, client, slurm_jobs, tmp_path):
    """sbatch/srun --test-only reach job_submit as a real submission would; cli_filter marks their
    comment (swapaware_cli.mark_test_only) and the plugin answers nothing: no rewrite, no AdminComment,
    no decision. The same job without the mark is decided (a shareable class)."""
    teach(service, client, slurm_jobs, script_fingerprint(SCRIPT.encode()), 3 * GIB)
    service.handler.flush()
    before = len(list(service.store.decisions()))
    out = run_lua(tmp_path, [gpu_job(comment="swapaware:test-only"),
                             gpu_job(comment="swapaware:mem=2G swapaware:test-only")], service.socket_path)
    for res in out["results"]:
        assert res["job"]["tres_per_node"] == "gres:gpu:1" and "admin_comment" not in res["job"], res
    service.handler.flush()
    assert len(list(service.store.decisions())) == before
    real = run_lua(tmp_path, [gpu_job()], service.socket_path)["results"][0]
    assert real["job"]["tres_per_node"] == "gres:shard:1" and "admin_comment" in real["job"]


@pytest.mark.parametrize("line", ["srun --gpu-bind=closest python train.py", "export SLURM_GPU_BIND=none",
                                  "srun --tres-bind=gres/gpu:closest ./a"])
def test_a_script_whose_steps_bind_gpus_keeps_its_request(service, client, slurm_jobs, tmp_path, line):
    """A step holding shards gets no CUDA_VISIBLE_DEVICES under a GPU binding and cli_filter cannot
    take a --gpu-bind away (srun refuses an empty one; 22.05 and 26.05): such a job keeps its gpu."""
    script = SCRIPT + line + "\n"
    teach(service, client, slurm_jobs, script_fingerprint(script.encode()), 3 * GIB)
    res = run_lua(tmp_path, [gpu_job(script=script), gpu_job()], service.socket_path)["results"]
    assert res[0]["job"]["tres_per_node"] == "gres:gpu:1", res[0]
    assert "action=whole_gpu" in res[0]["job"]["admin_comment"] and "per_gpu_option" in res[0]["job"]["admin_comment"]


def test_non_gpu_job_never_calls_the_service(service, tmp_path):
    out = run_lua(tmp_path, [gpu_job(tres_per_node="gres:nvme:1")], service.socket_path)
    assert "admin_comment" not in out["results"][0]["job"]
    service.handler.flush()
    assert list(service.store.decisions()) == []


def test_service_down_fails_open_and_opens_the_breaker(tmp_path):
    out = run_lua(tmp_path, [gpu_job(), gpu_job()], tmp_path / "missing.sock")
    for res in out["results"]:
        assert res["rc"] == 0 and res["job"]["tres_per_node"] == "gres:gpu:1" and "admin_comment" not in res["job"]
    assert any("fail-open" in line for line in out["logs"])
    assert any("circuit open" in line for line in out["logs"])


def hung_server(path: Path):
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(8)
    held = []
    stop = threading.Event()

    def loop():
        srv.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
                held.append(conn)  # read nothing, answer nothing
            except socket.timeout:
                pass
            except OSError:
                return

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    return srv, stop, held


def test_hung_service_costs_one_timeout_then_breaker_skips(tmp_path):
    path = tmp_path / "hung.sock"
    srv, stop, held = hung_server(path)
    try:
        out = run_lua(tmp_path / "s", [gpu_job(), gpu_job(), gpu_job()], path, timeout_ms=200)
    finally:
        stop.set()
        srv.close()
    first, *rest = out["results"]
    assert 0.15 <= first["elapsed_s"] < 1.0
    assert all(r["elapsed_s"] < 0.05 for r in rest)  # skipped by the open breaker
    assert all(r["job"]["tres_per_node"] == "gres:gpu:1" for r in out["results"])


@pytest.mark.parametrize("reply", [
    {"response": {"decision": {"rewrite": {"tresPerNode": 5}}}},
    {"response": {"decision": {"rewrite": {"siteFactor": 2**40}}}},
    {"response": {"decision": {"rewrite": {"tresPerNode": "gres:shard:1;rm -rf", "adminComment": "x"}}}},
    {"response": {"decision": {"rewrite": {"tresPerNode": "gres:shard:1", "evil": "x"}}}},
    {"response": {}},
    {"error": {"code": "INTERNAL", "message": "boom"}},
])
def test_invalid_reply_applies_nothing(tmp_path, reply):
    path = tmp_path / "fake.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(1)

    def answer():
        conn, _ = srv.accept()
        conn.makefile("rb").readline()
        conn.sendall(json.dumps(reply).encode() + b"\n")
        conn.close()

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    out = run_lua(tmp_path / "s", [gpu_job()], path)
    t.join(5)
    srv.close()
    job = out["results"][0]["job"]
    assert job["tres_per_node"] == "gres:gpu:1" and "admin_comment" not in job and "site_factor" not in job
    assert any("passes unchanged" in line for line in out["logs"])


def unix_server(path: Path, serve) -> tuple[socket.socket, threading.Event, dict]:
    """A service stand-in on ``path``: each connection handled by ``serve(conn)`` in its own thread;
    counts connections."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(8)
    srv.settimeout(0.1)
    stats = {"connections": 0}
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            stats["connections"] += 1
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=loop, daemon=True).start()
    return srv, stop, stats


def counting_server(path: Path, close_after_each: bool):
    """Answers every line with a share decision; counts connections and requests."""
    reply = json.dumps({"response": {"decision": {"decisionId": "x", "rewrite": {"tresPerNode": "gres:shard:2"}}}})
    requests = {"requests": 0}

    def serve(conn):
        with conn:
            for _line in conn.makefile("rb"):
                requests["requests"] += 1
                conn.sendall(reply.encode() + b"\n")
                if close_after_each:
                    return

    srv, stop, stats = unix_server(path, serve)
    return srv, stop, (stats, requests)


@pytest.mark.parametrize("close_after_each,connections", [(False, 1), (True, 3)])
def test_connection_is_kept_and_a_stale_one_replaced(tmp_path, close_after_each, connections):
    path = tmp_path / "svc.sock"
    srv, stop, stats = counting_server(path, close_after_each)
    try:
        out = run_lua(tmp_path / "s", [gpu_job(), gpu_job(), gpu_job()], path)
    finally:
        stop.set()
        srv.close()
    assert [r["job"]["tres_per_node"] for r in out["results"]] == ["gres:shard:2"] * 3
    assert (stats[0]["connections"], stats[1]["requests"]) == (connections, 3)
    assert not any("fail-open" in line for line in out["logs"])


def test_service_socket_serves_many_requests_on_one_connection(service):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(str(service.socket_path))
        f = s.makefile("rb")
        for _ in range(3):
            s.sendall(b'{"method":"Admit","request":{"job":{"user":"u","tresPerNode":"gres:gpu:1"}}}\n')
            assert b'"decision"' in f.readline()


def test_srun_salloc_allocations_and_het_jobs_keep_their_request(service, tmp_path):
    srun = gpu_job()
    del srun["script"]  # job_desc.script is nil for the allocations srun and salloc create
    # het_job_offset: 4294967294 (NO_VAL) for plain jobs, 0, 1, ... for a heterogeneous job's components
    het0 = gpu_job(het_job_offset=0)
    plain = gpu_job(het_job_offset=4294967294, name="plain")
    out = run_lua(tmp_path, [srun, het0, plain], service.socket_path)
    assert "why=het_job" not in out["results"][2]["job"]["admin_comment"]
    for res, code, gres in zip(out["results"], ("interactive", "het_job"), ("gres:gpu:1", "gres:gpu:1")):
        assert res["rc"] == 0 and res["job"]["tres_per_node"] == gres  # as typed
        assert f"why={code}" in res["job"]["admin_comment"] and res["job"]["site_factor"] == 0


def test_a_comment_or_name_at_slurms_limit_gets_a_decision(service, tmp_path):
    """slurmctld takes a --comment and a --job-name of up to 1,024 bytes: such a job is decided,
    its hint read, its UTF-8 kept whole."""
    job = gpu_job(comment="swapaware:mem=2G " + "x" * (1024 - 17), name="\u00e9" * 512)
    assert len(job["comment"].encode()) == 1024 and len(job["name"].encode()) == 1024
    out = run_lua(tmp_path, [job], service.socket_path)
    res = out["results"][0]
    assert res["rc"] == 0 and "swapaware: job passes unchanged" not in " ".join(out["logs"]), out["logs"]
    assert "hint_used" in res["job"]["admin_comment"], res["job"]["admin_comment"]


@pytest.mark.parametrize("field,value", [
    ("comment", "swapaware:mem=2G " + "x" * (1025 - 17)),  # 1,025 bytes: the measured case
    ("comment", "y" * 4096),
    ("name", "\u00e9" * 513),  # 1,026 bytes
    ("account", "a" * 1025),
    ("work_dir", "/" + "d" * 4096),
    ("mail_user", "m" * 1025),  # not read by the plugin: Slurm refuses the job all the same
    ("tres_per_node", "gres:gpu:1," + "x" * 1024),  # a rewrite would have made it one Slurm takes
])
def test_a_field_over_slurms_limit_leaves_no_decision(service, tmp_path, field, value):
    """Before: a job with a 1,025-4,096-byte --comment was decided and recorded, then slurmctld
    refused it (it checks its field limits after job_submit): 300 refused submissions left 300
    decisions and no job. Now the plugin leaves it as typed and asks the service nothing."""
    out = run_lua(tmp_path, [gpu_job(**{field: value}), gpu_job()], service.socket_path)
    over, normal = out["results"]
    assert over["rc"] == 0 and "admin_comment" not in over["job"]
    assert over["job"]["tres_per_node"] == gpu_job(**{field: value})["tres_per_node"]  # as typed
    assert normal["job"]["admin_comment"].startswith("swapaware:v1")
    size = len(value.encode())
    assert any(f"{field} is {size} bytes" in line and "slurmctld refuses" in line for line in out["logs"]), out["logs"]
    service.handler.flush()
    assert len(list(service.store.decisions())) == 1  # the normal job's alone


# ----------------------------------------------------------------------------- bounded, clean facts
def test_fingerprint_of_any_script_reads_at_most_4_kib(tmp_path):
    """Scripts up to 4 KiB keep their fingerprint (all of it hashed); a longer one is hashed by its
    head, tail and length, the same in Lua and Python, stable for one script, and a change in its
    middle is not seen (the price of a bounded cost) while one in its head, tail or length is."""
    big = "#!/bin/sh\n" + "echo step\n" * 1_000_000  # 10 MB
    variants = [big, big, big[:5000] + "Z" + big[5001:], "Z" + big[1:], big[:-1] + "Z", big + "\n",
                "q" * 4096, "q" * 4097]
    out = run_lua(tmp_path, [{"script": s} for s in variants], tmp_path / "none.sock")
    got = [r["fingerprint"] for r in out["results"]]
    assert got == [script_fingerprint(s.encode()) for s in variants]
    assert got[0] == got[1] == got[2]
    assert len({got[0], got[3], got[4], got[5]}) == 4
    assert got[6] != got[7]


def test_a_10_mb_script_costs_what_a_short_one_costs(tmp_path):
    """The Lua side's time for the fingerprint, measured side by side in one run: a 10 MB script
    against a 4 KiB one (ratio, not a wall-clock bound: the machine is shared). The plugin's memo of
    recent scripts is turned off (FP_MEMO_BYTES 0): it would answer the 4 KiB script from memory
    and not the 10 MB one, which is over its size limit."""
    lua = ('package.path = arg[1] .. "/?.lua;" .. package.path\n'
           'local M = require("swapaware"); local socket = require("socket")\n'
           'require("swapaware_facts").FP_MEMO_BYTES = 0\n'
           'local function t(s) local t0 = socket.gettime(); for _ = 1, 20 do M.fingerprint(s) end\n'
           '  return (socket.gettime() - t0) / 20 end\n'
           'local small, big = string.rep("x", 4096), string.rep("echo step\\n", 1000000)\n'
           'local a, b, c, d = t(small), t(big), t(small), t(big)\n'
           'print(string.format("%.6f %.6f", math.min(a, c), math.min(b, d)))\n')
    script = tmp_path / "t.lua"
    script.write_text(lua)
    r = subprocess.run(["lua5.1", str(script), str(ROOT / "slurm_plugin")], capture_output=True, text=True,
                       timeout=60)
    small_s, big_s = map(float, r.stdout.split())
    print(f"\nfingerprint in Lua: 4 KiB script {small_s * 1e3:.3f} ms, 10 MB script {big_s * 1e3:.3f} ms")
    assert big_s < 3 * small_s + 1e-4


def valid_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8", errors="strict")
        return True
    except UnicodeDecodeError:
        return False


def test_utf8_clean_replaces_each_stray_byte_and_keeps_valid_text(tmp_path):
    import random
    rng = random.Random(7)
    cases = [b"", b"plain", "caf\u00e9 \u4e2d\u6587 \U0001f600".encode(), b"\xff", b"a\xffb", b"\xc3",
             b"\xc0\xaf", b"\xe0\x80\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xf5\x80\x80\x80",
             "ok\u00e9".encode() + b"\x80" + "\u00e9".encode()]
    cases += [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40))) for _ in range(600)]
    cases += ["".join(chr(rng.choice([rng.randrange(32, 127), rng.randrange(160, 0xD7FF),
                                      rng.randrange(0x10000, 0x10FFFF)])) for _ in range(20)).encode()
              for _ in range(200)]
    out = run_lua(tmp_path, [{"clean_hex": c.hex()} for c in cases], tmp_path / "none.sock")
    for raw, res in zip(cases, out["results"]):
        cleaned = bytes.fromhex(res["cleaned_hex"])
        assert valid_utf8(cleaned), (raw, cleaned)
        assert len(cleaned) == len(raw)
        assert all(c == o or c == ord("?") for c, o in zip(cleaned, raw)), (raw, cleaned)
        if valid_utf8(raw):
            assert cleaned == raw
    assert bytes.fromhex(out["results"][4]["cleaned_hex"]) == b"a?b"


def test_invalid_utf8_in_a_jobs_fields_still_gets_a_decision(service, tmp_path):
    """Before: `--comment $'\\xff'` made the service answer INVALID_ARGUMENT and the job skipped the policy."""
    job = gpu_job(comment={"hex": b"run \xff\xfe mem=2G".hex()}, name={"hex": b"tr\xc3ain".hex()})
    out = run_lua(tmp_path, [job], service.socket_path)
    res = out["results"][0]
    assert res["facts"]["comment"] == "run ?? mem=2G" and res["facts"]["jobName"] == "tr?ain"
    assert res["job"]["admin_comment"].startswith("swapaware:v1"), out["logs"]
    assert not any("passes unchanged" in line for line in out["logs"])


@pytest.mark.parametrize("err, stale", [
    ("receive: closed", True), ("send: closed", True), ("send: Broken pipe", True),
    ("receive: Connection reset by peer", True),
    ("timeout", False), ("receive: timeout", False), ("send: timeout", False), ("connect x: refused", False),
])
def test_only_a_closed_kept_connection_is_retried(tmp_path, err, stale):
    """Before: the retry compared the error with "timeout", but a timed-out receive says "receive:
    timeout": an Admit the service was still deciding was sent twice."""
    out = run_lua(tmp_path, [{"stale_error": err}], tmp_path / "none.sock")
    assert out["results"][0]["stale"] is stale


def test_a_hung_kept_connection_sends_the_request_once(tmp_path):
    """The first Admit is answered on a kept connection, then the service hangs: the second Admit
    times out and is not sent again on a fresh connection (the service would decide it twice)."""
    path = tmp_path / "s.sock"
    lines: list[bytes] = []
    reply = {"response": {"decision": {"decisionId": "d1", "rewrite": {"adminComment": "swapaware:v1 id=d1"}}}}

    def serve(conn):
        f = conn.makefile("rb")
        first = True
        while not stop.is_set():
            line = f.readline()
            if not line:
                return
            lines.append(line)
            if first:
                conn.sendall(json.dumps(reply).encode() + b"\n")
                first = False  # then hang: read on, answer nothing

    srv, stop, _stats = unix_server(path, serve)
    try:
        out = run_lua(tmp_path / "s", [gpu_job(), gpu_job(name="second")], path, timeout_ms=300)
    finally:
        stop.set()
        srv.close()
    first, second = out["results"]
    assert first["job"]["admin_comment"] == "swapaware:v1 id=d1"
    assert "admin_comment" not in second["job"]
    assert len(lines) == 2 and b"second" in lines[1], lines


def test_a_script_slurm_will_refuse_is_not_decided(service, tmp_path):
    """Before: a 10 MB script got a recorded decision (and "gpu request rewritten") for a job that
    slurmctld then refused for its max_script_size (4 MiB by default)."""
    big = gpu_job(script="#!/bin/sh\n" + "x" * (4 * 1024 * 1024))
    out = run_lua(tmp_path, [big, gpu_job()], service.socket_path)
    refused, normal = out["results"]
    assert "admin_comment" not in refused["job"] and normal["job"]["admin_comment"].startswith("swapaware:v1")
    assert any("over max_script_bytes=4194304" in line for line in out["logs"])
    service.handler.flush()
    assert len(list(service.store.decisions())) == 1


# ----------------------------------------------------------------------------- per-GPU options, --exclusive
@pytest.mark.parametrize("extra,code", [
    ({"cpus_per_tres": "gres:gpu:2"}, "per_gpu_option"),
    ({"mem_per_tres": "gres:gpu:1024"}, "per_gpu_option"),
    ({"ntasks_per_tres": 2, "num_tasks": 2}, "per_gpu_option"),
    ({"tres_bind": "gpu:closest"}, "per_gpu_option"),
    ({"tres_freq": "gpu:high"}, "per_gpu_option"),
    ({"shared": 0}, "exclusive"),
    ({"shared": 2}, "exclusive"),
    ({"shared": 1}, None),  # --oversubscribe: shares as a plain request does
    ({"shared": 65534, "ntasks_per_tres": 65534}, None),  # unset, as job_desc reads it
    ({"tres_per_node": "gres:gpu:a100:1"}, None),  # typed: shares within its type
])
def test_per_gpu_options_and_exclusive_reach_the_service_and_keep_the_request(service, client, slurm_jobs,
                                                                              tmp_path, extra, code):
    """job_desc values as slurmctld 22.05 gives them (tests/golden): a class that shares keeps its
    request whole, untouched (not even held as all of a GPU's shards), with the reason in the record."""
    teach(service, client, slurm_jobs, script_fingerprint(SCRIPT.encode()), 3 * GIB)
    out = run_lua(tmp_path, [gpu_job(**extra)], service.socket_path)
    job = out["results"][0]["job"]
    d_id = job["admin_comment"].split()[1].removeprefix("id=")
    if code is None:
        typed = "a100:" if "a100" in extra.get("tres_per_node", "") else ""
        assert job["tres_per_node"] == f"gres:shard:{typed}1", job
        return
    assert job["tres_per_node"] == "gres:gpu:1", job
    assert "action=whole_gpu" in job["admin_comment"] and code in job["admin_comment"], job["admin_comment"]
    service.handler.flush()
    facts = json.loads(service.store.decision(d_id).facts_json)
    for key, field in (("cpusPerTres", "cpus_per_tres"), ("memPerTres", "mem_per_tres"), ("tresBind", "tres_bind"),
                       ("tresFreq", "tres_freq")):
        assert facts.get(key, "") == extra.get(field, ""), facts
    assert facts.get("exclusive", "") == {0: "node", 2: "user"}.get(extra.get("shared"), "")
