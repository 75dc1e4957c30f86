"""Prolog and epilog entry points (console scripts ``swapaware-prolog`` / ``swapaware-epilog``).

They run on the compute node as root. Rules they keep (a failing hook drains the node):
  * always exit 0, whatever happens; problems go to the log (stderr -> slurmd's log, and
    syslog-style lines on stderr);
  * every call to the service has a deadline (``hooks.deadline_s``);
  * an event the service cannot take is spooled locally and replayed by a later hook run
    (or ``swapaware replay-spool``): no observation is lost.
"""
from __future__ import annotations

import logging
import os
import re
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import Mapping

import grpc

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.serving.client import (FailoverClient, PolicyClient, configured_client, munge_socket_for,
                                           token_refusal)
from policy_service.config import (AuthConfig, Config, ConfigError, HaConfig, HookConfig, TlsConfig, load_config,
                                   read_token)
from slurm_plugin.agent import client as agent_client
from slurm_plugin.hooks import spool
from slurm_plugin.hooks.job_env import parse_gpu_indices  # noqa: F401  (hooks.parse_gpu_indices: API)

log = logging.getLogger("swapaware.hooks")


def parse_exit(env: Mapping[str, str]) -> tuple[int, int, int]:
    """(exit code, signal, derived exit code) from the epilog's environment.

    SLURM_JOB_EXIT_CODE2 is 'code:signal'; SLURM_JOB_EXIT_CODE is the raw wait status."""
    code = sig = 0
    two = env.get("SLURM_JOB_EXIT_CODE2", "")
    if re.fullmatch(r"\d+:\d+", two):
        code, sig = (int(x) for x in two.split(":"))
    elif env.get("SLURM_JOB_EXIT_CODE", "").isdigit():
        raw = int(env["SLURM_JOB_EXIT_CODE"])
        code, sig = (raw >> 8) & 0xFF, raw & 0x7F
    derived_text = env.get("SLURM_JOB_DERIVED_EC", "")
    derived = int(derived_text.split(":")[0]) if re.fullmatch(r"\d+(:\d+)?", derived_text) else 0
    return code, sig, derived


def node_name(env: Mapping[str, str]) -> str:
    return env.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def job_id_of(env: Mapping[str, str]) -> int:
    text = env.get("SLURM_JOB_ID", "")
    if not text.isdigit():
        raise ValueError(f"SLURM_JOB_ID is {text!r}, not a job id")
    return int(text)


def started_request(env: Mapping[str, str], now: float) -> pb.JobStartedRequest:
    job_id = job_id_of(env)
    return pb.JobStartedRequest(job_id=job_id, node=node_name(env), gpu_indices=parse_gpu_indices(env),
                                started_at=now, user=env.get("SLURM_JOB_USER", ""),
                                event_id=f"start-{job_id}-{uuid.uuid4().hex[:12]}", sluid=sluid_of(env))


def finished_request(env: Mapping[str, str], now: float, telemetry: dict | None) -> pb.JobFinishedRequest:
    job_id = job_id_of(env)
    code, sig, derived = parse_exit(env)
    req = pb.JobFinishedRequest(job_id=job_id, node=node_name(env), gpu_indices=parse_gpu_indices(env),
                                finished_at=now, exit_code=code, exit_signal=sig, derived_exit_code=derived,
                                event_id=f"finish-{job_id}-{uuid.uuid4().hex[:12]}", telemetry_source="none",
                                sluid=sluid_of(env))
    if telemetry:
        apply_telemetry(req, telemetry)
    return req


def sluid_of(env: Mapping[str, str]) -> str:
    """The job's SLUID (Slurm 25.11+ exports SLURM_JOB_SLUID to prolog and epilog), "" before:
    with it the service names the job instance without asking Slurm. At most 64 characters."""
    value = env.get("SLURM_JOB_SLUID", "").strip()
    return value if len(value) <= 64 else ""


def apply_telemetry(req: pb.JobFinishedRequest, t: dict) -> None:
    """Copy the node agent's summary of the job into the observation."""
    req.telemetry_source = str(t.get("source", "none"))
    if t.get("started_at"):
        req.started_at = float(t["started_at"])
    if t.get("peak_bytes") is not None and req.telemetry_source != "none":
        req.peak_gpu_bytes = int(t["peak_bytes"])
    for g in t.get("gpus", []) or []:
        usage = req.gpus.add(gpu_index=int(g.get("index", 0)), peak_bytes=int(g.get("peak_bytes", 0)),
                             mean_bytes=int(g.get("mean_bytes", 0)), total_bytes=int(g.get("total_bytes", 0)))
        if g.get("util_mean_pct") is not None:  # absent: NVML had no utilisation reading (not 0 % busy)
            usage.util_mean_pct = float(g["util_mean_pct"])
    if t.get("oom_suspected"):
        # Memory at the device's limit is only an OOM if the job also failed: a job that
        # filled the GPU and exited 0 did not run out of memory.
        evidence = str(t.get("oom_evidence", ""))[:500]
        if req.exit_code != 0 or req.exit_signal != 0:
            req.oom_detected = True
            req.oom_evidence = evidence
        else:
            log.info("job %s: agent suspected OOM (%s) but the job exited 0: not an OOM", req.job_id, evidence)


def hook_client(hooks: HookConfig, auth: AuthConfig | None = None, tls: TlsConfig | None = None,
                ha: HaConfig | None = None) -> PolicyClient | FailoverClient:
    """A client carrying the hooks' token when one is configured and a MUNGE credential per call
    where ``auth`` says (default: where munged runs), over TLS where ``tls.ca`` is set. An
    unreadable token file or TLS file, a token file others may read, or a token that would go in
    plaintext to another host is logged and the call goes out without it: the service refuses it
    (unless MUNGE identifies the node) and the event is spooled. With ``ha.controllers`` (two
    controllers, docs/ha.md): each in turn, the one that answered last first (kept in the spool
    directory), within the one deadline."""
    cfg = Config(auth=auth or AuthConfig(), tls=tls or TlsConfig())
    try:
        token = read_token(hooks.token_file)
    except ConfigError as exc:
        log.error("%s; events go without the token (spooled if the service needs it)", exc)
        token = None
    addresses = tuple(ha.controllers) if ha is not None else ()
    if not addresses:
        return _one_client(hooks, cfg, token, hooks.service_address)
    return FailoverClient(lambda address: _one_client(hooks, cfg, token, address), addresses, hooks.deadline_s,
                          remember=Path(hooks.spool_dir) / LAST_SERVICE_FILE)


LAST_SERVICE_FILE = ".last-service"  # in hooks.spool_dir: the controller's service that answered last


def _one_client(hooks: HookConfig, cfg: Config, token: str | None, address: str) -> PolicyClient:
    refused = token_refusal(cfg, address) if token else None
    if refused:
        log.error("%s; events go without the token (spooled if the service needs it)", refused)
        token = None
    try:
        return configured_client(cfg, address, hooks.deadline_s, token)
    except ConfigError as exc:
        # Never plaintext where TLS is configured (the token and the events would go to whoever
        # answers): TLS that trusts only the system's CAs, which fails against the cluster's own CA.
        log.error("%s: events will be spooled until it is fixed", exc)
        return PolicyClient(address, hooks.deadline_s, token, munge_socket=munge_socket_for(cfg.auth),
                            tls=grpc.ssl_channel_credentials())


def deliver(hooks: HookConfig, method: str, request, client: PolicyClient | FailoverClient | None = None,
            auth: AuthConfig | None = None, tls: TlsConfig | None = None, ha: HaConfig | None = None) -> bool:
    """Replay what is spooled, then send ``request``; spool it if the service cannot take it.
    Returns True when the service took it now."""
    own = client is None
    client = client or hook_client(hooks, auth, tls, ha)
    try:
        result = spool.replay(hooks.spool_dir, client.call, hooks.replay_batch)
        if result.sent or result.rejected:
            log.info("replayed %d spooled event(s), %d rejected, %d left", result.sent, result.rejected, result.left)
        try:
            client.call(method, request)
            return True
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
                path = spool.reject_event(hooks.spool_dir, method, request, request.event_id,
                                          f"{code.name}: {exc.details()}")
                log.error("%s for job %s refused by the service: %s (kept in %s)", method, request.job_id,
                          exc.details(), path)
                return False
            path = spool.spool_event(hooks.spool_dir, method, request, request.event_id)
            log.warning("service unreachable (%s): %s for job %s spooled to %s", code.name if code else exc,
                        method, request.job_id, path)
            return False
    finally:
        if own:
            client.close()


def _setup_logging(name: str) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"swapaware-{name}[%(process)d]: %(levelname)s %(message)s")


def _config() -> Config:
    """The hook's config; a broken config file must not lose the event, so fall back to
    defaults (and say so) rather than fail."""
    try:
        return load_config()
    except ConfigError as exc:
        log.error("config unusable (%s); using defaults for this run", exc)
        return Config(source="defaults (config error)")


def run_prolog(env: Mapping[str, str], cfg: Config, now: float) -> None:
    req = started_request(env, now)
    try:  # the node's GPU memory enforcement: reported with the start, its root files written
        from slurm_plugin.enforce import node as enforce_node
        req.enforcement.CopyFrom(enforce_node.capability_proto(cfg))
        enforce_node.apply_root(env, cfg)
    except Exception as exc:  # noqa: BLE001 -- enforcement never fails the prolog
        log.warning("enforcement: %s", exc)
    uid = env.get("SLURM_JOB_UID", "")
    agent_client.notify_start(cfg.hooks, req.job_id, list(req.gpu_indices), int(uid) if uid.isdigit() else None,
                              sluid=sluid_of(env) or None)  # 25.11+; names the cgroup on 26.05
    deliver(cfg.hooks, "JobStarted", req, auth=cfg.auth, tls=cfg.tls, ha=cfg.ha)


def run_epilog(env: Mapping[str, str], cfg: Config, now: float) -> None:
    job_id = job_id_of(env)
    telemetry = agent_client.collect(cfg.hooks, job_id)
    try:  # the enforcement backend's per-job files (HAMi limit file, usage cache)
        from slurm_plugin.enforce.choose import choose
        choose(cfg)[0].release(job_id)
    except Exception as exc:  # noqa: BLE001 -- never fails the epilog
        log.warning("enforcement release: %s", exc)
    deliver(cfg.hooks, "JobFinished", finished_request(env, now, telemetry), auth=cfg.auth, tls=cfg.tls, ha=cfg.ha)


def _main(name: str, fn) -> None:
    _setup_logging(name)
    try:
        fn(dict(os.environ), _config(), time.time())
    except BaseException as exc:  # a hook must never fail: that would drain the node
        log.error("%s failed (job %s): %s: %s", name, os.environ.get("SLURM_JOB_ID", "?"), type(exc).__name__, exc)
    sys.exit(0)


def prolog_main() -> None:
    _main("prolog", run_prolog)


def epilog_main() -> None:
    _main("epilog", run_epilog)


REPLAY_LOCK_WAIT_S = 120.0  # an agent's replay is bounded by its RPC deadlines


def replay_main(hooks: HookConfig, auth: AuthConfig | None = None, tls: TlsConfig | None = None,
                ha: HaConfig | None = None) -> spool.ReplayResult:
    with hook_client(hooks, auth, tls, ha) as client:
        # An admin's replay waits for the agent's (which may be delivering the same files) to end.
        return spool.replay(hooks.spool_dir, client.call, max_events=10**9, wait_s=REPLAY_LOCK_WAIT_S)

