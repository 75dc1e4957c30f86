"""Replacing a file so that a reader sees the old one or the new one, never a part: a temporary
file beside it (mkstemp: created exclusively, 0600 until its mode is set), written, fsynced,
renamed over the old one, and the directory fsynced."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Iterable


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
