"""Files that appear whole or not at all: written under a temporary name, fsynced, renamed, and
the directory fsynced so that the rename itself survives a power cut (POSIX rename is atomic).
A save's temporary directory has a name of its own (a random token) and is locked (``flock``) by
the process that made it while the save runs, so that a later save can tell a leftover of a
crashed save (unlocked: removed) from one in progress (locked: left alone)."""
from __future__ import annotations

import fcntl
import os
import re
import shutil
import warnings
from pathlib import Path

_PARTIAL = re.compile(r"\..+\.[0-9a-f]{16}\.partial")


def fsync_dir(path: Path) -> None:
    """Make the directory's entries (a file created or renamed in it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs(path: Path) -> None:
    """``path`` and its missing parents created, each made durable in its parent (a directory
    entry not fsynced can vanish on a power cut, and with it the first checkpoint under it)."""
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for d in reversed(missing):
        d.mkdir(exist_ok=True)  # another job may create it at the same time
        fsync_dir(d.parent)


def partial(final: Path, token: str) -> Path:
    """The temporary directory of the save of ``final`` whose token (16 hex digits) is ``token``."""
    return final.parent / f".{final.name}.{token}.partial"


def claim(tmp: Path) -> int:
    """``tmp`` created and locked; the descriptor that holds the lock (:func:`release` it). On a
    file system without ``flock`` (some network mounts) it stays unlocked: :func:`remove_stale`
    cannot lock it either there, so it removes nothing and the save goes on."""
    # made and locked under a name no cleaner matches, then renamed (the lock is the directory's,
    # whatever its name): a cleaner never sees it unlocked while this save runs
    making = tmp.with_name(tmp.name + ".new")
    making.mkdir()
    fd = os.open(making, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new directory: nobody else holds it
    except OSError:
        pass  # no flock here (ENOLCK, EOPNOTSUPP, ...)
    try:
        os.rename(making, tmp)
    except OSError:
        os.close(fd)
        raise
    return fd


def release(fd: int) -> None:
    os.close(fd)  # closing drops the lock


def remove_stale(parent: Path) -> None:
    """Remove the temporary directories in ``parent`` that no running save holds (left by a save
    that crashed or failed); those locked by a save in progress stay, and all stay where the file
system has no ``flock``."""
    for d in sorted(parent.iterdir()):
        if not _PARTIAL.fullmatch(d.name) or not d.is_dir():
            continue
        try:
            fd = os.open(d, os.O_RDONLY)
        except OSError:
            continue  # removed by another cleaner meanwhile
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # a save in progress, or no flock on this file system: nothing tells a leftover
        try:
            shutil.rmtree(d, ignore_errors=True)
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
    (absent: checked by the caller; a directory published there meanwhile makes the rename fail),
    its entries and the rename made durable: before the rename the checkpoint does not exist, after
    it it is whole. Once renamed it is published: a failure to fsync the parent after that is a
    RuntimeWarning (the checkpoint is there and loads; only a power cut before the parent reaches
    the disk could take it back, leaving the previous ones), not an error that a retry under the
    same name would meet as "exists already"."""
    fsync_dir(tmp)
    os.rename(tmp, final)
    try:
        fsync_dir(final.parent)
    except OSError as e:
        warnings.warn(f"{final}: published, but its parent directory could not be fsynced ({e}): a power cut "
                      "now could undo the rename", RuntimeWarning, stacklevel=2)
