"""The one rule for opening an adapter file on the local filesystem, shared by the service's local
source and the adapter-cache sidecar's file:// store.

- Regular files only: a FIFO or a device is refused at once (opened non-blocking, so a FIFO with
  no writer cannot wedge the reading thread).
- Confined to the allowed roots at open time: the path is resolved and checked, the final
  component is opened without following a link (one swapped in since fails), and the opened
  descriptor's own path is checked again (a directory swapped for a link since is caught).
  Symlinks that stay inside a root are fine.
- The size bound is checked on the open descriptor before anything is read.
- Errors name the path asked for, never where it points nor any of its content.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Sequence
from pathlib import Path

from inference_service.errors import (
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    UnavailableError,
)

_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0)


def _inside(path: Path, roots: Sequence[Path]) -> bool:
    return any(path == root or root in path.parents for root in roots)


def open_regular(path: str | Path, roots: Sequence[Path] | None, max_bytes: int | None
                 ) -> tuple[int, os.stat_result]:
    """An open descriptor (the caller closes it) and its stat, or a LoraplexError.

    `roots`: resolved directories the file must lie under (None: anywhere; an empty list: nowhere).
    `max_bytes`: the largest size accepted (None: no bound)."""
    real = Path(os.path.realpath(path))
    if roots is not None and not _inside(real, roots):
        raise PermissionDeniedError(f"{path} resolves outside every allowed file root")
    try:
        _require_regular(path, os.stat(real).st_mode)  # before opening: opening a device can act
        fd = os.open(real, _FLAGS)
    except FileNotFoundError:
        raise NotFoundError(f"adapter file not found: {path}") from None
    except PermissionError:
        raise PermissionDeniedError(f"{path}: not readable") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # the final component became a link after it was resolved
            raise PermissionDeniedError(f"{path} changed into a symbolic link while being opened") from None
        raise InvalidArgumentError(f"{path} cannot be opened: {os.strerror(exc.errno or 0)}") from None
    try:
        st = os.fstat(fd)
        _require_regular(path, st.st_mode)  # a FIFO or device swapped in after the stat
        if roots is not None and not _inside(_opened_path(fd, real), roots):
            raise PermissionDeniedError(f"{path} resolves outside every allowed file root")
        if max_bytes is not None and st.st_size > max_bytes:
            raise InvalidArgumentError(f"{path} is {st.st_size} bytes, over the limit of {max_bytes}")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def _require_regular(path: str | Path, mode: int) -> None:
    if not stat.S_ISREG(mode):
        kind = ("directory" if stat.S_ISDIR(mode) else "FIFO" if stat.S_ISFIFO(mode) else "socket"
                if stat.S_ISSOCK(mode) else "device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "special file")
        raise InvalidArgumentError(f"{path} is a {kind}, not a regular file")


def _opened_path(fd: int, fallback: Path) -> Path:
    """Where the descriptor really is (Linux /proc); elsewhere the path resolved before opening."""
    try:
        return Path(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        return fallback


def read_fd(fd: int, size: int, path: str | Path) -> bytearray:
    """Exactly `size` bytes from the start of `fd`."""
    buf = bytearray(size)
    view, got = memoryview(buf), 0
    while got < size:
        n = os.preadv(fd, [view[got:]], got)
        if n == 0:
            raise UnavailableError(f"{path} shrank while being read ({got} of {size} bytes)")
        got += n
    return buf


def read_regular(path: str | Path, roots: Sequence[Path] | None, max_bytes: int | None) -> bytearray:
    """The whole file under the rules above."""
    fd, st = open_regular(path, roots, max_bytes)
    try:
        return read_fd(fd, st.st_size, path)
    finally:
        os.close(fd)
