"""The report's HTML page renders in headless Chromium (Debian's `chromium`): the browser loads the
file with the network off, the DOM it builds holds the tables and the inline plots, and a
screenshot is taken (kept beside the test's page; its pixels are not all one colour)."""
from __future__ import annotations

import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import pytest

from policy_service.report import build_report
from policy_service.report.command import write_html
from tests.unit.report.test_report import T0, GIB, World, world  # noqa: F401  (the fixture)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed "
                                "(contrib/run-tests.sh installs it)")


def chromium(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                           "--disable-dev-shm-usage", "--proxy-server=127.0.0.1:9", "--proxy-bypass-list=<-loopback>",
                           *args], capture_output=True, text=True, timeout=timeout)


def png_colours(path: Path, limit: int = 50) -> int:
    """How many distinct pixel values the first rows of an 8-bit RGB(A) PNG hold (stops at ``limit``)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width, colour = 8, b"", 0, 0
    while pos < len(data):
        (n,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            width, colour = struct.unpack(">I", body[:4])[0], body[9]
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    channels = {2: 3, 6: 4}[colour]
    raw = zlib.decompress(idat)
    stride = 1 + width * channels
    seen = set()
    for row in range(min(len(raw) // stride, 600)):  # filter bytes aside, raw pixel bytes differ with content
        line = raw[row * stride + 1:(row + 1) * stride]
        seen.update(line[i:i + channels] for i in range(0, len(line), channels * 7))
        if len(seen) >= limit:
            break
    return len(seen)


def test_the_page_renders_in_headless_chromium(world, tmp_path):  # noqa: F811
    world.job(401, submit=T0, wait_s=30, run_s=3600, peak=3 * GIB)
    world.job(402, submit=T0 + 4000, run_s=7200, peak=int(3.2 * GIB))
    world.job(403, user="bob", submit=T0 + 8000, run_s=600, peak=GIB)
    world.flush()
    rep = build_report(world.slurm.accounting_jobs(), *_history(world), by="user", shards_per_gpu=8,
                       now=float(T0 + 90000))
    page = tmp_path / "report.html"
    write_html(page, rep, with_jobs=True)

    dom = chromium("--dump-dom", page.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert "<h2>Summary</h2>" in dom.stdout and "<td>alice</td>" in dom.stdout and "<td>bob</td>" in dom.stdout
    assert dom.stdout.count("data:image/png;base64,") == 4

    shot = tmp_path / "report.png"
    r = chromium(f"--screenshot={shot}", "--window-size=1280,1600", "--hide-scrollbars", page.as_uri())
    assert r.returncode == 0 and shot.is_file(), r.stderr[-2000:]
    assert shot.stat().st_size > 20_000  # a page with tables and four plots, not a blank one
    assert png_colours(shot) >= 20


def _history(w: World):
    from policy_service.report.join import read_history

    return (read_history(w.db, [j.job_id for j in w.slurm.accounting_jobs()]),)
