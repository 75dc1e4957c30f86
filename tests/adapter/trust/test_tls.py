"""TLS on gRPC ([tls]): a real service on loopback with certificates made by the openssl CLI."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import grpc
import pytest

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.trust.auth_config import TlsConfig
from policy_service.serving.client import PolicyClient
from policy_service.config import ConfigError, load_config
from policy_service.serving.server import start_service
from policy_service.trust.tls import channel_credentials
from slurm_plugin.hooks import run as hooks, spool

DEADLINE_S = 5.0
FACTS = pb.JobFacts(user="u", uid=1000, tres_per_node="gres:gpu:1")


def openssl(*args: str, cwd: Path) -> None:
    if shutil.which("openssl") is None:
        pytest.fail("the openssl CLI is not installed (contrib/dev-cluster/cluster.sh install adds it)")
    done = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"openssl {' '.join(args)}: {done.stderr}"


def make_ca(d: Path, name: str) -> None:
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={name}",
            "-keyout", f"{name}.key", "-out", f"{name}.pem", cwd=d)


def make_cert(d: Path, name: str, ca: str, ext: str) -> None:
    (d / f"{name}.ext").write_text(ext)
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
            "-out", f"{name}.csr", cwd=d)
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
            "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.pem", cwd=d)
    (d / f"{name}.key").chmod(0o600)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """A CA, the service's certificate for 127.0.0.1 and localhost, a client certificate from that
    CA, and a second CA with a client certificate of its own (a stranger)."""
    d = tmp_path_factory.mktemp("pki")
    make_ca(d, "ca")
    make_cert(d, "server", "ca", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    make_cert(d, "client", "ca", "extendedKeyUsage=clientAuth\n")
    make_ca(d, "otherca")
    make_cert(d, "stranger", "otherca", "extendedKeyUsage=clientAuth\n")
    return d


def start(service_env, slurm_jobs, pki: Path, client_ca: bool):
    env = {**service_env, "SWAPAWARE_TLS__CERT": str(pki / "server.pem"), "SWAPAWARE_TLS__KEY": str(pki / "server.key")}
    if client_ca:
        env["SWAPAWARE_TLS__CLIENT_CA"] = str(pki / "ca.pem")
    return start_service(load_config(env=env), slurm=slurm_jobs)


@pytest.fixture
def tls_service(service_env, slurm_jobs, pki):
    svc = start(service_env, slurm_jobs, pki, client_ca=False)
    yield svc
    svc.stop(0)


@pytest.fixture
def mtls_service(service_env, slurm_jobs, pki):
    svc = start(service_env, slurm_jobs, pki, client_ca=True)
    yield svc
    svc.stop(0)


def client(svc, tls: TlsConfig | None, host: str = "127.0.0.1") -> PolicyClient:
    return PolicyClient(f"{host}:{svc.grpc_port}", DEADLINE_S, tls=channel_credentials(tls) if tls else None)


def fails(c: PolicyClient) -> grpc.RpcError:
    with c, pytest.raises(grpc.RpcError) as err:
        c.admit(FACTS)
    return err.value


def test_a_client_that_trusts_the_ca_gets_answers(tls_service, pki):
    for host in ("127.0.0.1", "localhost"):  # both are in the certificate's subjectAltName
        with client(tls_service, TlsConfig(ca=str(pki / "ca.pem")), host) as c:
            assert c.admit(FACTS).decision.decision_id


def test_plaintext_and_untrusting_clients_fail(tls_service, pki):
    assert fails(client(tls_service, None)).code() == grpc.StatusCode.UNAVAILABLE
    assert fails(client(tls_service, TlsConfig(ca=str(pki / "otherca.pem")))).code() == grpc.StatusCode.UNAVAILABLE


def test_client_certificates_when_the_service_requires_them(mtls_service, pki):
    ca = str(pki / "ca.pem")
    assert fails(client(mtls_service, TlsConfig(ca=ca))).code() == grpc.StatusCode.UNAVAILABLE
    stranger = TlsConfig(ca=ca, client_cert=str(pki / "stranger.pem"), client_key=str(pki / "stranger.key"))
    assert fails(client(mtls_service, stranger)).code() == grpc.StatusCode.UNAVAILABLE
    assert fails(client(mtls_service, None)).code() == grpc.StatusCode.UNAVAILABLE
    good = TlsConfig(ca=ca, client_cert=str(pki / "client.pem"), client_key=str(pki / "client.key"))
    with client(mtls_service, good) as c:
        assert c.admit(FACTS).decision.decision_id


def test_the_service_checks_its_files_before_it_starts(service_env, slurm_jobs, pki, tmp_path):
    open_key = tmp_path / "open.key"
    open_key.write_bytes((pki / "server.key").read_bytes())
    open_key.chmod(0o644)
    cases = [
        ({"SWAPAWARE_TLS__KEY": str(open_key)}, "readable by every user"),
        ({"SWAPAWARE_TLS__CERT": str(tmp_path / "missing.pem")}, "tls.cert: .*missing.pem"),
        ({"SWAPAWARE_TLS__CLIENT_CA": str(pki / "server.ext")}, "tls.client_ca: .* is not PEM"),
    ]
    base = {**service_env, "SWAPAWARE_TLS__CERT": str(pki / "server.pem"), "SWAPAWARE_TLS__KEY": str(pki / "server.key")}
    for extra, message in cases:
        with pytest.raises(ConfigError, match=message):
            start_service(load_config(env={**base, **extra}), slurm=slurm_jobs)
    with pytest.raises(ConfigError, match="tls.cert and tls.key go together"):
        load_config(env={**service_env, "SWAPAWARE_TLS__CERT": str(pki / "server.pem")})


def test_hooks_deliver_over_tls(tls_service, service_env, pki):
    cfg = load_config(env={**service_env, "SWAPAWARE_HOOKS__SERVICE_ADDRESS": f"127.0.0.1:{tls_service.grpc_port}",
                           "SWAPAWARE_TLS__CA": str(pki / "ca.pem")})
    assert hooks.deliver(cfg.hooks, "JobFinished", pb.JobFinishedRequest(job_id=3, event_id="f3", finished_at=1.0),
                         auth=cfg.auth, tls=cfg.tls)
    assert [o.job_id for o in tls_service.store.observations()] == [3]


def test_hooks_with_a_bad_tls_file_never_fall_back_to_plaintext(service, service_env, tmp_path):
    """A plaintext service (or whoever answers on its address) gets nothing: the event is spooled
    until the file is fixed."""
    spool_dir = Path(service_env["SWAPAWARE_HOOKS__SPOOL_DIR"])
    cfg = load_config(env={**service_env, "SWAPAWARE_HOOKS__SERVICE_ADDRESS": f"127.0.0.1:{service.grpc_port}",
                           "SWAPAWARE_TLS__CA": str(tmp_path / "missing-ca.pem")})
    assert not hooks.deliver(cfg.hooks, "JobFinished", pb.JobFinishedRequest(job_id=4, event_id="f4", finished_at=1.0),
                             auth=cfg.auth, tls=cfg.tls)
    assert len(spool.pending(spool_dir)) == 1
    assert service.store.observations() == []


def test_the_doctors_probe_checks_the_service_over_tls(tls_service, pki):
    from policy_service.admin import probe_service
    address = f"127.0.0.1:{tls_service.grpc_port}"
    assert probe_service(address, DEADLINE_S, TlsConfig(ca=str(pki / "ca.pem")))
    assert not probe_service(address, DEADLINE_S)  # plaintext: no answer from a TLS service
    assert not probe_service(address, DEADLINE_S, TlsConfig(ca=str(pki / "otherca.pem")))
