"""NVRTC compilation of lowgrad's kernels (``kernels/*.cu``) to cubins, with an on-disk cache.

No GPU is needed: :func:`compile_kernels` builds every kernel module for an architecture such as
``"sm_90"``. Cache entries live in ``$LOWGRAD_CACHE_DIR`` (default ``~/.cache/lowgrad``), keyed by
the sha256 of the source, its headers, the options, the architecture and the NVRTC version; each
carries a checksum, so a corrupt or truncated entry is recompiled. :data:`KERNELS` describes every
``extern "C"`` entry point (module, symbol, ctypes argument types) for the launcher.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import tempfile
import threading
import warnings
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .dtypes import DType, as_dtype, bf16, fp32, fp64
from .errors import NvrtcError

MODULES: tuple[str, ...] = ("add_sr", "reduce_sr", "fill_zero", "norm_squared", "philox_kat", "seed_counter")
BASE_OPTIONS: tuple[str, ...] = ("-default-device", "--std=c++17", "--dopt=on", "--ptxas-options=-O3",
                                 "--ftz=false")
_MAGIC = b"LGCUBIN1"  # cache file: magic, sha256 of the payload, payload
_ARCH = re.compile(r"sm_\d{2,3}[af]?")
_INCLUDE = re.compile(rb'^\s*#\s*include\s+"([^"]+)"', re.M)

_memo: dict[tuple[str, str], bytes] = {}  # (cache dir, key) -> cubin
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
    here = Path(__file__).resolve().parent
    candidates = (here / "kernels", here.parent / "kernels")
    for d in candidates:
        if (d / "add_sr.cu").is_file():
            return d
    raise FileNotFoundError(f"lowgrad kernel sources not found in {' or '.join(map(str, candidates))}")


def cache_dir() -> Path:
    """``$LOWGRAD_CACHE_DIR`` if set, else ``~/.cache/lowgrad``."""
    return Path(os.environ.get("LOWGRAD_CACHE_DIR") or "~/.cache/lowgrad").expanduser()


def clear_memory_cache() -> None:
    """Forget the cubins held in this process (the disk cache stays)."""
    with _memo_lock:
        _memo.clear()


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
    key: str


def _job(source: str | bytes, name: str, arch: str, headers: Mapping[str, str | bytes] | None,
         extra_options: Sequence[str]) -> _Job:
    src = _as_bytes(source)
    hdrs = {k: _as_bytes(v) for k, v in sorted((headers or {}).items())}
    opts = (*options(arch), *extra_options)
    h = hashlib.sha256(_MAGIC)
    version = nvrtc_identity().encode()
    for part in (name.encode(), src, *(p for k, v in hdrs.items() for p in (k.encode(), v)), *map(str.encode, opts),
                 version):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return _Job(name, src, hdrs, opts, h.hexdigest())


def _cache_file(job: _Job) -> Path:
    return cache_dir() / f"{Path(job.name).stem}-{job.key}.cubin"


def _load(job: _Job) -> bytes | None:
    """The cached cubin from memory or disk; None when absent or corrupt."""
    mkey = (str(cache_dir()), job.key)
    with _memo_lock:
        hit = _memo.get(mkey)
    if hit is not None:
        return hit
    try:
        data = _cache_file(job).read_bytes()
    except OSError:
        return None
    head, digest, payload = data[:len(_MAGIC)], data[len(_MAGIC):len(_MAGIC) + 32], data[len(_MAGIC) + 32:]
    if head != _MAGIC or not payload or hashlib.sha256(payload).digest() != digest:
        return None
    with _memo_lock:
        _memo[mkey] = payload
    return payload


def _store(job: _Job, cubin: bytes) -> None:
    """Write the cache entry atomically (temporary file, then rename); warn if that fails."""
    path = _cache_file(job)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(_MAGIC + hashlib.sha256(cubin).digest() + cubin)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:
        warnings.warn(f"lowgrad: could not write the kernel cache entry {path}: {e}", RuntimeWarning, stacklevel=3)
    with _memo_lock:
        _memo[(str(cache_dir()), job.key)] = cubin


def _build(job: _Job) -> bytes:
    cubin, _ = _compile(job.source, job.name, job.headers, job.options)
    _store(job, cubin)
    return cubin


def compile_cuda(source: str | bytes, name: str, arch: str, headers: Mapping[str, str | bytes] | None = None,
                 extra_options: Sequence[str] = ()) -> bytes:
    """The cubin of CUDA ``source`` (program ``name``, ``headers`` by include name) for ``arch``,
    from the cache when present; NvrtcError with NVRTC's log on a compile error."""
    job = _job(source, name, arch, headers, extra_options)
    cubin = _load(job)
    return cubin if cubin is not None else _build(job)


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
    job = _source_job(module, arch)
    cubin = _load(job)
    return cubin if cubin is not None else _build(job)


def compile_kernels(arch: str) -> dict[str, bytes]:
    """Every kernel module for ``arch`` (e.g. "sm_90") as ``{module: cubin}``; no GPU needed.
    Cache misses compile in parallel threads."""
    jobs = {m: _source_job(m, arch) for m in MODULES}
    out: dict[str, bytes] = {}
    misses = []
    for m, job in jobs.items():
        cubin = _load(job)
        if cubin is None:
            misses.append(m)
        else:
            out[m] = cubin
    if misses:
        with ThreadPoolExecutor(max_workers=min(len(misses), os.cpu_count() or 1)) as pool:
            out.update(zip(misses, pool.map(_build, [jobs[m] for m in misses])))
    return {m: out[m] for m in MODULES}
