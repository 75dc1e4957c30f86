"""``swapaware doctor``'s enforcement checks: which backend fences this node's shared jobs and
what it enforces (every mechanism looked at is listed, available or not)."""
from __future__ import annotations

from policy_service.config import Config, Enforcement, Oversubscription
from slurm_plugin.enforce.choose import choose


def enforcement_checks(cfg: Config, nvml_module=None) -> list:
    from policy_service.node_tools import Check

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
