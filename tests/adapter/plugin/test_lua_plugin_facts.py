"""job_submit's Lua module, the facts it sends: the script fingerprint (the same as Python's at every
length and byte, at most 4 KiB read, a 10 MB script costing what a short one does) and UTF-8 made
clean byte for byte (a job with invalid UTF-8 in its fields still gets a decision).

The harness (run_lua, gpu_job...) is test_lua_plugin.py's."""
import subprocess

from policy_service.core.request import script_fingerprint
from tests.adapter.plugin.test_lua_plugin import ROOT, SCRIPT, gpu_job, run_lua, valid_utf8


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
    """The fingerprint of a 10 MB script reads what that of a 4 KiB one reads: the bytes asked of
    string.byte, counted (the module captures the counting wrapper when it loads), not the time,
    which on a shared machine measured the machine (CI run 16: 0.506 against 0.100 ms, for the
    same 4,096 bytes read). The plugin's memo of recent scripts is turned off (FP_MEMO_BYTES 0):
    it would answer the 4 KiB script from memory and not the 10 MB one, which is over its size
    limit."""
    lua = ('local read = 0; local byte = string.byte\n'
           'string.byte = function(s, i, j) i = i or 1; read = read + math.max(0, math.min(j or i, #s) - i + 1)\n'
           '  return byte(s, i, j) end\n'
           'package.path = arg[1] .. "/?.lua;" .. package.path\n'
           'local M = require("swapaware"); local F = require("swapaware_facts"); F.FP_MEMO_BYTES = 0\n'
           'local function bytes(s) read = 0; M.fingerprint(s); return read end\n'
           'local small, big = string.rep("x", 4096), string.rep("echo step\\n", 1000000)\n'
           'print(string.format("%d %d %d %d", bytes(small), bytes(big), #big, F.FP_LIMIT))\n')
    script = tmp_path / "t.lua"
    script.write_text(lua)
    r = subprocess.run(["lua5.1", str(script), str(ROOT / "slurm_plugin")], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    small_read, big_read, big_len, limit = map(int, r.stdout.split())
    print(f"\nfingerprint in Lua: bytes read of a 4 KiB script {small_read}, of a {big_len:,}-byte one {big_read}")
    assert small_read == 4096 and big_len == 10_000_000
    assert big_read <= limit + len(str(big_len))  # its head, its tail and its length's digits


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
