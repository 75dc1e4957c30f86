"""The controller wing imports nothing of the node wing (docs/architecture.md, "Two wings"): the
service, started in a fresh interpreter, has no slurm_plugin module loaded."""
import subprocess
import sys


def test_the_service_loads_nothing_of_the_node_wing():
    code = ("import sys, policy_service.serving.server, policy_service.serving.handler; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'slurm_plugin' "
            "or m.startswith('policy_service.admin')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout
