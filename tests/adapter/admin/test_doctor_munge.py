"""doctor's munge_origin check against a real, private munged: one started with the null origin
(what munged falls back to where this host's name does not resolve: 'Continuing with origin set to
null address') fails with the words the service refuses hook events with; one whose origin is the
node's address passes. The cluster's addresses come from a stand-in for Slurm."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from policy_service.admin.host import munge_probe
from policy_service.trust.auth_config import AuthConfig, MungeMode
from policy_service.config import Config

from tests.adapter.trust.test_munge import start_munged

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: starts a private munged")


class Slurm:
    """The two look-ups the service's Authorizer makes for a credential's origin."""

    def node_addresses(self) -> dict[str, str]:
        return {"10.0.0.11": "gpu01", "10.0.0.12": "gpu02"}

    def controller_addresses(self) -> dict[str, str]:
        return {"10.0.0.1": "ctl01"}


@pytest.fixture(scope="module")
def base() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="sa-doctor-munge-", dir="/tmp") as d:
        os.chmod(d, 0o755)
        yield Path(d)


def _check(sock: Path):
    cfg = Config(auth=AuthConfig(munge=MungeMode.ON, munge_socket=sock))
    return munge_probe(cfg, "gpu01", None, slurm=Slurm())


def test_null_origin_fails_then_the_nodes_address_passes(base):
    m = start_munged(base, "null", origin="0.0.0.0")
    try:
        c = _check(m.socket)
    finally:
        m.stop()
    assert not c.ok, c
    assert "origin 0.0.0.0" in c.detail and "0.0.0.0 is not a node or controller of this cluster" in c.detail
    assert "--origin=10.0.0.11" in c.fix
    m = start_munged(base, "node", origin="10.0.0.11")
    try:
        c = _check(m.socket)
    finally:
        m.stop()
    assert c.ok and not c.warn and c.detail == "origin 10.0.0.11: MUNGE uid 0 gid 0 from 10.0.0.11 (node gpu01)", c


def test_no_munged_is_said_not_failed(base):
    c = _check(base / "no-munged" / "munge.socket")
    assert c.ok and c.warn and "gave no credential" in c.detail, c
