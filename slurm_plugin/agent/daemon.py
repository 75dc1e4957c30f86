"""Per-node agent: samples GPU memory for the jobs the prolog and epilog announce.

Slurm kills whatever a prolog leaves running, so sampling lives in this daemon. This module is
its command line (``swapaware-agent``, ``python -m slurm_plugin.agent.daemon``): config, daemonizing,
logging, the hooks' spool replayer and metrics, then the socket until a signal. The rest is
split by what it does, beside it in ``slurm_plugin/agent/``: ``protocol`` (the JSON-lines
requests), ``state`` (the pure per-job bookkeeping and the stop report, ``oom_suspected`` included),
``sampler`` (``Agent``: locks, clocks, device and /proc reads, the sampling loop), ``server``
(``AgentServer``: the socket and the threads), ``metrics`` (Prometheus), ``procs`` (the /proc and
kernel-log parsers) and ``attribution`` (which job a process's memory is charged to: the kernel's
word only).
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import logging.handlers
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Sequence

from policy_service.config import ConfigError, load_config
from policy_service.signal_wait import SignalWait
from slurm_plugin.agent.sampler import Agent
from slurm_plugin.agent.server import AgentServer
from slurm_plugin.gpu.nvml import TelemetryError, open_telemetry

log = logging.getLogger("swapaware.agent")


def _daemonize() -> None:
    """Classic double fork; stdio to /dev/null."""
    if os.fork() > 0:
        os._exit(0)
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)


def _setup_logging(level: str, foreground: bool) -> None:
    if foreground or not Path("/dev/log").exists():
        handler: logging.Handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    else:
        handler = logging.handlers.SysLogHandler(address="/dev/log")
        handler.setFormatter(logging.Formatter("swapaware-agent[%(process)d]: %(levelname)s %(message)s"))
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), handlers=[handler], force=True)


# A batch of 500 events may take the service seconds (each is its own transaction); the agent is
# not in a job's way, unlike the hooks, so it waits longer than hooks.deadline_s.
REPLAY_DEADLINE_S = 60.0


def main(argv: Sequence[str] | None = None) -> int:
    """Console script ``swapaware-agent``."""
    parser = argparse.ArgumentParser(prog="swapaware-agent", description="swapaware per-node GPU telemetry agent")
    parser.add_argument("--config", type=Path, default=None, help="TOML config (default: SWAPAWARE_CONFIG or "
                                                                    "/etc/swapaware/swapaware.toml)")
    parser.add_argument("--socket", type=Path, default=None, help="override agent.socket_path")
    parser.add_argument("--foreground", action="store_true", help="do not daemonize; log to stderr")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        sys.stderr.write(f"swapaware-agent: {exc}\n")
        return 2
    agent_cfg = cfg.agent if args.socket is None else dataclasses.replace(cfg.agent, socket_path=args.socket)
    if not args.foreground:
        _daemonize()
    _setup_logging(cfg.service.log_level, args.foreground)
    log.info("%s", cfg.summary())
    try:
        telemetry = open_telemetry(agent_cfg, log)
    except TelemetryError as exc:
        log.error("%s", exc)
        return 1
    agent = Agent(agent_cfg, telemetry)
    done = threading.Event()
    if agent_cfg.replay:
        from slurm_plugin.hooks.run import hook_client
        from slurm_plugin.hooks.replayer import SpoolReplayer

        replay_hooks = dataclasses.replace(cfg.hooks, deadline_s=max(cfg.hooks.deadline_s, REPLAY_DEADLINE_S))
        agent.replayer = SpoolReplayer(cfg.hooks.spool_dir, lambda: hook_client(replay_hooks, cfg.auth, cfg.tls, cfg.ha),
                                       agent_cfg.replay_interval_s, agent_cfg.replay_max_backoff_s)
        agent.replayer.start(done)
        log.info("delivering the hooks' spool %s every %.0f s (backoff up to %.0f s)", cfg.hooks.spool_dir,
                 agent_cfg.replay_interval_s, agent_cfg.replay_max_backoff_s)
    if agent_cfg.metrics_address:
        from slurm_plugin.agent.metrics import serve as serve_metrics

        serve_metrics(agent_cfg.metrics_address, agent.status)
    return _serve(agent, agent_cfg.socket_path, done)


def _serve(agent: Agent, socket_path: Path, done: threading.Event | None = None) -> int:
    """Serve until SIGTERM/SIGINT (read from a pipe: a handler that set ``done`` could wait forever
    for the lock the main thread held inside ``done.wait``; signal_wait.py), then set ``done``: the
    spool replayer's stop."""
    done = done or threading.Event()
    signals = SignalWait((signal.SIGTERM, signal.SIGINT))
    try:
        server = AgentServer(agent, socket_path)
        try:
            server.start()
        except (OSError, RuntimeError) as exc:
            log.error("cannot listen on %s: %s", socket_path, exc)
            done.set()  # the spool replayer stops too
            return 1
        while not signals.wait() & {signal.SIGTERM, signal.SIGINT}:
            pass
    finally:
        signals.close()
    done.set()  # the spool replayer stops
    log.info("stopping (signal)")
    server.stop()
    if agent.replayer is not None and not agent.replayer.join(10.0):
        log.warning("the spool replayer is still in a replay; leaving it (the spool keeps what it did not send)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
