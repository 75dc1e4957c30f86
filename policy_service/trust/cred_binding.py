"""What a MUNGE credential of swapaware's clients is for: its payload binds it to one request.

munged vouches for who encoded a credential (uid, gid, host) and that it is fresh and used once,
not for what it was made for: a credential slurmctld's SlurmUser made for Slurm itself (the
job-step credential every ``srun`` receives is one, with no uid restriction) would otherwise be
a SlurmUser credential for swapaware. So every credential the clients make carries the payload

    swapaware/v1 <method> <digest>

(ASCII, single spaces, nothing else, no newline) where ``<method>`` is the gRPC method's full
name (``/swapaware.v1.PolicyService/Admit``) and ``<digest>`` the lowercase hex SHA-256 of the
request message exactly as it goes on the wire: the client serialises the message once
(deterministically), digests those bytes and sends those bytes; the service digests the bytes it
received, before parsing. A field a newer client knows and the service does not is covered like
any other. For events the node the event comes from is a field of the request (JobStarted /
JobFinished ``node``, each ReportEvents event's), so the digest covers it too.

The service accepts a credential only with exactly this payload for the method and the bytes it
arrived with; an empty, foreign, other-method or other-request payload is refused whatever the
credential's uid (``Unbound`` says which). Pure: no I/O.
"""
from __future__ import annotations

import enum
import hashlib
import hmac

PREFIX = b"swapaware/v1"
# The TTL every client gives its credentials (each is made for one call and sent at once); the
# service accepts none made to live longer (auth.max_ttl_s is at most this).
CLIENT_TTL_S = 60


class Unbound(enum.Enum):
    """Why a credential's payload does not bind it to the request it came with (the value is the
    ``why`` label of swapaware_credentials_refused_total)."""

    EMPTY = "empty_payload"
    FOREIGN = "foreign_payload"
    OTHER_METHOD = "other_method"
    OTHER_REQUEST = "other_request"

    def explain(self, method: str) -> str:
        return {
            Unbound.EMPTY: "its payload is empty (swapaware's clients bind every credential to its request)",
            Unbound.FOREIGN: "its payload is not swapaware's (a credential made for something else, such as "
                             "one of Slurm's own)",
            Unbound.OTHER_METHOD: f"it was made for another method, not {method}",
            Unbound.OTHER_REQUEST: f"it was made for another {method} request (its digest does not match)",
        }[self]


def digest(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


def payload(method: str, raw: bytes) -> bytes:
    """The payload of a credential for calling ``method`` (full gRPC name) with the serialised
    request ``raw``."""
    return b" ".join((PREFIX, method.encode("ascii"), digest(raw).encode("ascii")))


def check(got: bytes, method: str, raw: bytes) -> Unbound | None:
    """None when ``got`` is exactly the payload for ``method`` and ``raw``, else why not."""
    if hmac.compare_digest(got, payload(method, raw)):
        return None
    if not got:
        return Unbound.EMPTY
    words = got.split(b" ")
    if len(words) != 3 or words[0] != PREFIX:
        return Unbound.FOREIGN
    if words[1] != method.encode("ascii"):
        return Unbound.OTHER_METHOD
    return Unbound.OTHER_REQUEST
