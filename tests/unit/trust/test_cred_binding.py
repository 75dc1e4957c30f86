"""The payload that binds a MUNGE credential to one call (policy_service/trust/cred_binding.py), and
the TTL rule that goes with it."""
from __future__ import annotations

import hashlib

import pytest

from policy_service.trust import cred_binding
from policy_service.trust.cred_binding import Unbound
from policy_service.config import ConfigError, load_config

ADMIT = "/swapaware.v1.PolicyService/Admit"


def test_the_payload_names_swapaware_the_method_and_the_digest_of_the_bytes():
    raw = b"\x0a\x03abc"
    assert cred_binding.payload(ADMIT, raw) == \
        f"swapaware/v1 {ADMIT} {hashlib.sha256(raw).hexdigest()}".encode()
    assert cred_binding.check(cred_binding.payload(ADMIT, raw), ADMIT, raw) is None


@pytest.mark.parametrize(("got", "why"), [
    (b"", Unbound.EMPTY),
    (b"\x00\x00\x00\x2ajob step credential", Unbound.FOREIGN),
    (b"swapaware/v2 " + ADMIT.encode() + b" " + b"0" * 64, Unbound.FOREIGN),
    (b"swapaware/v1 " + ADMIT.encode(), Unbound.FOREIGN),
    (cred_binding.payload("/swapaware.v1.PolicyService/Explain", b"\x0a\x03abc"), Unbound.OTHER_METHOD),
    (cred_binding.payload(ADMIT, b"\x0a\x03abd"), Unbound.OTHER_REQUEST),
    (cred_binding.payload(ADMIT, b"\x0a\x03abc") + b"\n", Unbound.OTHER_REQUEST),
])
def test_anything_else_is_unbound_and_says_why(got, why):
    assert cred_binding.check(got, ADMIT, b"\x0a\x03abc") is why
    assert why.explain(ADMIT)


def test_max_ttl_is_at_most_what_the_clients_use():
    assert load_config(env={}).auth.max_ttl_s == cred_binding.CLIENT_TTL_S == 60
    assert load_config(env={"SWAPAWARE_AUTH__MAX_TTL_S": "30"}).auth.max_ttl_s == 30
    with pytest.raises(ConfigError, match="auth.max_ttl_s must be between 1 and 60"):
        load_config(env={"SWAPAWARE_AUTH__MAX_TTL_S": "300"})
