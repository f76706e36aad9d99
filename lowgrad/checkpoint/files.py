"""A checkpoint's files as a reader meets them: each must be a regular file, checked before it
is opened for its bytes (a FIFO blocks the reader that opens it, a character device such as
``/dev/zero`` never ends), and refused naming what it is instead."""
from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from lowgrad.base.errors import CheckpointError

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def kind(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, in words (``"a FIFO (named pipe)"``)."""
    return next((name for test, name in _KINDS if test(mode)), "a regular file" if stat.S_ISREG(mode) else
                f"a special file (mode {stat.filemode(mode)})")


def regular(path: Path, missing: str) -> os.stat_result:
    """The status of ``path`` (links followed): CheckpointError naming the path when it is
    missing (``missing`` says what that means), not a regular file (what it is) or unreadable."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: {missing}") from None
    except OSError as e:
        if e.errno == errno.ENOTDIR:  # a parent is a file: say which
            parent = next(p for p in path.parents if p.exists())
            raise CheckpointError(f"{path}: {parent} is {kind(os.stat(parent).st_mode)}, not a directory") from None
        raise CheckpointError(f"{path}: unreadable ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{path} is {kind(st.st_mode)}, not a regular file")
    return st


def read_capped(path: Path, cap: int, what: str, missing: str) -> bytes:
    """The whole content of the regular file ``path``, refused without being read when it holds
    more than ``cap`` bytes, the most a ``what`` may hold (CheckpointError naming the file and its
    size). Checked again on the open file (opened ``O_NONBLOCK``: a FIFO put there since the
    first check does not block the open), so a file swapped in between is refused too; one that
    grows while read is refused (a writer at work: a checkpoint's files never change)."""
    regular(path, missing)
    try:
        with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC), "rb") as fh:
            st = os.fstat(fh.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointError(f"{path} is {kind(st.st_mode)}, not a regular file")
            if st.st_size > cap:
                raise CheckpointError(f"{path}: {st.st_size} bytes, more than a {what} may hold ({cap}): not read")
            data = fh.read(st.st_size)  # read(n) allocates n bytes first: the size, never the cap
            grew = fh.read(1)
    except OSError as e:
        raise CheckpointError(f"{path}: unreadable ({e.strerror})") from None
    if grew:
        raise CheckpointError(f"{path}: grew while it was read (is a save writing it?)")
    return data
