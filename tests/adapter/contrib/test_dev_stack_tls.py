"""The dev stack's TLS (contrib/dev-stack.sh ensure_tls, run as ``dev-stack.sh tls``): a private CA
and the service's certificate made with the openssl CLI, keys 0600, a subjectAltName for every
address clients use, kept while valid; a real service on loopback serves with them and the
hooks' client, trusting the CA, is answered."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.trust.auth_config import TlsConfig
from policy_service.serving.client import PolicyClient
from policy_service.config import load_config
from policy_service.serving.server import start_service
from policy_service.trust.tls import channel_credentials

ROOT = Path(__file__).resolve().parents[3]


def dev_tls(state: Path) -> Path:
    env = {**os.environ, "SWAPAWARE_DEV_DIR": str(state), "SWAPAWARE_VENV": str(Path(sys.executable).parent.parent)}
    p = subprocess.run(["bash", str(ROOT / "contrib" / "dev-stack.sh"), "tls"], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return Path(p.stdout.strip())


def san(cert: Path) -> str:
    return subprocess.run(["openssl", "x509", "-noout", "-ext", "subjectAltName", "-in", str(cert)],
                          capture_output=True, text=True, check=True).stdout


def files(d: Path) -> dict[str, bytes]:
    return {n: (d / n).read_bytes() for n in ("ca.pem", "ca.key", "server.pem", "server.key")}


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    return dev_tls(tmp_path_factory.mktemp("dev"))


def test_keys_are_private_certificates_readable(single):
    modes = {n: (single / n).stat().st_mode & 0o777 for n in ("ca.key", "server.key", "ca.pem", "server.pem")}
    assert modes == {"ca.key": 0o600, "server.key": 0o600, "ca.pem": 0o644, "server.pem": 0o644}
    names = san(single / "server.pem")
    assert "IP Address:127.0.0.1" in names and "DNS:localhost" in names and "10.77.0.1" not in names


def test_a_second_run_keeps_them_and_a_multi_node_stack_adds_the_controllers_address(single, tmp_path):
    state = single.parent
    before = files(single)
    (single / "server.key").chmod(0o644)  # a mode an admin's copy left behind is narrowed
    assert dev_tls(state) == single and files(single) == before
    assert (single / "server.key").stat().st_mode & 0o777 == 0o600
    (state / "etc").mkdir(exist_ok=True)
    (state / "etc" / "nodes").write_text("3\n")  # what `up --nodes 3` leaves
    try:
        dev_tls(state)
        assert "IP Address:10.77.0.1" in san(single / "server.pem")
        assert files(single)["server.pem"] != before["server.pem"]
    finally:
        (state / "etc" / "nodes").unlink()


def test_a_service_with_them_answers_a_client_that_trusts_the_dev_ca(service_env, slurm_jobs, tmp_path):
    d = dev_tls(tmp_path / "dev")
    svc = start_service(load_config(env={**service_env, "SWAPAWARE_TLS__CERT": str(d / "server.pem"),
                                         "SWAPAWARE_TLS__KEY": str(d / "server.key")}), slurm=slurm_jobs)
    try:
        for host in ("127.0.0.1", "localhost"):
            with PolicyClient(f"{host}:{svc.grpc_port}", 5.0, tls=channel_credentials(TlsConfig(ca=str(d / "ca.pem")))) as c:
                assert c.admit(pb.JobFacts(user="u", uid=1000, tres_per_node="gres:gpu:1")).decision.decision_id
    finally:
        svc.stop(0)
