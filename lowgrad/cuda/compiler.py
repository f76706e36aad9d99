"""NVRTC compilation of lowgrad's kernels (``kernels/*.cu``) to cubins, and the table of their
entry points.

No GPU is needed: :func:`compile_kernels` builds every kernel module (each ``.cu`` file of
:func:`kernel_dir`) for an architecture such as ``"sm_90"``, through the on-disk cache of
:mod:`lowgrad.cuda.cache`. :func:`kernel_specs` describes every ``extern "C"`` entry point as the
sources declare it (:mod:`lowgrad.cuda.abi`): module, symbol, parameters, block size.
"""
from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lowgrad.core.dtypes import as_dtype
from lowgrad.core.errors import NvrtcError
from lowgrad.cuda import cache
from lowgrad.cuda.abi import KernelSpec, read_kernels
from lowgrad.cuda.cache import cache_dir, check_cache, clear_memory_cache

__all__ = ["BASE_OPTIONS", "KernelSpec", "add_sr_multi_spec", "add_sr_spec", "cache_dir", "check_cache",
           "clear_memory_cache", "compile_cuda", "compile_kernels", "compile_source", "constants", "kernel",
           "kernel_dir", "kernel_specs", "modules", "norm_squared_specs", "nvrtc_identity", "nvrtc_version",
           "options", "reduce_sr_spec"]

BASE_OPTIONS: tuple[str, ...] = ("-default-device", "--std=c++17", "--dopt=on", "--ptxas-options=-O3",
                                 "--ftz=false")
_ARCH = re.compile(r"sm_\d{2,3}[af]?")
_INCLUDE = re.compile(rb'^\s*#\s*include\s+"([^"]+)"', re.M)
_TAG = {"fp32": "f32", "bf16": "bf16", "fp64": "f64"}  # dtype -> the suffix in kernel symbols


# ---- locations and the kernel table ----------------------------------------------------------------
@functools.cache
def kernel_dir() -> Path:
    """The kernel sources: ``lowgrad/kernels`` in an installed wheel, ``<repo>/kernels`` in a checkout
    (looked up once per process: every kernel lookup goes through here)."""
    package = Path(__file__).resolve().parents[1]  # lowgrad/
    candidates = (package / "kernels", package.parent / "kernels")
    for d in candidates:
        if (d / "add_sr.cu").is_file():
            return d
    raise FileNotFoundError(f"lowgrad kernel sources not found in {' or '.join(map(str, candidates))}")

@functools.cache
def modules() -> tuple[str, ...]:
    """The kernel modules: the stem of every ``.cu`` file in :func:`kernel_dir`, sorted."""
    return tuple(sorted(p.stem for p in kernel_dir().glob("*.cu")))


def kernel_specs() -> dict[str, KernelSpec]:
    """Every kernel entry point by symbol, read from the sources (:mod:`lowgrad.cuda.abi`)."""
    return read_kernels(kernel_dir(), modules())[0]


def constants(module: str) -> dict[str, int]:
    """The integer enum constants of ``kernels/<module>.cu`` and the headers it includes."""
    return read_kernels(kernel_dir(), modules())[1][module]


def kernel(symbol: str) -> KernelSpec:
    """The entry point ``symbol``; ValueError when no source defines it."""
    spec = kernel_specs().get(symbol)
    if spec is None:
        raise ValueError(f"no kernel {symbol!r} in {kernel_dir()}")
    return spec


def _typed(what: str, stem: str, *dtypes: Any) -> KernelSpec:
    """The kernel ``stem`` + ``_<tag>`` per dtype; TypeError when the sources have none for them."""
    ds = [as_dtype(d) for d in dtypes]
    spec = kernel_specs().get("_".join([stem, *(_TAG.get(d.name, d.name) for d in ds)]))
    if spec is None:
        raise TypeError(f"{what}: no kernel for dtypes ({', '.join(d.name for d in ds)})")
    return spec


def add_sr_spec(dst_dtype: Any, a_dtype: Any, b_dtype: Any) -> KernelSpec:
    """The ``add_sr`` kernel for these dtypes (fp32 or bf16 each)."""
    return _typed("add_sr", "add_sr", dst_dtype, a_dtype, b_dtype)


def add_sr_multi_spec(dst_dtype: Any, b_dtype: Any) -> KernelSpec:
    """The multi-tensor ``add_sr`` (``dst`` and ``a`` of one dtype, ``b`` fp32 or bf16)."""
    return _typed("add_sr_multi", "add_sr_multi", dst_dtype, dst_dtype, b_dtype)


def reduce_sr_spec(dst_dtype: Any, src_dtype: Any) -> KernelSpec:
    """The ``reduce_sr`` kernel for these dtypes (fp32 or bf16 each)."""
    return _typed("reduce_sr", "reduce_sr", dst_dtype, src_dtype)


def norm_squared_specs(x_dtype: Any, acc_dtype: Any) -> tuple[KernelSpec, KernelSpec]:
    """Stage 1 and stage 2 of ``norm_squared`` for ``x`` (fp32/bf16) accumulated in fp32 or fp64."""
    return (_typed("norm_squared", "norm_squared", x_dtype, acc_dtype),
            _typed("norm_squared accumulator", "norm_squared_finish", acc_dtype))


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


@functools.cache
def nvrtc_version() -> tuple[int, int]:
    """NVRTC's (major, minor); NvrtcError if the library cannot be loaded."""
    nvrtc = _nvrtc()
    try:
        result = nvrtc.nvrtcVersion()
    except Exception as e:  # the binding raises when libnvrtc cannot be found or loaded
        raise NvrtcError("nvrtcVersion", "NVRTC_UNAVAILABLE", str(e)) from e
    major, minor = _check("nvrtcVersion", result)
    return int(major), int(minor)


@functools.cache
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
        libs = sorted(root.glob(f"*/lib/libnvrtc.so.{major}*")) + sorted(root.glob(f"*/*/lib/libnvrtc.so.{major}*"))
        for lib in libs:
            if "builtins" not in lib.name and ".alt." not in lib.name:
                st = lib.resolve().stat()
                return f"{lib.resolve()} {st.st_size} {st.st_mtime_ns}"
    major, minor = nvrtc_version()
    return f"nvrtc {major}.{minor}"


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

def _job(source: str | bytes, name: str, arch: str, headers: Mapping[str, str | bytes] | None,
         extra_options: Sequence[str]) -> cache.Job:
    return cache.make_job(_as_bytes(source), name, arch, {k: _as_bytes(v) for k, v in (headers or {}).items()},
                          (*options(arch), *extra_options), nvrtc_identity())


def _nvrtc_cubin(job: cache.Job) -> bytes:
    """A cache miss: NVRTC compiles ``job``."""
    return _compile(job.source, job.name, job.headers, job.options)[0]


def compile_cuda(source: str | bytes, name: str, arch: str, headers: Mapping[str, str | bytes] | None = None,
                 extra_options: Sequence[str] = ()) -> bytes:
    """The cubin of CUDA ``source`` (program ``name``, ``headers`` by include name) for ``arch``,
    from the cache when present; NvrtcError with NVRTC's log on a compile error."""
    return cache.cubins([_job(source, name, arch, headers, extra_options)], _nvrtc_cubin)[0]


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


def _source_job(module: str, arch: str) -> cache.Job:
    if module not in modules():
        raise ValueError(f"unknown kernel module {module!r}; expected one of {', '.join(modules())}")
    d = kernel_dir()
    src = (d / f"{module}.cu").read_bytes()
    return _job(src, f"{module}.cu", arch, _headers(src, d), ())


def compile_source(module: str, arch: str) -> bytes:
    """The cubin of kernel module ``module`` (``kernels/<module>.cu``) for ``arch``, cached."""
    return cache.cubins([_source_job(module, arch)], _nvrtc_cubin)[0]


def compile_kernels(arch: str) -> dict[str, bytes]:
    """Every kernel module for ``arch`` (e.g. "sm_90") as ``{module: cubin}``; no GPU needed.
    Cache misses compile in parallel threads."""
    return dict(zip(modules(), cache.cubins([_source_job(m, arch) for m in modules()], _nvrtc_cubin)))
