"""The pure access rules (policy_service.trust.authz): each verdict for each kind of caller."""
from __future__ import annotations

import grpc
import pytest

from policy_service.trust.authz import (
    Addresses,
    Caller,
    Owner,
    Standing,
    Trust,
    Via,
    admit_verdict,
    credential_verdict,
    event_verdict,
    explain_precheck,
    explain_verdict,
    is_admin,
)

SLURM_UID, SERVICE_UID, USER_UID, OTHER_UID = 64030, 990, 1000, 1001
NODE, CTLD, STRANGER = "10.0.0.5", "10.0.0.1", "192.0.2.9"

MUNGE = Trust(munge=True, token=False, slurm_uid=SLURM_UID, service_uid=SERVICE_UID)
MUNGE_AND_TOKEN = Trust(munge=True, token=True, slurm_uid=SLURM_UID, service_uid=SERVICE_UID)
TOKEN_ONLY = Trust(munge=False, token=True, slurm_uid=SLURM_UID, service_uid=SERVICE_UID)
OPEN = Trust(munge=False, token=False, slurm_uid=SLURM_UID, service_uid=SERVICE_UID)
ADDRS = Addresses(nodes={NODE: "gpu01"}, controllers={CTLD: "ctl"})

OK = None  # allowed, no status code


def munge_caller(uid: int, addr: str = NODE, gid: int | None = None) -> Caller:
    return Caller(Via.MUNGE, uid, uid if gid is None else gid, addr)


ROOT_ON_NODE = munge_caller(0)
SLURM_ON_NODE = munge_caller(SLURM_UID)
USER_ON_NODE = munge_caller(USER_UID)
ROOT_ON_CTLD = munge_caller(0, CTLD)
SLURM_ON_CTLD = munge_caller(SLURM_UID, CTLD)
ROOT_ELSEWHERE = munge_caller(0, STRANGER)
TOKEN = Caller(Via.TOKEN, token=True)
ANON = Caller(Via.ANONYMOUS)
REFUSED = Caller(Via.ANONYMOUS, problem="MUNGE credential refused: munge_decode: Replayed credential (CRED_REPLAYED)")


def check(v, allowed: bool, code, *texts: str) -> None:
    assert v.allowed is allowed, v
    assert v.code == code, v
    for t in texts:
        assert t in v.reason, (t, v.reason)


# ---------------------------------------------------------------- events
@pytest.mark.parametrize("caller,texts", [
    (ROOT_ON_NODE, ["MUNGE uid 0", "node gpu01"]),
    (SLURM_ON_NODE, [f"MUNGE uid {SLURM_UID}", "node gpu01"]),
    (ROOT_ON_CTLD, ["controller ctl"]),  # the controller's hooks (a node that also runs slurmctld)
])
def test_events_from_root_or_slurmuser_on_a_cluster_host_are_accepted(caller, texts):
    check(event_verdict("JobFinished", caller, MUNGE, ADDRS), True, OK, *texts)


def test_events_from_a_user_on_a_node_are_refused():
    check(event_verdict("JobStarted", USER_ON_NODE, MUNGE, ADDRS), False, grpc.StatusCode.PERMISSION_DENIED,
          "JobStarted is for the cluster's hooks", f"uid {USER_UID}", "neither root nor SlurmUser",
          f"(uid {SLURM_UID})")


def test_events_from_root_on_a_host_outside_the_cluster_are_refused():
    check(event_verdict("ReportEvents", ROOT_ELSEWHERE, MUNGE, ADDRS), False, grpc.StatusCode.PERMISSION_DENIED,
          f"{STRANGER} is not a node or controller of this cluster")
    partial = Addresses(nodes=ADDRS.nodes, controllers={}, error="reading the controllers from Slurm failed: x")
    check(event_verdict("ReportEvents", ROOT_ELSEWHERE, MUNGE, partial), False, grpc.StatusCode.PERMISSION_DENIED,
          "the address list may be incomplete: reading the controllers from Slurm failed")


def test_events_with_the_token():
    check(event_verdict("JobFinished", TOKEN, TOKEN_ONLY, Addresses()), True, OK, "holds the hooks' token")
    # The token is the fallback: it stands where a credential's origin would not (a node Slurm
    # does not list yet), and whatever uid the credential names.
    both = Caller(Via.MUNGE, USER_UID, USER_UID, STRANGER, token=True)
    check(event_verdict("JobFinished", both, MUNGE_AND_TOKEN, ADDRS), True, OK, "hooks' token")


MUNGE_NEEDED = "a MUNGE credential (metadata x-swapaware-munge) from root or SlurmUser on a cluster node"
TOKEN_NEEDED = "the hooks' token (metadata authorization: Bearer <token>)"


@pytest.mark.parametrize("trust,needs", [
    (MUNGE, MUNGE_NEEDED),
    (MUNGE_AND_TOKEN, f"{MUNGE_NEEDED}, or {TOKEN_NEEDED}"),
    (TOKEN_ONLY, TOKEN_NEEDED),  # no word of MUNGE where the service checks none
])
def test_anonymous_events_are_refused_when_an_identity_mechanism_exists(trust, needs):
    check(event_verdict("JobFinished", ANON, trust, ADDRS), False, grpc.StatusCode.UNAUTHENTICATED,
          f"JobFinished needs {needs}; the caller sent none")


def test_with_no_identity_mechanism_events_are_trusted():
    check(event_verdict("JobFinished", ANON, OPEN, Addresses()), True, OK, "no identity mechanism")


def test_a_refused_credential_is_unauthenticated_everywhere_even_with_no_mechanism():
    for v in (credential_verdict(REFUSED), event_verdict("JobFinished", REFUSED, OPEN, ADDRS),
              admit_verdict(REFUSED, MUNGE, ADDRS), explain_precheck(REFUSED, OPEN),
              explain_verdict(REFUSED, OPEN, Owner(USER_UID, "alice"), Standing())):
        check(v, False, grpc.StatusCode.UNAUTHENTICATED, "CRED_REPLAYED")
    check(credential_verdict(ROOT_ON_NODE), True, OK)


@pytest.mark.parametrize("uid,allowed", [(0, True), (SERVICE_UID, True), (SLURM_UID, False), (USER_UID, False)])
def test_events_over_the_local_socket(uid, allowed):
    v = event_verdict("JobFinished", Caller.peer(uid, uid), MUNGE, Addresses())
    if allowed:
        check(v, True, OK, f"local-socket peer uid {uid} is root or the service's user")
    else:
        check(v, False, grpc.StatusCode.PERMISSION_DENIED,
              f"over the local socket is for root and the service's user (uid {SERVICE_UID}); the peer is uid {uid}")


def test_a_peer_of_unknown_uid_is_anonymous():
    assert Caller.peer(None) == Caller(Via.ANONYMOUS)
    assert Caller.peer(5, 6) == Caller(Via.PEER, 5, 6)


# ---------------------------------------------------------------- Admit: recorded only for slurmctld
@pytest.mark.parametrize("caller", [ROOT_ON_CTLD, SLURM_ON_CTLD])
def test_admit_from_root_or_slurmuser_on_a_controller_is_recorded(caller):
    check(admit_verdict(caller, MUNGE, ADDRS), True, OK, "(controller ctl)")


@pytest.mark.parametrize("caller,texts", [
    (ROOT_ON_NODE, [f"{NODE} is not a controller (SlurmctldHost) of this cluster"]),
    (ROOT_ELSEWHERE, [f"{STRANGER} is not a controller"]),
    (munge_caller(USER_UID, CTLD), ["neither root nor SlurmUser"]),  # a user logged in on the controller
    (TOKEN, ["the hooks' token identifies the nodes' hooks, not slurmctld"]),
    (ANON, ["the caller sent no MUNGE credential"]),
])
def test_any_other_admit_is_a_dry_run_not_a_refusal(caller, texts):
    check(admit_verdict(caller, MUNGE_AND_TOKEN, ADDRS), False, OK, *texts)


@pytest.mark.parametrize("uid,recorded", [(0, True), (SLURM_UID, True), (SERVICE_UID, True), (USER_UID, False)])
def test_admit_over_the_local_socket(uid, recorded):
    v = admit_verdict(Caller.peer(uid, uid), MUNGE, Addresses())
    if recorded:
        check(v, True, OK, "slurmctld's job_submit")
    else:
        check(v, False, OK, f"local-socket peer uid {uid} is not root, SlurmUser (uid {SLURM_UID}) "
                            f"or the service's user (uid {SERVICE_UID})")
    # the socket is identified by the kernel: the same with no mechanism for gRPC
    assert admit_verdict(Caller.peer(uid, uid), OPEN, Addresses()).allowed is recorded


def test_admit_with_no_identity_mechanism_is_trusted():
    check(admit_verdict(ANON, OPEN, Addresses()), True, OK, "no identity mechanism")


# ---------------------------------------------------------------- Explain
ALICE = Owner(USER_UID, "alice")


def test_a_user_explains_their_own_job_and_not_another_users():
    me = munge_caller(USER_UID)
    check(explain_verdict(me, MUNGE, ALICE, Standing(name="alice")), True, OK, "is the job's user")
    check(explain_verdict(me, MUNGE, Owner(OTHER_UID, "bob"), Standing(name="alice")), False,
          grpc.StatusCode.PERMISSION_DENIED, "this job belongs to another user; you are uid 1000 (alice)",
          "Only the job's user, root, SlurmUser")
    # a local-socket peer is a user too
    check(explain_verdict(Caller.peer(USER_UID), MUNGE, ALICE, Standing()), True, OK, "is the job's user")
    check(explain_verdict(Caller.peer(OTHER_UID), MUNGE, ALICE, Standing()), False,
          grpc.StatusCode.PERMISSION_DENIED, "you are uid 1001.")


def test_ownership_by_name_only_where_the_facts_have_no_uid():
    me = munge_caller(USER_UID)
    assert explain_verdict(me, MUNGE, Owner(0, "alice"), Standing(name="alice")).allowed
    assert not explain_verdict(me, MUNGE, Owner(0, "bob"), Standing(name="alice")).allowed
    assert not explain_verdict(me, MUNGE, Owner(0, ""), Standing(name="")).allowed  # no name: not "equal"
    # a uid in the facts wins over a name
    assert not explain_verdict(me, MUNGE, Owner(OTHER_UID, "alice"), Standing(name="alice")).allowed


@pytest.mark.parametrize("caller,standing,why", [
    (ROOT_ON_NODE, Standing(), "is root"),
    (SLURM_ON_NODE, Standing(), "is SlurmUser"),
    (munge_caller(SERVICE_UID), Standing(), "is the service's user"),
    (munge_caller(OTHER_UID), Standing(name="op", admin_level="Operator"), "is a Slurm Operator"),
    (munge_caller(OTHER_UID), Standing(name="adm", admin_level="Administrator"), "is a Slurm Administrator"),
    (munge_caller(OTHER_UID), Standing(name="staff", admin_group=True), "is in auth.admin_group"),
    (TOKEN, Standing(), "holds the hooks' token"),
])
def test_operators_admins_and_the_clusters_own_identities_see_every_job(caller, standing, why):
    assert is_admin(caller, MUNGE_AND_TOKEN, standing) == why
    check(explain_verdict(caller, MUNGE_AND_TOKEN, ALICE, standing), True, OK, why)


@pytest.mark.parametrize("level", ["None", "", None])
def test_a_plain_user_is_no_admin(level):
    assert is_admin(munge_caller(OTHER_UID), MUNGE, Standing(name="bob", admin_level=level)) == ""


def test_anonymous_explain():
    check(explain_precheck(ANON, MUNGE), False, grpc.StatusCode.UNAUTHENTICATED,
          "explaining a recorded job needs your identity: a MUNGE credential")
    check(explain_verdict(ANON, MUNGE, ALICE, Standing()), False, grpc.StatusCode.UNAUTHENTICATED)
    check(explain_precheck(munge_caller(USER_UID), MUNGE), True, OK)
    check(explain_precheck(ANON, TOKEN_ONLY), False, grpc.StatusCode.UNAUTHENTICATED,
          "checks no MUNGE credentials (auth.munge): only holders of the hooks' token may")
    check(explain_verdict(TOKEN, TOKEN_ONLY, ALICE, Standing()), True, OK, "holds the hooks' token")
    # no identity mechanism: everyone sees every job, as before
    check(explain_precheck(ANON, OPEN), True, OK)
    check(explain_verdict(ANON, OPEN, ALICE, Standing()), True, OK, "no identity mechanism is configured")
