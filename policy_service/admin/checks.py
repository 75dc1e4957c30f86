"""The checks of ``swapaware doctor`` and the lines of ``swapaware gres-conf``: pure over their
inputs (config texts, the typed config, a telemetry object, probe results)."""
from __future__ import annotations

import re
from fractions import Fraction
from typing import Sequence

from policy_service.admin.billing import billing_checks
from policy_service.core.ha import service_addresses
from policy_service.admin.check import Check, _check, _list_values
from policy_service.admin.grpc_port import PortSeen, grpc_port_check
from policy_service.slurm.slurm_files import (
    GresConf,
    GresLine,
    NodeLine,
    SlurmConf,
    gres_totals,
    parse_gres_conf,
    parse_gres_types,
    parse_slurm_conf,
)
from policy_service.slurm.fleet import node_gpus, shard_counts
from policy_service.config import Config, Enforcement, Oversubscription
from policy_service.core.dialect import SlurmDialect
from slurm_plugin.enforce.choose import choose
from slurm_plugin.gpu.nvml import GpuTelemetry, TelemetryError


GIB = 1024**3


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
    from policy_service.slurm.queue import queue_state

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
        checks.append(_check(f"node_gres[{node.expr}]", shards > 0,
                             f"Gres gpu={gpus} shard={shards}",
                             "no job on these nodes can share a GPU: add the shards swapaware gres-conf prints for "
                             f"the node (with {shards_per_gpu} per GPU of gpu.memory_bytes: "
                             f"Gres=gpu:{gpus},shard:{gpus * shards_per_gpu})"))
        checks.append(_gres_conf_check(node, gres.for_node(node.names[0])))
        typed = shard_types_check(node, gres.for_node(node.names[0]))
        if typed is not None:
            checks.append(typed)
    return checks


def shard_types_check(node: NodeLine, lines: Sequence[GresLine]) -> Check | None:
    """Where a node's shards have types (a shard takes the type of the gpu line with its File=, or its
    own Type=), slurm.conf's Gres= must list them by type, and each Name=shard line must name it.
    Untyped in Gres= while gres.conf types them, a slurmctld that takes control (scontrol takeover, the
    primary taking control back, slurmctld -R) leaves every shard type at 0: 24.11 set every such node
    INVAL and DRAIN when it registered, "gres/shard type (a100) reported but not configured", 22.05
    showed shard:<type>:0 and refused shard jobs (measured; SchedMD fixed it in 25.05). Typed in Gres=
    while a shard line has no Type=: slurmd 24.11 exits at start ("_build_shared_list: bad
    configuration, multiple configurations without File"). None: no types on either side."""
    gpu_types = {f: (g.type or "").lower() for g in lines if g.name == "gpu" for f in g.files}
    shard_lines = [g for g in lines if g.name == "shard"]
    conf_types: dict[str, int] = {}
    untyped_lines = 0
    for g in shard_lines:
        t = (g.type or next((gpu_types[f] for f in g.files if gpu_types.get(f)), "")).lower()
        conf_types[t] = conf_types.get(t, 0) + (g.count or 0)
        untyped_lines += not g.type
    in_gres = parse_gres_types(node.gres_spec).get("shard", {})
    if not any(conf_types) and not any(in_gres):
        return None
    want = ",".join(f"shard:{t}:{n}" for t, n in sorted(conf_types.items()) if t and n)
    problems = []
    if in_gres and {t: n for t, n in in_gres.items() if n} != {t: n for t, n in conf_types.items() if n}:
        problems.append(f"slurm.conf Gres= has {_types_text(in_gres)}, gres.conf {_types_text(conf_types)}")
    if untyped_lines:
        problems.append(f"{untyped_lines} Name=shard line(s) without Type=")
    detail = "; ".join(problems) or f"shards by type: {_types_text(conf_types)}"
    return _check(f"shard_types[{node.names[0]}]", not problems, detail,
                  f"list the shards by type in the node's Gres= ({want or 'shard:<type>:<count>'}) and give each "
                  "Name=shard line its GPU's Type=, then restart slurmctld and slurmd: untyped in Gres=, a "
                  "slurmctld taking control (takeover, hand-back) drains the node on 23.11-24.11 ('gres/shard "
                  "type (...) reported but not configured') and shows its shards as 0 on 22.05; typed in Gres= "
                  "without Type= on the shard lines, slurmd does not start")


def _types_text(by_type: dict[str, int]) -> str:
    return ", ".join(f"shard:{t}:{n}" if t else f"shard:{n}" for t, n in sorted(by_type.items())) or "no shards"


def _gres_conf_check(node: NodeLine, lines: Sequence[GresLine]) -> Check:
    totals = gres_totals(lines)
    shard_lines = [g for g in lines if g.name == "shard"]
    problems = []
    if totals.get("gpu", 0) != node.gres.get("gpu", 0):
        problems.append(f"gres.conf has {totals.get('gpu', 0)} gpu, slurm.conf {node.gres.get('gpu', 0)}")
    if totals.get("shard", 0) != node.gres.get("shard", 0):
        problems.append(f"gres.conf has {totals.get('shard', 0)} shard, slurm.conf {node.gres.get('shard', 0)}")
    for g in shard_lines:
        if not g.files:
            problems.append("a Name=shard line has no File=")
        elif (g.count or 0) % len(g.files):
            problems.append(f"Name=shard Count={g.count} for {len(g.files)} GPU files does not divide: write one "
                            "line per GPU")
    detail = "; ".join(problems) or f"gpu={totals.get('gpu', 0)} shard={totals.get('shard', 0)}"
    return _check(f"gres_conf[{node.names[0]}]", not problems, detail,
                  "regenerate it on the node: swapaware gres-conf > gres.conf (then restart slurmd)")


def shards_fitting(total_bytes: int, shard_bytes: int) -> int:
    """Shards of ``shard_bytes`` a GPU of ``total_bytes`` holds: each job gets its charge."""
    return total_bytes // shard_bytes if shard_bytes > 0 else 0


def _device_index(path: str) -> int | None:
    """NVML index of a gres.conf ``File=``: its trailing number (``/dev/nvidia3`` -> 3)."""
    match = re.search(r"(\d+)$", path)
    return int(match.group(1)) if match else None


def _shard_memory_check(totals: Sequence[int], gres: GresConf, hostname: str | None, cfg: Config) -> Check:
    """Every GPU's shards x gpu.shard_bytes within its memory (NVML index N is File=...N)."""
    per_gpu = {_device_index(f): Fraction(g.count or 0, len(g.files)) for g in gres.for_node(hostname)
               if g.name == "shard" and g.files for f in g.files}
    unit = cfg.gpu.shard_bytes
    over, under, seen = [], [], []
    for i, total in enumerate(totals):
        have, fit = per_gpu.get(i, Fraction(0)), shards_fitting(total, unit)
        seen.append(f"GPU {i} {total / GIB:.1f} GiB: {_fmt(have)} of {fit}")
        if have > fit:
            over.append(f"GPU {i} has {_fmt(have)} shards x {unit / GIB:.1f} GiB = {float(have * unit) / GIB:.1f} GiB, more "
                        f"than its {total / GIB:.1f} GiB")
        elif have < fit:
            under.append(f"GPU {i} could hold {fit}")
    detail = (f"gpu.shard_bytes={unit} ({unit / GIB:.1f} GiB); " + "; ".join(seen)
              + (f"; fewer shards than fit (memory unused by shared jobs): {', '.join(under)}" if under else ""))
    if over:
        detail += "; " + "; ".join(over) + ": shared jobs there get less memory than their charge"
    return _check("shard_memory", not over, detail, "regenerate gres.conf: swapaware gres-conf > gres.conf, update "
                                                    "the node's Gres= in slurm.conf, restart slurmd and slurmctld")


def _fmt(x: Fraction) -> str:
    return str(x.numerator) if x.denominator == 1 else f"{float(x):.2f}"


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
    gres_gpus = gres_totals(gres.for_node(hostname)).get("gpu", 0)
    checks.append(_check("gres_conf_gpu_count", gres_gpus == count, f"gres.conf gpu={gres_gpus}, NVML sees {count}",
                         "regenerate gres.conf with swapaware gres-conf"))
    if totals:
        checks.append(_shard_memory_check(totals, gres, hostname, cfg))
    return checks


def shard_counts_check(conf: SlurmConf, gres: GresConf, dialect: SlurmDialect) -> Check | None:
    """On a release with the gpu-beside-shard bug (22.05), GPUs of one node with different shard
    counts: measured there, such a node ended up with every GPU held by no job (``GresUsed`` all
    GPUs on an idle node) after gpu and shard jobs ran side by side, and later GPU jobs pended with
    ``Reason=Resources``. None where the check does not apply."""
    if not dialect.gpu_beside_shard_bug:
        return None
    mixed = [node.expr for node in conf.nodes if len(shard_counts(node_gpus(conf, gres, node.names[0]))) > 1]
    return _check("shard_counts", not mixed,
                  f"Slurm {dialect.name}: GPUs with different shard counts on " + (", ".join(mixed) or "no node"),
                  f"on Slurm {dialect.name} give every GPU of a node the same count (e.g. size shards for the node's "
                  "smallest GPU: --shard-bytes), or upgrade: with different counts 22.05 was seen to leave a node's "
                  "GPUs allocated to no job (scontrol show node -d: GresUsed on an idle node)")


def doctor_checks(slurm_conf_text: str, gres_conf_text: str, cfg: Config, telemetry: GpuTelemetry | None,
                  service_reachable: bool | None, *, agent_reachable: bool | None = None,
                  hostname: str | None = None, dialect: SlurmDialect | None = None,
                  grpc_port: PortSeen | None = None) -> list[Check]:
    """Everything ``swapaware doctor`` verifies, as a list of checks (None probes are skipped;
    ``dialect``: the running Slurm's, None when not known; ``grpc_port``: what this host shows of
    service.grpc_address, admin/grpc_port.py)."""
    conf, gres = parse_slurm_conf(slurm_conf_text), parse_gres_conf(gres_conf_text)
    checks = _slurm_param_checks(conf, cfg) + _node_checks(conf, gres, cfg.gpu.shards_per_gpu)
    counts = shard_counts_check(conf, gres, dialect) if dialect is not None else None
    checks += [counts] if counts is not None else []
    checks += billing_checks(conf, gres, cfg.gpu.shards_per_gpu)
    checks += _telemetry_checks(telemetry, cfg, gres, hostname)
    if service_reachable is not None:
        checks.append(_check("service", service_reachable, "policy service at "
                             + " or ".join(service_addresses(cfg)),
                             "start it (swapaware serve) or fix hooks.service_address (ha.controllers)"))
    if grpc_port is not None:
        checks.append(grpc_port_check(cfg.service.grpc_address, grpc_port))
    if agent_reachable is not None:
        checks.append(_check("agent", agent_reachable, f"node agent at {cfg.hooks.agent_socket}",
                             "start swapaware-agent (systemd unit in contrib/) or fix hooks.agent_socket"))
    return checks


def gres_conf_lines(telemetry: GpuTelemetry, shard_bytes: int, device_prefix: str = "/dev/nvidia") -> list[str]:
    """gres.conf for this node: one gpu line per device and one shard line per device that holds
    a shard, ``Count=`` its memory in shards of ``shard_bytes`` (a shard is the same memory on every
    GPU, so a larger GPU has more). Raises ValueError without GPUs.

    Assumes NVML index N is device file ``<prefix>N`` (check ``nvidia-smi -q | grep Minor``).
    """
    count = telemetry.device_count()
    if count <= 0:
        raise ValueError(f"{telemetry.source}: no GPUs found")
    if shard_bytes <= 0:
        raise ValueError("the shard size must be > 0 bytes")
    totals = [telemetry.memory(i).total_bytes for i in range(count)]
    shards = [shards_fitting(t, shard_bytes) for t in totals]
    lines = [
        f"# generated by swapaware gres-conf from {telemetry.source}: {count} GPU(s), a shard is {shard_bytes} "
        f"bytes ({shard_bytes / GIB:.1f} GiB) on every GPU",
        f"# slurm.conf node line: Gres=gpu:{count},shard:{sum(shards)}",
        "# adding Type= to a gpu line: give its shard line the same Type= and list the shards by type in Gres=",
        "# (gpu:<type>:<n>,shard:<type>:<n>), or a 24.11 slurmctld taking control drains the node (swapaware doctor)",
        "AutoDetect=off",
    ]
    for i in range(count):
        lines += [
            f"# GPU {i}: {telemetry.name(i)} {telemetry.uuid(i)} {totals[i]} bytes: {shards[i]} shard(s)",
            f"Name=gpu File={device_prefix}{i}",
        ]
        if shards[i]:
            lines.append(f"Name=shard Count={shards[i]} File={device_prefix}{i}")
    return lines


# =========================================================================== click commands


def enforcement_checks(cfg: Config, nvml_module=None) -> list[Check]:
    """Which backend fences this node's shared jobs and what it enforces (every mechanism looked at
    is listed, available or not)."""
    _, cap, seen = choose(cfg, nvml_module)
    mode = cfg.agent.enforcement
    explicit_missing = mode not in (Enforcement.AUTO, Enforcement.FRAMEWORK_ENV, Enforcement.NONE) and \
        cap.backend != mode.value
    checks = [Check("enforcement", not explicit_missing,
                    f"agent.enforcement={mode.value}: {cap.line()}",
                    f"agent.enforcement={mode.value} is not available on this node (see enforcement[...] below); "
                    "install it or set agent.enforcement=auto" if explicit_missing else "")]
    checks += [Check(f"enforcement[{c.backend}]", True, c.line(), "") for c in seen if c is not cap]
    if Oversubscription(cfg.policy.allow_oversubscription) is Oversubscription.ON and not cap.victim:
        checks.append(Check("oversubscription", True, "policy.allow_oversubscription = true but this node does "
                            f"not enforce victim semantics ({cap.backend}): oversubscribed jobs here count on "
                            "managed memory in the job itself", ""))
    return checks
