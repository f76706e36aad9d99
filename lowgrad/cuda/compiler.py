"""NVRTC compilation of lowgrad's kernels (``kernels/*.cu``) to cubins.

No GPU is needed: :func:`compile_kernels` builds every kernel module (each ``.cu`` file of
:func:`kernel_dir`) for an architecture such as ``"sm_90"``, through the on-disk cache of
:mod:`lowgrad.cuda.cache`. The sources' entry points and constants are read by
:mod:`lowgrad.contracts.kernel_source` (re-exported here for the CUDA layer's users).
"""
from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lowgrad.base.errors import NvrtcError
from lowgrad.contracts.kernel_source import KernelSpec, constants, kernel, kernel_dir, kernel_for, kernel_specs, modules
from lowgrad.cuda import cache
from lowgrad.cuda.cache import cache_dir, check_cache, clear_memory_cache

__all__ = ["BASE_OPTIONS", "KernelSpec", "cache_dir", "check_cache", "clear_memory_cache", "compile_cuda",
           "compile_kernels", "compile_source", "constants", "kernel", "kernel_dir", "kernel_for", "kernel_specs",
           "modules", "nvrtc_identity", "nvrtc_version", "options"]

BASE_OPTIONS: tuple[str, ...] = ("-default-device", "--std=c++17", "--dopt=on", "--ptxas-options=-O3",
                                 "--ftz=false")
_ARCH = re.compile(r"sm_\d{2,3}[af]?")
_INCLUDE = re.compile(rb'^\s*#\s*include\s+"([^"]+)"', re.M)


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
