"""Admin tools that look at both wings: ``swapaware doctor`` (slurm.conf, gres.conf, this node's
GPUs and memory enforcement, the service and agent, the queue) and ``swapaware gres-conf``.

  checks.py       the checks and gres.conf lines (pure over their inputs); slurm.conf / gres.conf
                  parsing lives in policy_service/slurm/slurm_files.py, which the service also
                  reads slurm.conf with (without importing these tools, which reach the node wing)
  billing.py      the check of how shared jobs are billed
  grpc_port.py    the check that no other process can take (or holds) the service's gRPC port
  wiring.py       the Lua files beside slurm.conf and swapaware_plugin.conf against the config
  access_checks.py  whether SlurmUser can open the service's socket and read the admission table
  perms.py        the access rule those use (mode, owner, group of each path component)
  peers.py        the service's user (SO_PEERCRED), the node agent, this host's MUNGE origin
  table_decisions.py  whether slurmctld decided recent jobs from the admission table (their AdminComments)
  host.py         what those read and ask on this host
  check.py        one check's result
  commands.py     the click commands
"""
from policy_service.admin.checks import (
    Check,
    doctor_checks,
    enforcement_checks,
    gres_conf_lines,
    queue_check,
)
from policy_service.admin.commands import doctor_command, gres_conf_command, probe_service
from policy_service.slurm.slurm_files import (
    GresConf,
    GresLine,
    NodeLine,
    SlurmConf,
    expand_list,
    parse_gres_conf,
    parse_gres_spec,
    parse_slurm_conf,
)

__all__ = ["Check", "GresConf", "GresLine", "NodeLine", "SlurmConf", "doctor_checks",
           "doctor_command", "enforcement_checks", "expand_list", "gres_conf_command", "gres_conf_lines",
           "parse_gres_conf", "parse_gres_spec", "parse_slurm_conf", "probe_service", "queue_check"]
