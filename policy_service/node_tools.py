"""Node-side admin tools: ``swapaware doctor`` and ``swapaware gres-conf``.

``doctor_checks`` and ``gres_conf_lines`` are pure over their inputs (config texts, the typed
config, a telemetry object, probe results); the click commands at the bottom do the I/O.
The slurm.conf / gres.conf parsers understand what the checks need: ``Key=Value`` tokens,
``#`` comments, ``NodeName=DEFAULT``, hostlists (``gpu[01-04,07]``) and bracketed device
files (``/dev/nvidia[0-3]``); they are not a full Slurm parser (no ``Include``).
"""
from __future__ import annotations

import logging
import os
import re
import shlex
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import click

from policy_service.config import Config, ConfigError, Enforcement, load_config
from slurm_plugin.nvml import GpuTelemetry, TelemetryError, open_telemetry

log = logging.getLogger("swapaware.node_tools")

GPU_MEMORY_MIN_FRAC = 0.90  # config below 90 % of the device wastes memory; above 100 % over-commits


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""


# =========================================================================== parsers


@dataclass(frozen=True)
class NodeLine:
    names: tuple[str, ...]
    expr: str
    gres: Mapping[str, int]


@dataclass(frozen=True)
class SlurmConf:
    params: Mapping[str, str]  # lower-case key -> value (last wins)
    nodes: tuple[NodeLine, ...]

    def get(self, key: str, default: str = "") -> str:
        return self.params.get(key.lower(), default)


@dataclass(frozen=True)
class GresLine:
    name: str
    nodes: tuple[str, ...] | None  # None: applies to every node reading the file
    count: int | None
    files: tuple[str, ...]


@dataclass(frozen=True)
class GresConf:
    params: Mapping[str, str]
    lines: tuple[GresLine, ...]

    def for_node(self, node: str | None) -> list[GresLine]:
        return [g for g in self.lines if g.nodes is None or (node is not None and node in g.nodes)]


def _tokens(line: str) -> list[tuple[str, str]]:
    line = line.split("#", 1)[0].strip()
    if not line:
        return []
    try:
        parts = shlex.split(line)
    except ValueError:
        parts = line.split()
    return [(k.lower(), v) for k, _, v in (p.partition("=") for p in parts)]


def _expand_brackets(expr: str) -> list[str]:
    """``a[01-03,7]b`` -> ``a01b a02b a03b a7b`` (zero padding kept); nested groups recurse."""
    match = re.search(r"\[([^\]]*)\]", expr)
    if not match:
        return [expr]
    head, tail = expr[: match.start()], expr[match.end():]
    out = []
    for part in match.group(1).split(","):
        lo, _, hi = part.partition("-")
        if hi and lo.isdigit() and hi.isdigit():
            values = [str(i).zfill(len(lo)) for i in range(int(lo), int(hi) + 1)]
        else:
            values = [part]
        out += [x for v in values for x in _expand_brackets(head + v + tail)]
    return out


def expand_list(expr: str) -> list[str]:
    """A Slurm hostlist or file list: top-level commas separate, brackets expand."""
    items, depth, current = [], 0, ""
    for ch in expr:
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += ch
    items.append(current)
    return [name for item in items if item for name in _expand_brackets(item)]


_COUNT = re.compile(r"^\d+[KMG]?$", re.IGNORECASE)


def _count(raw: str) -> int:
    raw = raw.strip().upper()
    scale = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(raw[-1:], 1)
    digits = raw[:-1] if scale > 1 else raw
    return int(digits) * scale if digits.isdigit() else 0


def parse_gres_spec(spec: str) -> dict[str, int]:
    """``gpu:a100:4(S:0-1),shard:32`` -> ``{"gpu": 4, "shard": 32}`` (types summed)."""
    out: dict[str, int] = {}
    for item in re.split(r",(?![^(]*\))", spec):
        item = re.sub(r"\(.*\)$", "", item.strip())
        if not item or item.lower() == "(null)":
            continue
        parts = item.split(":")
        count = _count(parts[-1]) if len(parts) > 1 and _COUNT.match(parts[-1]) else 1
        out[parts[0].lower()] = out.get(parts[0].lower(), 0) + count
    return out


def parse_slurm_conf(text: str) -> SlurmConf:
    params: dict[str, str] = {}
    nodes: list[NodeLine] = []
    default_gres = ""
    for line in text.splitlines():
        tokens = _tokens(line)
        if not tokens:
            continue
        first_key, first_value = tokens[0]
        if first_key == "nodename":
            attrs = dict(tokens[1:])
            if first_value.upper() == "DEFAULT":
                default_gres = attrs.get("gres", default_gres)
                continue
            gres = parse_gres_spec(attrs.get("gres", default_gres))
            nodes.append(NodeLine(tuple(expand_list(first_value)), first_value, gres))
        elif first_key in ("partitionname", "nodeset", "downnodes", "frontendname", "switchname"):
            continue
        else:
            params.update(tokens)
    return SlurmConf(params, tuple(nodes))


def parse_gres_conf(text: str) -> GresConf:
    params: dict[str, str] = {}
    lines: list[GresLine] = []
    for line in text.splitlines():
        attrs = dict(_tokens(line))
        if "name" not in attrs:
            params.update(attrs)
            continue
        nodes = tuple(expand_list(attrs["nodename"])) if "nodename" in attrs else None
        count = _count(attrs["count"]) if "count" in attrs else None
        files = tuple(expand_list(attrs["file"])) if "file" in attrs else ()
        lines.append(GresLine(attrs["name"].lower(), nodes, count, files))
    return GresConf(params, tuple(lines))


def _gres_totals(lines: Sequence[GresLine]) -> dict[str, int]:
    out: dict[str, int] = {}
    for g in lines:
        n = g.count if g.count is not None else max(1, len(g.files))
        out[g.name] = out.get(g.name, 0) + n
    return out


# =========================================================================== checks


def _check(name: str, ok: bool, detail: str, fix: str) -> Check:
    return Check(name, ok, detail, "" if ok else fix)


def _list_values(raw: str) -> list[str]:
    return [v.strip().lower() for v in raw.split(",") if v.strip()]


def _slurm_param_checks(conf: SlurmConf, cfg: Config) -> list[Check]:
    gres_types = _list_values(conf.get("GresTypes"))
    submit = [v.removeprefix("job_submit/") for v in _list_values(conf.get("JobSubmitPlugins"))]
    cli_filter = [v.removeprefix("cli_filter/") for v in _list_values(conf.get("CliFilterPlugins"))]
    select_params = [v.lower() for v in _list_values(conf.get("SelectTypeParameters"))]
    try:
        age_weight = int(conf.get("PriorityWeightAge", "0"))
    except ValueError:
        age_weight = 0
    need_age = cfg.policy.site_factor_max
    checks = [
        _check("gres_types", "gpu" in gres_types and "shard" in gres_types and "mps" not in gres_types,
               f"GresTypes={conf.get('GresTypes') or '(unset)'}",
               "set GresTypes=gpu,shard (no mps: on 22.05 it strips CUDA_VISIBLE_DEVICES from shard jobs); "
               "restart slurmctld and slurmd"),
        _check("select_type", conf.get("SelectType").lower() == "select/cons_tres",
               f"SelectType={conf.get('SelectType') or '(unset)'}", "set SelectType=select/cons_tres"),
        _check("job_submit_lua", "lua" in submit, f"JobSubmitPlugins={conf.get('JobSubmitPlugins') or '(unset)'}",
               "add lua to JobSubmitPlugins and install job_submit.lua next to slurm.conf"),
        _check("cli_filter_lua", "lua" in cli_filter, f"CliFilterPlugins={conf.get('CliFilterPlugins') or '(unset)'}",
               "set CliFilterPlugins=lua and install cli_filter.lua and swapaware_cli.lua next to slurm.conf on "
               "every host where users run srun: without it, GPU steps (srun --gres=gpu:1) inside a job rewritten "
               "to shards are refused by Slurm"),
        _check("one_gpu_per_shard_job", "multiple_sharing_gres_pj" not in select_params,
               f"SelectTypeParameters={conf.get('SelectTypeParameters') or '(unset)'}",
               "remove MULTIPLE_SHARING_GRES_PJ: swapaware sizes a shared job for one GPU, and it lets one job's "
               "shards span GPUs"),
        _check("prolog", bool(conf.get("Prolog")), f"Prolog={conf.get('Prolog') or '(unset)'}",
               "set Prolog= to the swapaware-prolog script"),
        _check("epilog", bool(conf.get("Epilog")), f"Epilog={conf.get('Epilog') or '(unset)'}",
               "set Epilog= to the swapaware-epilog script"),
        _check("priority_type", conf.get("PriorityType").lower() == "priority/multifactor",
               f"PriorityType={conf.get('PriorityType') or '(unset)'}",
               "set PriorityType=priority/multifactor (site_factor is only added by multifactor)"),
        _check("priority_weight_age", age_weight >= need_age,
               f"PriorityWeightAge={age_weight}, policy.site_factor_max={need_age}",
               f"set PriorityWeightAge>={need_age} so waiting time can outweigh the contention bonus "
               "(else low-contention jobs can starve)"),
        _check("proctrack_cgroup", conf.get("ProctrackType").lower() == "proctrack/cgroup",
               f"ProctrackType={conf.get('ProctrackType') or '(unset)'}",
               "set ProctrackType=proctrack/cgroup so the agent attributes GPU processes by cgroup "
               "(it falls back to /proc/<pid>/environ, which a user can forge)"),
    ]
    if cfg.agent.enforcement is not Enforcement.NONE:
        checks.append(_check("task_prolog", bool(conf.get("TaskProlog")),
                             f"TaskProlog={conf.get('TaskProlog') or '(unset)'} (agent.enforcement="
                             f"{cfg.agent.enforcement.value})",
                             "set TaskProlog= to a script running `python -m slurm_plugin.task_prolog`, "
                             "or set agent.enforcement=none"))
    return checks


def queue_check(slurm, cfg: Config) -> Check:
    """Can this user read what the queue rule needs (``squeue``, ``sinfo``, QoS priorities)?"""
    from policy_service.adapters.queue import queue_state

    fix = ("run doctor as the service's user: the service reads the queue with squeue/sinfo (and QoS "
           "priorities with sacctmgr) every policy.queue_poll_s; or set policy.share_min_queue = 0")
    try:
        pending, gpus = slurm.pending_jobs(), slurm.cluster_gpus()
    except Exception as exc:  # noqa: BLE001 - any failure is the finding
        return _check("queue", False, f"cannot read the queue: {exc}", fix)
    try:
        qos = slurm.qos_priorities()
    except Exception as exc:  # noqa: BLE001
        qos, qos_note = {}, f"; QoS priorities unreadable ({exc}): every job sees the whole queue"
    else:
        qos_note = f"; QoS priorities: {', '.join(f'{k}={v}' for k, v in sorted(qos.items())) or 'none'}"
    state = queue_state(pending, gpus, cfg.gpu.shards_per_gpu, qos)
    detail = (f"{state.pending_gpus:.2f} GPU(s) pending of {gpus} on nodes taking jobs (pressure "
              f"{state.pressure:.1%}, shares at >= {cfg.policy.share_min_queue:.1%}){qos_note}")
    return _check("queue", gpus > 0, detail, "no node with GPUs takes jobs (sinfo -N): while that lasts, waiting "
                                             "GPU work counts as a long queue")


def _node_checks(conf: SlurmConf, gres: GresConf, shards_per_gpu: int) -> list[Check]:
    gpu_nodes = [n for n in conf.nodes if n.gres.get("gpu", 0) > 0]
    if not gpu_nodes:
        return [Check("node_gres", False, "no NodeName line declares a gpu gres",
                      f"declare e.g. Gres=gpu:4,shard:{4 * shards_per_gpu} on the GPU nodes")]
    checks = []
    for node in gpu_nodes:
        gpus, shards = node.gres.get("gpu", 0), node.gres.get("shard", 0)
        checks.append(_check(f"node_gres[{node.expr}]", shards == gpus * shards_per_gpu,
                             f"Gres gpu={gpus} shard={shards}, gpu.shards_per_gpu={shards_per_gpu}",
                             f"set Gres=gpu:{gpus},shard:{gpus * shards_per_gpu} or change gpu.shards_per_gpu"))
        checks.append(_gres_conf_check(node, gres.for_node(node.names[0]), shards_per_gpu))
    return checks


def _gres_conf_check(node: NodeLine, lines: Sequence[GresLine], shards_per_gpu: int) -> Check:
    totals = _gres_totals(lines)
    shard_lines = [g for g in lines if g.name == "shard"]
    problems = []
    if totals.get("gpu", 0) != node.gres.get("gpu", 0):
        problems.append(f"gres.conf has {totals.get('gpu', 0)} gpu, slurm.conf {node.gres.get('gpu', 0)}")
    if totals.get("shard", 0) != node.gres.get("shard", 0):
        problems.append(f"gres.conf has {totals.get('shard', 0)} shard, slurm.conf {node.gres.get('shard', 0)}")
    for g in shard_lines:
        if not g.files:
            problems.append("a Name=shard line has no File=")
        elif (g.count or 0) != shards_per_gpu * len(g.files):
            problems.append(f"Name=shard Count={g.count} for {len(g.files)} GPU file(s), expected "
                            f"{shards_per_gpu} per GPU")
    detail = "; ".join(problems) or f"gpu={totals.get('gpu', 0)} shard={totals.get('shard', 0)}"
    return _check(f"gres_conf[{node.names[0]}]", not problems, detail,
                  "regenerate it on the node: swapaware gres-conf > gres.conf (then restart slurmd)")


def _telemetry_checks(telemetry: GpuTelemetry | None, cfg: Config, gres: GresConf,
                      hostname: str | None) -> list[Check]:
    if telemetry is None:
        return [Check("nvml", False, "no GPU telemetry: GPU memory is not sampled on this node",
                      "install the NVIDIA driver (libnvidia-ml), or set agent.nvml_backend=fake on a dev cluster")]
    try:
        count = telemetry.device_count()
        totals = [telemetry.memory(i).total_bytes for i in range(count)]
    except TelemetryError as exc:
        return [Check("nvml", False, f"{telemetry.source}: {exc}", "check the driver with nvidia-smi")]
    checks = [_check("nvml", count > 0, f"{telemetry.source}: {count} GPU(s)", "no GPU visible to NVML")]
    gres_gpus = _gres_totals(gres.for_node(hostname)).get("gpu", 0)
    checks.append(_check("gres_conf_gpu_count", gres_gpus == count, f"gres.conf gpu={gres_gpus}, NVML sees {count}",
                         "regenerate gres.conf with swapaware gres-conf"))
    if totals:
        smallest = min(totals)
        ok = GPU_MEMORY_MIN_FRAC * smallest <= cfg.gpu.memory_bytes <= smallest
        checks.append(_check("gpu_memory", ok, f"gpu.memory_bytes={cfg.gpu.memory_bytes}, smallest device "
                                               f"{smallest} bytes", f"set gpu.memory_bytes = {smallest}"))
    return checks


def doctor_checks(slurm_conf_text: str, gres_conf_text: str, cfg: Config, telemetry: GpuTelemetry | None,
                  service_reachable: bool | None, *, agent_reachable: bool | None = None,
                  hostname: str | None = None) -> list[Check]:
    """Everything ``swapaware doctor`` verifies, as a list of checks (None probes are skipped)."""
    conf, gres = parse_slurm_conf(slurm_conf_text), parse_gres_conf(gres_conf_text)
    checks = _slurm_param_checks(conf, cfg) + _node_checks(conf, gres, cfg.gpu.shards_per_gpu)
    checks += _telemetry_checks(telemetry, cfg, gres, hostname)
    if service_reachable is not None:
        checks.append(_check("service", service_reachable, f"policy service at {cfg.hooks.service_address}",
                             "start it (swapaware serve) or fix hooks.service_address"))
    if agent_reachable is not None:
        checks.append(_check("agent", agent_reachable, f"node agent at {cfg.hooks.agent_socket}",
                             "start swapaware-agent (systemd unit in contrib/) or fix hooks.agent_socket"))
    return checks


def gres_conf_lines(telemetry: GpuTelemetry, shards_per_gpu: int, device_prefix: str = "/dev/nvidia") -> list[str]:
    """gres.conf for this node: one gpu and one shard line per device. Raises ValueError without GPUs.

    Assumes NVML index N is device file ``<prefix>N`` (check ``nvidia-smi -q | grep Minor``).
    """
    count = telemetry.device_count()
    if count <= 0:
        raise ValueError(f"{telemetry.source}: no GPUs found")
    lines = [
        f"# generated by swapaware gres-conf from {telemetry.source}: {count} GPU(s), {shards_per_gpu} shards each",
        f"# slurm.conf node line: Gres=gpu:{count},shard:{count * shards_per_gpu}",
        "AutoDetect=off",
    ]
    for i in range(count):
        lines += [
            f"# GPU {i}: {telemetry.name(i)} {telemetry.uuid(i)} {telemetry.memory(i).total_bytes} bytes",
            f"Name=gpu File={device_prefix}{i}",
            f"Name=shard Count={shards_per_gpu} File={device_prefix}{i}",
        ]
    return lines


# =========================================================================== click commands


def _default_slurm_conf() -> str:
    return os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf")


def _load(config_path: Path | None) -> Config:
    try:
        return load_config(config_path)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None


def probe_service(address: str, timeout_s: float) -> bool:
    """gRPC health check of the policy service (overall status), bounded by ``timeout_s``."""
    try:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        return reply.status == health_pb2.HealthCheckResponse.SERVING
    except Exception:  # noqa: BLE001 - any failure means "not reachable"
        return False


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _print_checks(checks: Sequence[Check]) -> None:
    for c in checks:
        click.echo(f"[{' OK ' if c.ok else 'FAIL'}] {c.name}: {c.detail}")
        if not c.ok and c.fix:
            click.echo(f"       fix: {c.fix}")


@click.command("doctor")
@click.option("--slurm-conf", type=click.Path(path_type=Path), default=_default_slurm_conf, show_default="$SLURM_CONF "
              "or /etc/slurm/slurm.conf")
@click.option("--gres-conf", type=click.Path(path_type=Path), default=None, help="default: next to slurm.conf")
@click.option("--config", "config_path", type=click.Path(path_type=Path), default=None)
@click.option("--no-probes", is_flag=True, help="do not contact the policy service or the node agent")
def doctor_command(slurm_conf: Path, gres_conf: Path | None, config_path: Path | None, no_probes: bool) -> None:
    """Check this node's Slurm and swapaware setup; exit 1 when a check fails."""
    cfg = _load(config_path)
    gres_conf = gres_conf or slurm_conf.parent / "gres.conf"
    slurm_text, gres_text = _read(slurm_conf), _read(gres_conf)
    missing = [Check(f"read {p}", False, "file not readable", "pass --slurm-conf / --gres-conf")
               for p, t in ((slurm_conf, slurm_text), (gres_conf, gres_text)) if t is None]
    telemetry, opened = _open_telemetry_checked(cfg)
    service = None if no_probes else probe_service(cfg.hooks.service_address, cfg.hooks.deadline_s)
    agent = None
    if not no_probes:
        from slurm_plugin.agent_client import status

        agent = status(cfg.hooks) is not None
    checks = missing + opened + doctor_checks(slurm_text or "", gres_text or "", cfg, telemetry, service,
                                     agent_reachable=agent, hostname=socket.gethostname().split(".")[0])
    from slurm_plugin.enforce.doctor import enforcement_checks

    checks += enforcement_checks(cfg)  # which GPU memory enforcement this node has, what it enforces
    from policy_service.adapters.queue import reads_queue

    if not no_probes and reads_queue(cfg):
        from policy_service.adapters.slurm import CliSlurm

        checks.append(queue_check(CliSlurm(cfg.service.slurm_timeout_s), cfg))
    _print_checks(checks)
    if not all(c.ok for c in checks):
        sys.exit(1)


def _open_telemetry_checked(cfg: Config) -> tuple[GpuTelemetry | None, list[Check]]:
    try:
        return open_telemetry(cfg.agent, log), []
    except TelemetryError as exc:
        return None, [Check("nvml_backend", False, str(exc), "install the driver or set agent.nvml_backend=auto")]


@click.command("gres-conf")
@click.option("--slurm-conf", type=click.Path(path_type=Path), default=_default_slurm_conf,
              help="cross-checked against the generated counts when readable")
@click.option("--config", "config_path", type=click.Path(path_type=Path), default=None)
@click.option("--shards-per-gpu", type=int, default=None, help="default: gpu.shards_per_gpu")
@click.option("--device-prefix", default="/dev/nvidia", show_default=True)
def gres_conf_command(slurm_conf: Path, config_path: Path | None, shards_per_gpu: int | None,
                      device_prefix: str) -> None:
    """Print a gres.conf for this node's GPUs (from NVML, or the fake)."""
    cfg = _load(config_path)
    shards = shards_per_gpu or cfg.gpu.shards_per_gpu
    try:
        telemetry = open_telemetry(cfg.agent, log)
        if telemetry is None:
            raise click.ClickException("no GPU telemetry on this node (NVML unavailable)")
        lines = gres_conf_lines(telemetry, shards, device_prefix)
    except (TelemetryError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo("\n".join(lines))
    _warn_slurm_conf_mismatch(_read(slurm_conf), telemetry.device_count(), shards)


def _warn_slurm_conf_mismatch(text: str | None, gpus: int, shards_per_gpu: int) -> None:
    if text is None:
        return
    host = socket.gethostname().split(".")[0]
    for node in parse_slurm_conf(text).nodes:
        if host in node.names and (node.gres.get("gpu"), node.gres.get("shard")) != (gpus, gpus * shards_per_gpu):
            click.echo(f"warning: slurm.conf NodeName={node.expr} has Gres gpu={node.gres.get('gpu', 0)} "
                       f"shard={node.gres.get('shard', 0)}; this node needs Gres=gpu:{gpus},"
                       f"shard:{gpus * shards_per_gpu}", err=True)
