"""NVRTC compilation (no GPU needed): every kernel module builds, the disk cache hits and honours
LOWGRAD_CACHE_DIR (what it refuses: test_cache.py), compile errors carry NVRTC's log, and the kernel table
matches the compiled entry points."""
from __future__ import annotations

import ctypes
import re
import time
from pathlib import Path

import pytest
from helpers import counting_compile, needs_nvrtc

import lowgrad
from lowgrad.base.errors import NvrtcError
from lowgrad.cuda import compiler


@needs_nvrtc
def test_nvrtc_version() -> None:
    major, minor = compiler.nvrtc_version()
    assert isinstance(major, int) and isinstance(minor, int) and major >= 12


@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_75", "sm_80", "sm_90"])  # Turing (no bf16 units: the kernels need none) onward
def test_every_module_compiles_and_holds_its_symbols(cache: Path, arch: str) -> None:
    cubins = lowgrad.compile_kernels(arch)
    assert list(cubins) == list(compiler.modules())
    for module, cubin in cubins.items():
        assert cubin[:4] == b"\x7fELF", module
    for spec in compiler.kernel_specs().values():
        assert spec.symbol.encode() + b"\0" in cubins[spec.module], spec.symbol
    assert len(list(cache.glob("*.cubin"))) == len(compiler.modules())


@needs_nvrtc
def test_second_call_hits_the_disk_cache(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = compiler.compile_kernels("sm_90")
    compiler.clear_memory_cache()
    calls = counting_compile(monkeypatch)
    t = time.perf_counter()
    again = compiler.compile_kernels("sm_90")
    assert time.perf_counter() - t < 0.5
    assert calls == [] and again == first
    assert compiler.compile_kernels("sm_90") == first and calls == []  # and the in-process cache


@needs_nvrtc
def test_cache_key_covers_source_options_and_arch(cache: Path) -> None:
    src = 'extern "C" __global__ void k(float* p) { p[threadIdx.x] = 1.0f; }'
    compiler.compile_cuda(src, "k.cu", "sm_90")
    compiler.compile_cuda(src, "k.cu", "sm_90")
    compiler.compile_cuda(src, "k.cu", "sm_80")
    compiler.compile_cuda(src.replace("1.0f", "2.0f"), "k.cu", "sm_90")
    compiler.compile_cuda(src, "k.cu", "sm_90", extra_options=["-lineinfo"])
    assert len(list(cache.glob("k-*.cubin"))) == 4


@needs_nvrtc
def test_header_changes_the_key(cache: Path) -> None:
    src = '#include "h.cuh"\nextern "C" __global__ void k(float* p) { p[0] = V; }'
    a = compiler.compile_cuda(src, "h.cu", "sm_90", headers={"h.cuh": "#define V 1.0f\n"})
    b = compiler.compile_cuda(src, "h.cu", "sm_90", headers={"h.cuh": "#define V 2.0f\n"})
    assert a != b and len(list(cache.glob("h-*.cubin"))) == 2


@needs_nvrtc
def test_compile_error_raises_with_the_log(cache: Path) -> None:
    src = 'extern "C" __global__ void broken(float* p) { p[0] = ; }'
    with pytest.raises(NvrtcError) as info:
        compiler.compile_cuda(src, "broken.cu", "sm_90")
    err = info.value
    assert err.name == "NVRTC_ERROR_COMPILATION" and "nvrtcCompileProgram(broken.cu)" in str(err)
    assert "broken.cu" in err.log and "error" in err.log and err.log in str(err)
    assert not list(cache.glob("broken-*"))


def test_cache_dir_default_and_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOWGRAD_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert compiler.cache_dir() == tmp_path / ".cache" / "lowgrad"
    monkeypatch.setenv("LOWGRAD_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert compiler.cache_dir() == tmp_path / "elsewhere"


def test_bad_arch_and_module() -> None:
    for arch in ("90", "sm90", "compute_90", "sm_9", None):
        with pytest.raises(ValueError):
            compiler.compile_kernels(arch)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        compiler.compile_source("nope", "sm_90")


def test_sources_use_no_toolkit_headers() -> None:
    d = compiler.kernel_dir()
    files = sorted(d.glob("*.cu")) + sorted(d.glob("*.cuh"))
    assert {f.stem for f in d.glob("*.cu")} == set(compiler.modules())
    for f in files:
        assert not re.search(r"#\s*include\s*<", f.read_text()), f.name


# PTX spells 32-bit int parameters .u32 or .s32 alike: compare kind and width
_PTX_KIND = {".u64": "int64", ".s64": "int64", ".u32": "int32", ".s32": "int32", ".f32": "float32"}
_CTYPES_KIND = {ctypes.c_uint64: "int64", ctypes.c_uint32: "int32", ctypes.c_int32: "int32",
                ctypes.c_float: "float32"}


def struct_size(fields: tuple) -> int:
    """sizeof of a C struct of these scalar fields (natural alignment, padded to the largest)."""
    import ctypes

    off = 0
    for t in fields:
        off += (-off) % ctypes.sizeof(t) + ctypes.sizeof(t)
    align = max(ctypes.sizeof(t) for t in fields)
    return off + (-off) % align


@needs_nvrtc
def test_kernels_table_matches_the_entry_points() -> None:
    d = compiler.kernel_dir()
    opts = ["--gpu-architecture=compute_90", *(o for o in compiler.BASE_OPTIONS if not o.startswith("--ptxas"))]
    seen = set()
    for module in compiler.modules():
        src = (d / f"{module}.cu").read_bytes()
        ptx, _ = compiler._compile(src, f"{module}.cu", compiler._headers(src, d), opts, ptx=True)
        entries = re.findall(r"\.entry\s+(\w+)\s*\(([^)]*)\)", ptx.decode(errors="replace"))
        assert entries, module
        for symbol, params in entries:
            spec = compiler.kernel_specs()[symbol]
            assert spec.module == module
            if spec.struct:  # one by-value struct: `.param .align 8 .b8 name[size]`
                (size,) = re.findall(r"\.param\s+\.align\s+8\s+\.b8\s+\w+\[(\d+)\]", params)
                assert int(size) == struct_size(spec.args), symbol
            else:
                kinds = tuple(_PTX_KIND[t] for t in re.findall(r"\.param\s+(\.\w+)", params))
                assert kinds == tuple(_CTYPES_KIND[t] for t in spec.args), symbol
            seen.add(symbol)
    assert seen == set(compiler.kernel_specs())
