"""NVRTC compilation of lowgrad's kernels (``kernels/*.cu``) to cubins, with an on-disk cache.

No GPU is needed: :func:`compile_kernels` builds every kernel module for an architecture such as
``"sm_90"``. Cache entries live in ``$LOWGRAD_CACHE_DIR`` (default ``~/.cache/lowgrad``), a
directory private to the user (0700), named by the sha256 of their key (source and header hashes,
options, architecture, NVRTC identity). An entry is read only when it is a regular file of this
user, writable by no one else and at most :data:`MAX_ENTRY_BYTES`; its header must repeat the whole
key and its checksum must match, else the kernel is recompiled and the entry replaced atomically.
An unusable cache directory means compiling in memory, with one warning. :data:`KERNELS`
describes every ``extern "C"`` entry point (module, symbol, ctypes argument types) for the launcher.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import hashlib
import json
import os
import re
import secrets
import stat
import threading
import warnings
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lowgrad.core.dtypes import DType, as_dtype, bf16, fp32, fp64
from lowgrad.core.errors import NvrtcError

MODULES: tuple[str, ...] = ("add_sr", "reduce_sr", "fill_zero", "norm_squared", "philox_kat", "seed_counter")
BASE_OPTIONS: tuple[str, ...] = ("-default-device", "--std=c++17", "--dopt=on", "--ptxas-options=-O3",
                                 "--ftz=false")
_MAGIC = b"LGCUBIN2"  # cache entry format (see _encode); entries of another format are recompiled
MAX_ENTRY_BYTES = 64 << 20  # a cache entry larger than this is refused unread (cubins are < 1 MiB)
_ARCH = re.compile(r"sm_\d{2,3}[af]?")
_INCLUDE = re.compile(rb'^\s*#\s*include\s+"([^"]+)"', re.M)

_memo: dict[tuple[str, str], bytes] = {}  # (cache dir, key) -> cubin
_warned: set[str] = set()  # cache warnings already given
# Guards _memo and _warned only: held for one dict/set operation, never while compiling, doing file
# I/O or warning, and taken by no finalizer. Two threads missing the same kernel both compile it
# (harmless: identical work, atomic file replace); the first result kept is what both return.
_memo_lock = threading.Lock()


# ---- kernel specs ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class KernelSpec:
    """One ``extern "C"`` kernel: the module (key of :func:`compile_kernels`) holding ``symbol``,
    its parameters as ctypes types (pointers are ``c_uint64`` device addresses), and the block
    size it is built for (``__launch_bounds__``; norm kernels need a power of two up to it).
    ``struct``: the kernel takes a single struct by value whose fields, in order, are ``args``."""

    module: str
    symbol: str
    args: tuple[Any, ...]
    block: int = 256
    struct: bool = False  # one by-value struct parameter whose fields are ``args`` (C layout)


_u64, _u32, _i32, _f32 = ctypes.c_uint64, ctypes.c_uint32, ctypes.c_int32, ctypes.c_float
ADD_SR_ARGS = (_u64, _u64, _u64, _f32, _u64, _u64, _u64)  # dst, a, b, scale, seed, index_offset, n
REDUCE_SR_ARGS = (_u64, _u64, _u32, _i32, _f32, _i32, _u64, _u64, _u64, _u64, _u32, _u32)  # dst, src, n_shards,
#                        skip, scale, accumulate, seed, index_offset, n, counter (0: none), layer, lane
FILL_ZERO_ARGS = (_u64, _u64)  # dst, nbytes
NORM_ARGS = (_u64, _u64, _u64)  # x, n, partials
NORM_FINISH_ARGS = (_u64, _u32, _u64, _i32)  # partials, n_partials, out, accumulate
PHILOX_KAT_ARGS = (_u64, _u64, _u64, _u64)  # ctr (n x 4 u32), key (n x 2 u32), out (n x 4 u32), n
MULTI_MAX = 16  # tensors per multi-tensor launch (kernels/add_sr.cu)
MULTI_CHUNK = 4096  # elements per chunk of the multi-tensor kernel: CHUNK_THREADS * ADD_UNROLL * 8
# struct MultiAddSr: dst, a, b, seed, offset, n (MULTI_MAX each), first[MULTI_MAX + 1], count, scale, counter, layer
ADD_SR_MULTI_ARGS = (_u64,) * (6 * MULTI_MAX) + (_u32,) * (MULTI_MAX + 1) + (_u32, _f32, _u64, _u32)
SEED_COUNTER_ARGS = (_u64, _u32, _u64, _u32)  # counter, op, base, step
_TAG = {"fp32": "f32", "bf16": "bf16", "fp64": "f64"}


def _tag(dtype: Any, allowed: tuple[DType, ...], what: str) -> str:
    d = as_dtype(dtype)
    if d not in allowed:
        raise TypeError(f"{what}: no kernel for dtype {d.name} (expected {', '.join(a.name for a in allowed)})")
    return _TAG[d.name]


def _all_specs() -> dict[str, KernelSpec]:
    sr = ("f32", "bf16")
    specs = [KernelSpec("add_sr", f"add_sr_{d}_{a}_{b}", ADD_SR_ARGS) for d in sr for a in sr for b in sr]
    specs += [KernelSpec("add_sr", f"add_sr_multi_{d}_{d}_{b}", ADD_SR_MULTI_ARGS, struct=True) for d in sr for b in sr]
    specs += [KernelSpec("reduce_sr", f"reduce_sr_{d}_{s}", REDUCE_SR_ARGS) for d in sr for s in sr]
    specs += [KernelSpec("fill_zero", "fill_zero_u8", FILL_ZERO_ARGS),
              KernelSpec("philox_kat", "philox_kat", PHILOX_KAT_ARGS),
              KernelSpec("seed_counter", "seed_counter", SEED_COUNTER_ARGS)]
    specs += [KernelSpec("norm_squared", f"norm_squared_{t}_{acc}", NORM_ARGS) for t in sr for acc in ("f32", "f64")]
    specs += [KernelSpec("norm_squared", f"norm_squared_finish_{acc}", NORM_FINISH_ARGS) for acc in ("f32", "f64")]
    return {s.symbol: s for s in specs}


KERNELS: dict[str, KernelSpec] = _all_specs()
FILL_ZERO: KernelSpec = KERNELS["fill_zero_u8"]
PHILOX_KAT: KernelSpec = KERNELS["philox_kat"]
SEED_COUNTER: KernelSpec = KERNELS["seed_counter"]


def add_sr_spec(dst_dtype: Any, a_dtype: Any, b_dtype: Any) -> KernelSpec:
    """The ``add_sr`` kernel for these dtypes (fp32 or bf16 each)."""
    tags = [_tag(d, (fp32, bf16), f"add_sr {w}") for d, w in ((dst_dtype, "dst"), (a_dtype, "a"), (b_dtype, "b"))]
    return KERNELS["add_sr_" + "_".join(tags)]


def add_sr_multi_spec(dst_dtype: Any, b_dtype: Any) -> KernelSpec:
    """The multi-tensor ``add_sr`` (``dst`` and ``a`` of one dtype, ``b`` fp32 or bf16)."""
    d = _tag(dst_dtype, (fp32, bf16), "add_sr_multi dst")
    return KERNELS[f"add_sr_multi_{d}_{d}_{_tag(b_dtype, (fp32, bf16), 'add_sr_multi b')}"]


def reduce_sr_spec(dst_dtype: Any, src_dtype: Any) -> KernelSpec:
    """The ``reduce_sr`` kernel for these dtypes (fp32 or bf16 each)."""
    return KERNELS[f"reduce_sr_{_tag(dst_dtype, (fp32, bf16), 'reduce_sr dst')}_"
                   f"{_tag(src_dtype, (fp32, bf16), 'reduce_sr src')}"]


def norm_squared_specs(x_dtype: Any, acc_dtype: Any) -> tuple[KernelSpec, KernelSpec]:
    """Stage 1 and stage 2 of ``norm_squared`` for ``x`` (fp32/bf16) accumulated in fp32 or fp64."""
    acc = _tag(acc_dtype, (fp32, fp64), "norm_squared accumulator")
    return KERNELS[f"norm_squared_{_tag(x_dtype, (fp32, bf16), 'norm_squared x')}_{acc}"], \
        KERNELS[f"norm_squared_finish_{acc}"]


# ---- locations ---------------------------------------------------------------------------------------
def kernel_dir() -> Path:
    """The kernel sources: ``lowgrad/kernels`` in an installed wheel, ``<repo>/kernels`` in a checkout."""
    package = Path(__file__).resolve().parents[1]  # lowgrad/
    candidates = (package / "kernels", package.parent / "kernels")
    for d in candidates:
        if (d / "add_sr.cu").is_file():
            return d
    raise FileNotFoundError(f"lowgrad kernel sources not found in {' or '.join(map(str, candidates))}")


def cache_dir() -> Path:
    """``$LOWGRAD_CACHE_DIR`` if set, else ``~/.cache/lowgrad``."""
    return Path(os.environ.get("LOWGRAD_CACHE_DIR") or "~/.cache/lowgrad").expanduser()


def clear_memory_cache() -> None:
    """Forget the cubins held in this process and the cache warnings given (the disk cache stays)."""
    with _memo_lock:
        _memo.clear()
        _warned.clear()


# ---- NVRTC -------------------------------------------------------------------------------------------
def _nvrtc() -> Any:
    try:
        from cuda.bindings import nvrtc
    except ImportError as e:
        raise NvrtcError("import cuda.bindings.nvrtc", "NVRTC_UNAVAILABLE", str(e)) from e
    return nvrtc


def _check(call: str, result: Any, log: str = "") -> Any:
    """The values after the status of a cuda.bindings NVRTC call; NvrtcError on failure."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err):
        nvrtc = _nvrtc()
        _, msg = nvrtc.nvrtcGetErrorString(err)
        raise NvrtcError(call, getattr(err, "name", str(int(err))), msg.decode(errors="replace"), log)
    return values[0] if len(values) == 1 else tuple(values)


@functools.lru_cache(maxsize=None)
def nvrtc_version() -> tuple[int, int]:
    """NVRTC's (major, minor); NvrtcError if the library cannot be loaded."""
    nvrtc = _nvrtc()
    try:
        result = nvrtc.nvrtcVersion()
    except Exception as e:  # the binding raises when libnvrtc cannot be found or loaded
        raise NvrtcError("nvrtcVersion", "NVRTC_UNAVAILABLE", str(e)) from e
    major, minor = _check("nvrtcVersion", result)
    return int(major), int(minor)


@functools.lru_cache(maxsize=None)
def nvrtc_identity() -> str:
    """What the cache key records of NVRTC, found without loading it (a warm start must not pay
    NVRTC's load): the NVRTC library of the wheel that cuda.bindings loads first (its path, size
    and modification time), else the version NVRTC reports."""
    try:
        import cuda.bindings
        import nvidia  # namespace package of the NVIDIA wheels
        major = cuda.bindings.__version__.split(".")[0]
        roots = [Path(p) for p in nvidia.__path__]
    except (ImportError, AttributeError):
        roots, major = [], ""
    for root in roots:
        for lib in sorted(root.glob(f"*/lib/libnvrtc.so.{major}*")) + sorted(root.glob(f"*/*/lib/libnvrtc.so.{major}*")):
            if "builtins" not in lib.name and ".alt." not in lib.name:
                st = lib.resolve().stat()
                return f"{lib.resolve()} {st.st_size} {st.st_mtime_ns}"
    return "nvrtc %d.%d" % nvrtc_version()


def options(arch: str) -> list[str]:
    """The NVRTC options used for a cubin for ``arch`` ("sm_80", "sm_90", "sm_90a", ...)."""
    if not isinstance(arch, str) or not _ARCH.fullmatch(arch):
        raise ValueError(f"arch must look like 'sm_90', got {arch!r}")
    return [f"--gpu-architecture={arch}", *BASE_OPTIONS]


def _as_bytes(text: str | bytes) -> bytes:
    return text.encode() if isinstance(text, str) else bytes(text)


def _compile(source: bytes, name: str, headers: Mapping[str, bytes], opts: Sequence[str],
             ptx: bool = False) -> tuple[bytes, str]:
    """Run NVRTC once; returns (cubin, or PTX when ``ptx``; the program log)."""
    nvrtc = _nvrtc()
    nvrtc_version()  # a clear error when the library is missing
    call = f"nvrtcCreateProgram({name})"
    prog = _check(call, nvrtc.nvrtcCreateProgram(source, name.encode(), len(headers), list(headers.values()),
                                                  [h.encode() for h in headers]))
    try:
        status = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        size = _check("nvrtcGetProgramLogSize", nvrtc.nvrtcGetProgramLogSize(prog))
        buf = bytes(size)  # a fresh buffer: b" " * 1 is a shared interned object
        _check("nvrtcGetProgramLog", nvrtc.nvrtcGetProgramLog(prog, buf))
        log = buf.rstrip(b"\0").decode(errors="replace")
        _check(f"nvrtcCompileProgram({name})", status, log)
        kind = "PTX" if ptx else "CUBIN"
        out = bytes(_check(f"nvrtcGet{kind}Size", getattr(nvrtc, f"nvrtcGet{kind}Size")(prog)))
        _check(f"nvrtcGet{kind}", getattr(nvrtc, f"nvrtcGet{kind}")(prog, out))
        return out, log
    finally:
        _check("nvrtcDestroyProgram", nvrtc.nvrtcDestroyProgram(prog))


# ---- cache -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Job:
    name: str
    source: bytes
    headers: dict[str, bytes]
    options: tuple[str, ...]
    header: bytes  # the entry header: the full key as canonical JSON
    key: str  # sha256 of ``header``, in the file name


def _job(source: str | bytes, name: str, arch: str, headers: Mapping[str, str | bytes] | None,
         extra_options: Sequence[str]) -> _Job:
    src = _as_bytes(source)
    hdrs = {k: _as_bytes(v) for k, v in sorted((headers or {}).items())}
    opts = (*options(arch), *extra_options)
    key = {"format": _MAGIC.decode(), "name": name, "arch": arch, "source": hashlib.sha256(src).hexdigest(),
           "headers": {k: hashlib.sha256(v).hexdigest() for k, v in hdrs.items()}, "options": opts,
           "nvrtc": nvrtc_identity()}
    header = json.dumps(key, sort_keys=True, separators=(",", ":")).encode()
    return _Job(name, src, hdrs, opts, header, hashlib.sha256(header).hexdigest())


def _entry_name(job: _Job) -> str:
    return f"{Path(job.name).stem}-{job.key}.cubin"


def _encode(job: _Job, cubin: bytes) -> bytes:
    """An entry: magic, header length (u32 LE), header, sha256(header + cubin), cubin."""
    return b"".join((_MAGIC, len(job.header).to_bytes(4, "little"), job.header,
                     hashlib.sha256(job.header + cubin).digest(), cubin))


def _decode(job: _Job, data: bytes) -> bytes | None:
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


def _open_cache_dir() -> int:
    """An open descriptor of the cache directory (created 0700 when missing; one of this user's
    that others can read is tightened to 0700). OSError saying why when it cannot be used: not
    creatable, not a directory, owned by another user, or writable by group or others."""
    d = cache_dir()
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise PermissionError(f"{d} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})")
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
    if st.st_uid != os.geteuid():
        return f"is owned by uid {st.st_uid}, not by this user"
    if st.st_mode & 0o022:
        return f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    if st.st_size > MAX_ENTRY_BYTES:
        return f"is larger than {MAX_ENTRY_BYTES >> 20} MiB"
    return None


def _read_entry(dfd: int, job: _Job) -> bytes | None:
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


def _write_entry(dfd: int, job: _Job, cubin: bytes) -> None:
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


def _remember(job: _Job, cubin: bytes) -> bytes:
    """Keep ``cubin`` in the process; the one kept first wins, so racing compiles return the same bytes."""
    with _memo_lock:
        return _memo.setdefault((str(cache_dir()), job.key), cubin)


def _build(job: _Job, dfd: int | None) -> bytes:
    """Compile ``job`` (no lock held) and store it on disk when ``dfd`` is a usable cache directory."""
    cubin, _ = _compile(job.source, job.name, job.headers, job.options)
    if dfd is not None:
        try:
            _write_entry(dfd, job, cubin)
        except OSError as e:
            _warn_once(f"lowgrad: cannot write to the kernel cache {cache_dir()} ({e.strerror}); "
                       "kernels are compiled in memory")
    return _remember(job, cubin)


def _cubins(jobs: Sequence[_Job]) -> list[bytes]:
    """The cubin of each job: from this process, else from the disk cache, else from NVRTC (the
    misses compile in parallel threads)."""
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
                for i, cubin in zip(misses, pool.map(functools.partial(_build, dfd=dfd), [jobs[i] for i in misses])):
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


def compile_cuda(source: str | bytes, name: str, arch: str, headers: Mapping[str, str | bytes] | None = None,
                 extra_options: Sequence[str] = ()) -> bytes:
    """The cubin of CUDA ``source`` (program ``name``, ``headers`` by include name) for ``arch``,
    from the cache when present; NvrtcError with NVRTC's log on a compile error."""
    return _cubins([_job(source, name, arch, headers, extra_options)])[0]


def _headers(src: bytes, directory: Path) -> dict[str, bytes]:
    """Every ``#include "..."`` reached from ``src``, read from ``directory``."""
    found: dict[str, bytes] = {}
    todo = [m.decode() for m in _INCLUDE.findall(src)]
    while todo:
        h = todo.pop()
        if h not in found:
            found[h] = (directory / h).read_bytes()
            todo += [m.decode() for m in _INCLUDE.findall(found[h])]
    return found


def _source_job(module: str, arch: str) -> _Job:
    if module not in MODULES:
        raise ValueError(f"unknown kernel module {module!r}; expected one of {', '.join(MODULES)}")
    d = kernel_dir()
    src = (d / f"{module}.cu").read_bytes()
    return _job(src, f"{module}.cu", arch, _headers(src, d), ())


def compile_source(module: str, arch: str) -> bytes:
    """The cubin of kernel module ``module`` (``kernels/<module>.cu``) for ``arch``, cached."""
    return _cubins([_source_job(module, arch)])[0]


def compile_kernels(arch: str) -> dict[str, bytes]:
    """Every kernel module for ``arch`` (e.g. "sm_90") as ``{module: cubin}``; no GPU needed.
    Cache misses compile in parallel threads."""
    return dict(zip(MODULES, _cubins([_source_job(m, arch) for m in MODULES])))
