"""Files that appear whole or not at all: written under a temporary name, fsynced, renamed, and
the directory fsynced so that the rename itself survives a power cut (POSIX rename is atomic)."""
from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make the directory's entries (a file created or renamed in it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: Path, chunks: list[bytes | memoryview]) -> None:
    """``chunks`` written to ``path`` durably (the file's data fsynced; its directory is the
    caller's to fsync once, after its last file)."""
    with open(path, "wb") as fh:
        for c in chunks:
            fh.write(c)
        fh.flush()
        os.fsync(fh.fileno())


def publish(tmp: Path, final: Path) -> None:
    """Rename the finished directory ``tmp`` (its files written by :func:`write_file`) to ``final``
    (absent: checked by the caller), its entries and the rename made durable: before the rename
    the checkpoint does not exist, after it it is whole."""
    fsync_dir(tmp)
    os.rename(tmp, final)
    fsync_dir(final.parent)
