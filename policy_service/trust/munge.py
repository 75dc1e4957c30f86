"""MUNGE credentials through libmunge (ctypes; Debian package ``libmunge2``).

A credential names the uid and gid of the process that encoded it and the IPv4 address of
the host whose munged encoded it (its "origin"), and only a host holding the cluster's key can
make one: Slurm's own identity. munged keeps the replay cache (a credential decodes once) and
enforces the TTL; this module does neither. Decoding needs the local munged, so a credential
is checked on the host that decodes it.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import enum
import ipaddress
import threading
from dataclasses import dataclass
from pathlib import Path

DEFAULT_SOCKET = "/run/munge/munge.socket.2"
# The gRPC metadata key carrying a MUNGE credential: serving/client.py sends it, access.py reads it.
MUNGE_METADATA = "x-swapaware-munge"
LIBRARY = "libmunge.so.2"

# munge.h: munge_opt_t
_OPT_TTL = 4
_OPT_ADDR4 = 5
_OPT_ENCODE_TIME = 6
_OPT_SOCKET = 8


class MungeCode(enum.Enum):
    """munge.h's munge_err_t (the ones a caller must tell apart are named in the docs)."""

    SUCCESS = 0
    SNAFU = 1
    BAD_ARG = 2
    BAD_LENGTH = 3
    OVERFLOW = 4
    NO_MEMORY = 5
    SOCKET = 6  # munged unreachable (not running, wrong socket path)
    TIMEOUT = 7
    BAD_CRED = 8  # not a credential at all
    BAD_VERSION = 9
    BAD_CIPHER = 10
    BAD_MAC = 11
    BAD_ZIP = 12
    BAD_REALM = 13
    CRED_INVALID = 14  # made with another key, or tampered with
    CRED_EXPIRED = 15
    CRED_REWOUND = 16  # encoded in the future (clock skew)
    CRED_REPLAYED = 17  # decoded before: a credential is good once
    CRED_UNAUTHORIZED = 18
    LIBRARY_MISSING = 1000  # not munge's: libmunge.so.2 does not load

    @classmethod
    def of(cls, number: int) -> "MungeCode":
        try:
            return cls(number)
        except ValueError:
            return cls.SNAFU


class MungeError(Exception):
    def __init__(self, code: MungeCode, message: str):
        super().__init__(f"{message} ({code.name})")
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Credential:
    """What a decoded credential says."""

    uid: int
    gid: int
    addr: str  # IPv4 address of the encoding host (MUNGE_OPT_ADDR4), e.g. "10.0.0.5"
    encoded_at: int  # unix time
    ttl: int  # seconds
    payload: bytes


_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_lib_error = ""


def _load() -> ctypes.CDLL:
    global _lib, _lib_error
    with _lock:
        if _lib is None and not _lib_error:
            try:
                lib = ctypes.CDLL(LIBRARY)
            except OSError:
                found = ctypes.util.find_library("munge")
                try:
                    lib = ctypes.CDLL(found) if found else None
                except OSError:
                    lib = None
                if lib is None:
                    _lib_error = f"{LIBRARY} does not load (install the libmunge2 package)"
                    raise MungeError(MungeCode.LIBRARY_MISSING, _lib_error) from None
            _declare(lib)
            _lib = lib
        if _lib is None:
            raise MungeError(MungeCode.LIBRARY_MISSING, _lib_error)
        return _lib


def _declare(lib: ctypes.CDLL) -> None:
    vp, cp = ctypes.c_void_p, ctypes.c_char_p
    lib.munge_ctx_create.restype = vp
    lib.munge_ctx_create.argtypes = []
    lib.munge_ctx_destroy.restype = None
    lib.munge_ctx_destroy.argtypes = [vp]
    lib.munge_ctx_strerror.restype = cp
    lib.munge_ctx_strerror.argtypes = [vp]
    lib.munge_strerror.restype = cp
    lib.munge_strerror.argtypes = [ctypes.c_int]
    # munge_ctx_set / munge_ctx_get are variadic: only the fixed arguments are declared, the
    # rest go as ctypes values (an int or a pointer: passed alike by the x86-64 / arm64 ABIs).
    lib.munge_ctx_set.restype = ctypes.c_int
    lib.munge_ctx_get.restype = ctypes.c_int
    lib.munge_encode.restype = ctypes.c_int
    lib.munge_encode.argtypes = [ctypes.POINTER(vp), vp, vp, ctypes.c_int]
    lib.munge_decode.restype = ctypes.c_int
    lib.munge_decode.argtypes = [cp, vp, ctypes.POINTER(vp), ctypes.POINTER(ctypes.c_int),
                                 ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32)]
    libc = ctypes.CDLL(None)
    libc.free.argtypes = [vp]
    libc.free.restype = None
    lib.swapaware_free = libc.free  # memory libmunge returns is malloc()ed


def available() -> bool:
    """Whether libmunge loads here."""
    try:
        _load()
        return True
    except MungeError:
        return False


def usable(socket: str | Path = DEFAULT_SOCKET) -> bool:
    """Whether credentials can be made and checked here: libmunge loads and munged's socket exists."""
    return available() and Path(socket).is_socket()


class _Context:
    def __init__(self, lib: ctypes.CDLL, socket: str | None):
        self.lib = lib
        self.ptr = lib.munge_ctx_create()
        if not self.ptr:
            raise MungeError(MungeCode.NO_MEMORY, "munge_ctx_create failed")
        if socket:
            self._check(lib.munge_ctx_set(ctypes.c_void_p(self.ptr), ctypes.c_int(_OPT_SOCKET),
                                          ctypes.c_char_p(str(socket).encode())), "setting the socket")

    def __enter__(self) -> "_Context":
        return self

    def __exit__(self, *exc) -> None:
        self.lib.munge_ctx_destroy(self.ptr)

    def error(self, code: int, what: str) -> MungeError:
        detail = self.lib.munge_ctx_strerror(self.ptr) or self.lib.munge_strerror(code) or b"unknown error"
        return MungeError(MungeCode.of(code), f"{what}: {detail.decode(errors='replace')}")

    def _check(self, code: int, what: str) -> None:
        if code != 0:
            raise self.error(code, what)

    def set_int(self, opt: int, value: int) -> None:
        self._check(self.lib.munge_ctx_set(ctypes.c_void_p(self.ptr), ctypes.c_int(opt), ctypes.c_int(value)),
                    "setting a context option")

    def get(self, opt: int, ctype):
        out = ctype()
        self._check(self.lib.munge_ctx_get(ctypes.c_void_p(self.ptr), ctypes.c_int(opt), ctypes.byref(out)),
                    "reading a context option")
        return out


def encode(payload: bytes = b"", socket: str | None = None, ttl: int | None = None) -> str:
    """A fresh credential for this process's uid/gid (good once, for ``ttl`` seconds; None: munged's default)."""
    lib = _load()
    with _Context(lib, socket) as ctx:
        if ttl is not None:
            ctx.set_int(_OPT_TTL, int(ttl))
        cred = ctypes.c_void_p()
        buf = ctypes.create_string_buffer(payload, len(payload)) if payload else None
        code = lib.munge_encode(ctypes.byref(cred), ctypes.c_void_p(ctx.ptr),
                                ctypes.cast(buf, ctypes.c_void_p) if buf is not None else None, len(payload))
        if code != 0:
            raise ctx.error(code, "munge_encode")
        try:
            return ctypes.string_at(cred.value).decode("ascii")
        finally:
            lib.swapaware_free(cred)


def decode(cred: str, socket: str | None = None) -> Credential:
    """Check ``cred`` with the local munged; ``MungeError`` when it is not good (replayed, expired,
    rewound, invalid, not a credential) or munged cannot be reached."""
    lib = _load()
    try:
        raw = cred.encode("ascii")
    except (UnicodeEncodeError, AttributeError):
        raise MungeError(MungeCode.BAD_CRED, "credential is not ASCII text") from None
    if b"\0" in raw:
        raise MungeError(MungeCode.BAD_CRED, "credential contains a NUL byte")
    with _Context(lib, socket) as ctx:
        buf, length = ctypes.c_void_p(), ctypes.c_int(0)
        uid, gid = ctypes.c_uint32(), ctypes.c_uint32()
        code = lib.munge_decode(raw, ctypes.c_void_p(ctx.ptr), ctypes.byref(buf), ctypes.byref(length),
                                ctypes.byref(uid), ctypes.byref(gid))
        try:
            payload = ctypes.string_at(buf.value, length.value) if buf.value and length.value > 0 else b""
        finally:
            if buf.value:
                lib.swapaware_free(buf)
        if code != 0:
            raise ctx.error(code, "munge_decode")
        addr = ctx.get(_OPT_ADDR4, ctypes.c_uint32)  # struct in_addr: network byte order
        encoded_at = ctx.get(_OPT_ENCODE_TIME, ctypes.c_int64)  # time_t
        ttl = ctx.get(_OPT_TTL, ctypes.c_int)
        return Credential(uid=uid.value, gid=gid.value,
                          addr=str(ipaddress.IPv4Address(bytes(addr))),
                          encoded_at=int(encoded_at.value), ttl=int(ttl.value), payload=payload)
