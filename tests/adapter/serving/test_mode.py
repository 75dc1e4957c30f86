"""policy.mode on a real service process: shadow decides and records but leaves the job as
submitted (only its AdminComment, with mode=shadow), off decides nothing, and SIGHUP switches the
mode live; a broken config on SIGHUP changes nothing."""
from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from pathlib import Path

from policy_service.history.store import HistoryStore
from policy_service.config import load_config
from policy_service.serving.handler import PolicyHandler
from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from tests.waiting import wait_for

from tests.adapter.conftest import SlurmJobs, socket_call

ROOT = Path(__file__).resolve().parents[3]
SERVE = ("import faulthandler, signal, sys\n"
         "from pathlib import Path\n"
         "faulthandler.register(signal.SIGUSR1, all_threads=True)  # (unexplained(): every thread's stack)\n"
         "from policy_service.config import load_config\n"
         "from policy_service.serving.server import serve_forever\n"
         "path = Path(sys.argv[1])\n"
         "serve_forever(load_config(path, env={}), reload=lambda: load_config(path, env={}), use_slurm=False)\n")


def config(d: Path, mode: str) -> str:
    return (f'[service]\ndb_path = "{d}/history.sqlite3"\nsocket_path = "{d}/policy.sock"\n'
            f'grpc_address = "127.0.0.1:0"\n[policy]\nmode = "{mode}"\nshare_min_queue = 0\n'
            'redecide_pending = false\n')


@contextlib.contextmanager
def service(d: Path, mode: str):
    conf = d / "swapaware.toml"
    conf.write_text(config(d, mode))
    log = (d / "service.log").open("w")
    p = subprocess.Popen([sys.executable, "-c", SERVE, str(conf)], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: (d / "policy.sock").exists() or p.poll() is not None, 30, lambda: "the service to listen")
        assert p.poll() is None, (d / "service.log").read_text()
        yield p, conf
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(15)
        log.close()


def unexplained(p: subprocess.Popen, d: Path, what: str):
    """wait_for's ``what`` for a wait on the service: on a timeout, what was awaited, then the
    service's log with the stack of each of its threads (SERVE registers faulthandler on SIGUSR1),
    so that a wait that timed out says where the service was."""
    def explain() -> str:
        log = d / "service.log"
        if p.poll() is None:
            p.send_signal(signal.SIGUSR1)
            deadline = time.monotonic() + 5
            while "most recent call first" not in log.read_text() and time.monotonic() < deadline:
                time.sleep(0.05)
        return f"{what}; the service's log (exit {p.poll()}):\n{log.read_text()[-12000:]}"
    return explain


def admit(d: Path, name: str) -> dict:
    reply = socket_call(d / "policy.sock", {"method": "Admit", "request": {"brief": True, "job": {
        "user": "alice", "uid": 1000, "jobName": name, "tresPerNode": "gres:gpu:1"}}}, timeout_s=10)
    return reply["response"]["decision"]


def recorded(d: Path) -> dict[str, str]:
    """decision id -> mode, of what the history holds."""
    store = HistoryStore(d / "history.sqlite3")
    try:
        return {row.decision_id: row.decision.mode for row in store.decisions()}
    finally:
        store.close()


def test_shadow_then_enforce_then_off_switched_live(short_dir):
    d = short_dir
    with service(d, "shadow") as (p, conf):
        shadow = admit(d, "train")
        assert set(shadow["rewrite"]) == {"adminComment"}  # no GRES, no site factor, no message
        assert " mode=shadow " in shadow["rewrite"]["adminComment"]
        assert f"id={shadow['decisionId']}" in shadow["rewrite"]["adminComment"]

        conf.write_text(config(d, "enforce"))
        p.send_signal(signal.SIGHUP)
        wait_for(lambda: "policy.mode: shadow -> enforce" in (d / "service.log").read_text(), 15,
                 unexplained(p, d, "the service to apply the new mode"))
        enforced = admit(d, "train")
        assert "mode=shadow" not in enforced["rewrite"]["adminComment"]
        assert "tresPerNode" in enforced["rewrite"]  # 22.05 semantics by default: whole GPU held as shards

        conf.write_text(config(d, "off"))
        p.send_signal(signal.SIGHUP)
        wait_for(lambda: "policy.mode: enforce -> off" in (d / "service.log").read_text(), 15,
                 unexplained(p, d, "the service to apply the new mode"))
        off = admit(d, "train")
        assert off.get("rewrite", {}) == {} and not off.get("decisionId")
        assert off["reasons"][0]["code"] == "mode_off"

        conf.write_text("[policy]\nmode = 'sideways'\n")  # does not load: nothing changes
        p.send_signal(signal.SIGHUP)
        wait_for(lambda: "config not reloaded, policy.mode stays off" in (d / "service.log").read_text(), 15,
                 unexplained(p, d, "the service to refuse the broken config"))
        assert admit(d, "train")["reasons"][0]["code"] == "mode_off"
        assert p.poll() is None
    got = recorded(d)
    assert got == {shadow["decisionId"]: "shadow", enforced["decisionId"]: "enforce"}


def test_a_shadow_decisions_run_is_learned_as_a_whole_gpu_run(short_dir):
    """The job of a shadow 'share' decision ran on its whole GPU: its observation is not shared."""
    cfg = load_config(env={"SWAPAWARE_SERVICE__DB_PATH": str(short_dir / "h.sqlite3"),
                           "SWAPAWARE_POLICY__MODE": "shadow", "SWAPAWARE_POLICY__SHARE_MIN_QUEUE": "0"})
    store = HistoryStore(cfg.service.db_path)
    slurm = SlurmJobs()
    h = PolicyHandler(cfg, store, slurm)

    def run(job_id: int, peak: int, exit_code: int = 0) -> pb.Decision:
        reply = h.admit(pb.AdmitRequest(job=job)).decision
        slurm.set_admin_comment(job_id, reply.rewrite.admin_comment)  # what slurmctld keeps
        h.job_finished(pb.JobFinishedRequest(job_id=job_id, node="n1", gpu_indices=[0], started_at=10.0,
                                             finished_at=100.0, exit_code=exit_code, peak_gpu_bytes=peak,
                                             event_id=f"e{job_id}"))
        return h.explain(pb.ExplainRequest(decision_id=reply.decision_id)).decision

    try:
        job = pb.JobFacts(user="alice", uid=1000, job_name="t", tres_per_node="gres:gpu:1")
        for i in range(3):  # history: the class now shares
            run(i + 1, 4 << 30)
        d = run(9, 70 << 30, exit_code=1)
        assert d.mode == "shadow" and d.action in (pb.ACTION_SHARE, pb.ACTION_SHARE_OVERSUBSCRIBED)
        h.flush()
        (obs,) = [o for o in store.observations(decision_id=d.decision_id)]
        assert obs.shared is False and obs.oom is False  # a failed whole-GPU run is not an OOM of its shards
    finally:
        h.close()
        store.close()


# serve_forever with a reload that arrives while the service starts: its socket is up (start_service
# made it) and the rest is still starting, as `systemctl reload` right after `start` can find it
SERVE_HUP_DURING_START = ("import os, signal, sys\n"
                          "from pathlib import Path\n"
                          "from policy_service.serving import server\n"
                          "from policy_service.config import load_config\n"
                          "started = server.start_service\n"
                          "def starting(*a, **kw):\n"
                          "    svc = started(*a, **kw)\n"
                          "    Path(sys.argv[1]).write_text(sys.argv[2])\n"
                          "    os.kill(os.getpid(), signal.SIGHUP)\n"
                          "    return svc\n"
                          "server.start_service = starting\n"
                          "path = Path(sys.argv[1])\n"
                          "server.serve_forever(load_config(path, env={}), reload=lambda: load_config(path, env={}),"
                          " use_slurm=False)\n")


def test_a_reload_while_the_service_starts_is_applied_not_fatal(short_dir):
    """SIGHUP while the service starts (its socket up, the admission table's publisher and the rest
    starting): applied once it has started, and the service lives. SIGHUP's handler used to be
    installed after the start, and a reload in that window killed the service (SIGHUP's default
    action; seen under load once the table was on by default)."""
    d = short_dir
    conf = d / "swapaware.toml"
    conf.write_text(config(d, "shadow"))
    with (d / "service.log").open("w") as log:
        p = subprocess.Popen([sys.executable, "-c", SERVE_HUP_DURING_START, str(conf), config(d, "enforce")],
                             cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_for(lambda: "policy.mode: shadow -> enforce" in (d / "service.log").read_text() or
                     p.poll() is not None, 30, lambda: "the service to apply the new mode")
            assert p.poll() is None, (p.returncode, (d / "service.log").read_text())
            assert "mode=shadow" not in admit(d, "train")["rewrite"]["adminComment"]
        finally:
            p.send_signal(signal.SIGTERM)
            p.wait(15)


def test_a_burst_of_reloads_then_sigterm_applies_the_last_and_stops(short_dir):
    """SIGHUPs in a burst, then SIGTERM: the last config is applied and the service stops, however
    the signals fall against its main loop. Its handlers used to set an Event the loop waited on: a
    signal handled while the main thread held that Event's lock (entering wait()) waited for it
    forever, and no reload or SIGTERM was acted on again (a SIGHUP never applied, seen once under
    load). Now the signals are read from a pipe (signal_wait.py)."""
    d = short_dir
    with service(d, "shadow") as (p, conf):
        for i in range(300):
            conf.write_text(config(d, "enforce" if i % 2 == 0 else "shadow"))
            p.send_signal(signal.SIGHUP)
        conf.write_text(config(d, "off"))
        p.send_signal(signal.SIGHUP)
        wait_for(lambda: "-> off" in (d / "service.log").read_text(), 30,
                 unexplained(p, d, "the service to apply the last config"))
        assert admit(d, "train")["reasons"][0]["code"] == "mode_off"
        p.send_signal(signal.SIGTERM)
        wait_for(lambda: p.poll() is not None, 30, unexplained(p, d, "the service to stop on SIGTERM"))
        assert p.returncode == 0
