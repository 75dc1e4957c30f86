"""Replacing a file so that a reader sees the old one or the new one, never a part: a temporary
file beside it (mkstemp: created exclusively, 0600 until its mode is set), written, fsynced,
renamed over the old one, and the directory fsynced. Likewise a Unix socket that appears only
once it listens (``listening_unix_server``)."""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable


def write_atomically(path: Path, data: bytes | Iterable[bytes], mode: int = 0o644, gid: int | None = None) -> int:
    """Replace ``path`` with ``data`` (bytes, or pieces of it written one after another): a reader
    sees the old file or the new one, never a part. ``mode``/``gid``: the file's, set before it
    appears under ``path`` (PermissionError when the group cannot be set). Returns the bytes
    written."""
    fd, tmp = tempfile.mkstemp(dir=str(path.parent), prefix=f".{path.name}.")
    size = 0
    try:
        with os.fdopen(fd, "wb") as f:
            if gid is not None and gid != os.fstat(f.fileno()).st_gid:
                try:
                    os.fchown(f.fileno(), -1, gid)
                except PermissionError as exc:
                    raise PermissionError(f"{path} cannot be given group {gid}, SlurmUser's, which slurmctld reads "
                                          f"it as ({exc.strerror}): run the service as root or as a member of that "
                                          "group") from None
            for piece in (data,) if isinstance(data, bytes) else data:
                size += f.write(piece)
            f.flush()
            os.fsync(f.fileno())
            os.fchmod(f.fileno(), mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    dfd = os.open(str(path.parent), os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return size


def listening_unix_server(make: Callable[[str], Any], path: Path, mode: int) -> Any:
    """A socketserver (``make(address)``, which binds and listens) whose socket appears under
    ``path`` only once it listens and has ``mode``: bound beside it under a temporary name (created
    0600 by the umask), then renamed into place. A client never finds the path and is refused (a
    socket bound but not yet listening refuses connections), and never finds it with the umask's mode."""
    tmp = path.parent / f".{path.name}.{os.getpid()}.binding"
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    old_umask = os.umask(0o177)
    try:
        server = make(str(tmp))
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()  # bound, then failing to listen
        raise
    finally:
        os.umask(old_umask)
    try:
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        server.server_close()
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    return server
