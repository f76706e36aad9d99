"""The on-disk cache of compiled kernels (cubins), shared by every process of this user.

Entries live in ``$LOWGRAD_CACHE_DIR`` (default ``~/.cache/lowgrad``), a directory private to the
user (0700) and not itself a symbolic link, named by the sha256 of their key (source and header
hashes, options, architecture, NVRTC identity). An entry is read only when it is a regular file of
this user, writable by no one else and at most :data:`MAX_ENTRY_BYTES`; its header must repeat the
whole key and its checksum must match, else the kernel is recompiled and the entry replaced
atomically. An unusable cache directory (a link, another user's, writable by others, not
creatable) means compiling in memory, with one warning, and is left as it is. What to compile
and how (NVRTC) is :mod:`lowgrad.cuda.compiler`'s; this module only keys, stores and finds the
results.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import os
import secrets
import stat
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

_MAGIC = b"LGCUBIN2"  # cache entry format (see _encode); entries of another format are recompiled
MAX_ENTRY_BYTES = 64 << 20  # a cache entry larger than this is refused unread (cubins are < 1 MiB)

_memo: dict[tuple[str, str], bytes] = {}  # (cache dir, key) -> cubin
_warned: set[str] = set()  # cache warnings already given
# Guards _memo and _warned only: held for one dict/set operation, never while compiling, doing file
# I/O or warning, and taken by no finalizer. Two threads missing the same kernel both compile it
# (harmless: identical work, atomic file replace); the first result kept is what both return.
_memo_lock = threading.Lock()
# The user the cache belongs to, against whom the directory's and entries' owners are checked
# (a test stands another user in here, so that the refusal of a foreign owner runs without root).
_user: Callable[[], int] = os.geteuid
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def cache_dir() -> Path:
    """``$LOWGRAD_CACHE_DIR`` if set, else ``~/.cache/lowgrad``."""
    return Path(os.environ.get("LOWGRAD_CACHE_DIR") or "~/.cache/lowgrad").expanduser()


def clear_memory_cache() -> None:
    """Forget the cubins held in this process and the cache warnings given (the disk cache stays)."""
    with _memo_lock:
        _memo.clear()
        _warned.clear()



# ---- entries -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Job:
    """One compilation: program ``name``, its source and headers, the NVRTC options, and the
    cache key made of all of them (plus the architecture and NVRTC's identity)."""

    name: str
    source: bytes
    headers: dict[str, bytes]
    options: tuple[str, ...]
    header: bytes  # the entry header: the full key as canonical JSON
    key: str  # sha256 of ``header``, in the file name


def make_job(source: bytes, name: str, arch: str, headers: Mapping[str, bytes], options: Sequence[str],
             nvrtc: str) -> Job:
    """The :class:`Job` of compiling ``source`` with ``options`` for ``arch`` by NVRTC ``nvrtc``
    (its identity string): the key hashes every input, options included."""
    hdrs = dict(sorted(headers.items()))
    opts = tuple(options)
    key = {"format": _MAGIC.decode(), "name": name, "arch": arch, "source": hashlib.sha256(source).hexdigest(),
           "headers": {k: hashlib.sha256(v).hexdigest() for k, v in hdrs.items()}, "options": opts,
           "nvrtc": nvrtc}
    header = json.dumps(key, sort_keys=True, separators=(",", ":")).encode()
    return Job(name, source, hdrs, opts, header, hashlib.sha256(header).hexdigest())


def _entry_name(job: Job) -> str:
    return f"{Path(job.name).stem}-{job.key}.cubin"


def _encode(job: Job, cubin: bytes) -> bytes:
    """An entry: magic, header length (u32 LE), header, sha256(header + cubin), cubin."""
    return b"".join((_MAGIC, len(job.header).to_bytes(4, "little"), job.header,
                     hashlib.sha256(job.header + cubin).digest(), cubin))


def _decode(job: Job, data: bytes) -> bytes | None:
    """The cubin of entry ``data`` if it is well formed, intact and made for ``job``'s key; else None."""
    n = len(_MAGIC) + 4 + len(job.header)
    if data[:len(_MAGIC)] != _MAGIC or data[len(_MAGIC):len(_MAGIC) + 4] != len(job.header).to_bytes(4, "little") \
            or data[len(_MAGIC) + 4:n] != job.header:
        return None
    digest, cubin = data[n:n + 32], data[n + 32:]
    return cubin if cubin and hashlib.sha256(job.header + cubin).digest() == digest else None


def _warn_once(message: str) -> None:
    """A RuntimeWarning, given once per process for each distinct ``message``."""
    with _memo_lock:
        new = message not in _warned
        _warned.add(message)
    if new:
        warnings.warn(message, RuntimeWarning, stacklevel=4)


def _open_dir(d: Path) -> int:
    """An open descriptor of the directory ``d`` itself (created 0700 when missing). A symbolic
    link at ``d`` is a PermissionError: it is not followed, so its target is never changed or
    written (the links of the directories above ``d`` are followed, as any path's are)."""
    try:
        try:
            return os.open(d, _DIR_FLAGS)
        except FileNotFoundError:
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
            return os.open(d, _DIR_FLAGS)  # O_NOFOLLOW: a link planted since is refused too
    except OSError:
        if os.path.islink(d):  # O_NOFOLLOW | O_DIRECTORY fails with ENOTDIR or ELOOP on a link
            raise PermissionError(f"{d} is a symbolic link (to {os.readlink(d)}); lowgrad does not follow it: "
                                  "set LOWGRAD_CACHE_DIR to a real directory") from None
        raise


def _open_cache_dir() -> int:
    """An open descriptor of the cache directory (created 0700 when missing; one of this user's
    that others can read is tightened to 0700). OSError saying why when it cannot be used: not
    creatable, not a directory, a symbolic link, owned by another user, or writable by group or
    others; then nothing in it, and nothing it points to, has been changed."""
    d = cache_dir()
    fd = _open_dir(d)
    try:
        st = os.fstat(fd)
        if st.st_uid != _user():
            raise PermissionError(f"{d} is owned by uid {st.st_uid}, not by this user (uid {_user()})")
        if st.st_mode & 0o022:
            raise PermissionError(f"{d} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})")
        if st.st_mode & 0o077:
            os.fchmod(fd, 0o700)
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def _cache_dir_fd() -> Iterator[int | None]:
    """The cache directory's descriptor for the block, or None (one warning) when it is unusable."""
    try:
        fd = _open_cache_dir()
    except OSError as e:
        _warn_once(f"lowgrad: not using the kernel cache {cache_dir()}: {e}; kernels are compiled in memory")
        yield None
        return
    try:
        yield fd
    finally:
        os.close(fd)


def _entry_problem(st: os.stat_result) -> str | None:
    """Why an opened entry must not be read, or None: only this user's regular files, writable by
    no one else, of at most :data:`MAX_ENTRY_BYTES`."""
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid != _user():
        return f"is owned by uid {st.st_uid}, not by this user"
    if st.st_mode & 0o022:
        return f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    if st.st_size > MAX_ENTRY_BYTES:
        return f"is larger than {MAX_ENTRY_BYTES >> 20} MiB"
    return None


def _read_entry(dfd: int, job: Job) -> bytes | None:
    """The cubin of ``job``'s entry in the directory ``dfd``; None when absent, refused (with a
    warning: symlink, FIFO, device, foreign owner, loose mode, too large) or not valid for the key.
    Never follows a link, never blocks on a FIFO, never reads more than the bound."""
    name = _entry_name(job)
    problem: str | None
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    except FileNotFoundError:
        return None
    except OSError as e:
        problem = "is a symbolic link" if e.errno == errno.ELOOP else f"cannot be opened ({e.strerror})"
    else:
        try:
            problem = _entry_problem(os.fstat(fd))
            chunks: list[bytes] = []
            left = MAX_ENTRY_BYTES + 1  # one byte more tells a file that grew past the bound
            while problem is None and left and (chunk := os.read(fd, min(left, 1 << 20))):
                chunks.append(chunk)
                left -= len(chunk)
        finally:
            os.close(fd)
        if problem is None and not left:
            problem = f"is larger than {MAX_ENTRY_BYTES >> 20} MiB"
        if problem is None:
            return _decode(job, b"".join(chunks))
    _warn_once(f"lowgrad: ignoring the kernel cache entry {cache_dir() / name}: it {problem}; recompiling")
    return None


def _create_temp(dfd: int, stem: str) -> tuple[int, str]:
    """A new file ``<stem>.<random>.tmp`` (mode 0600, O_EXCL) in the directory ``dfd``: (fd, name)."""
    name = f"{stem}.{secrets.token_hex(8)}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.open(name, flags, 0o600, dir_fd=dfd), name


def _write_entry(dfd: int, job: Job, cubin: bytes) -> None:
    """Write ``job``'s entry atomically (a private temporary file renamed over whatever is there)."""
    name = _entry_name(job)
    fd, tmp = _create_temp(dfd, name)
    try:
        with open(fd, "wb") as f:
            f.write(_encode(job, cubin))
        os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dfd)
        raise


def _remember(job: Job, cubin: bytes) -> bytes:
    """Keep ``cubin`` in the process; the one kept first wins, so racing compiles return the same bytes."""
    with _memo_lock:
        return _memo.setdefault((str(cache_dir()), job.key), cubin)


def _build(job: Job, dfd: int | None, compile_job: Callable[[Job], bytes]) -> bytes:
    """Compile ``job`` (no lock held) and store it on disk when ``dfd`` is a usable cache directory."""
    cubin = compile_job(job)
    if dfd is not None:
        try:
            _write_entry(dfd, job, cubin)
        except OSError as e:
            _warn_once(f"lowgrad: cannot write to the kernel cache {cache_dir()} ({e.strerror}); "
                       "kernels are compiled in memory")
    return _remember(job, cubin)


def cubins(jobs: Sequence[Job], compile_job: Callable[[Job], bytes]) -> list[bytes]:
    """The cubin of each job: from this process, else from the disk cache, else from
    ``compile_job`` (the misses compile in parallel threads, each stored on disk)."""
    with _memo_lock:
        out = [_memo.get((str(cache_dir()), job.key)) for job in jobs]
    misses = [i for i, c in enumerate(out) if c is None]
    if not misses:
        return out  # type: ignore[return-value]
    with _cache_dir_fd() as dfd:
        if dfd is not None:
            for i in misses:
                cubin = _read_entry(dfd, jobs[i])
                out[i] = None if cubin is None else _remember(jobs[i], cubin)
        misses = [i for i, c in enumerate(out) if c is None]
        if misses:
            with ThreadPoolExecutor(max_workers=min(len(misses), os.cpu_count() or 1)) as pool:
                for i, cubin in zip(misses, pool.map(functools.partial(_build, dfd=dfd, compile_job=compile_job),
                                                          [jobs[i] for i in misses])):
                    out[i] = cubin
    return out  # type: ignore[return-value]


def check_cache() -> str:
    """Vet the cache directory as a compile would (created 0700 if missing), prove it writable with
    a probe file, and describe it; OSError saying why it cannot be used."""
    d = cache_dir()
    with contextlib.ExitStack() as stack:
        dfd = _open_cache_dir()
        stack.callback(os.close, dfd)
        fd, probe = _create_temp(dfd, ".probe")
        os.close(fd)
        os.unlink(probe, dir_fd=dfd)
        with os.scandir(dfd) as it:
            sizes = [e.stat(follow_symlinks=False).st_size for e in it
                     if e.name.endswith(".cubin") and e.is_file(follow_symlinks=False)]
    return f"{d}: private, writable, {len(sizes)} cubins, {sum(sizes) / 2**20:.1f} MiB"
