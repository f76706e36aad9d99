"""The kernels' sources read as data (lowgrad/contracts/kernel_source.py), on the CPU: the table equals
the one Python used to spell out by hand, typed lookups name what they lack, structs and constants
are read as C lays them out, and the CUDA launcher (elementwise kernels built from their contract
declaration included) packs byte for byte what it packed before (a stand-in for cuLaunchKernel
records the argument buffers; no GPU needed)."""
from __future__ import annotations

import ctypes
import re
import struct
from pathlib import Path
from typing import Any

import pytest

import lowgrad as lg
from lowgrad.contracts import kernel_source as ks
from lowgrad.contracts.kernels import ELEMENTWISE, Kernels
from lowgrad.cuda import kernels as ck
from lowgrad.sr.seedcounter import SeedCounter

u64, u32, i32, f32 = ctypes.c_uint64, ctypes.c_uint32, ctypes.c_int32, ctypes.c_float
# The table as Python spelled it before the sources became its one definition (issue 12).
OLD_MULTI_MAX = 16
OLD_ARGS = {
    "add_sr": (u64, u64, u64, f32, u64, u64, u64),
    # + the statistics' slots and set count of add_sr_multi_stats_*, which the plain kernels pack as 0
    "add_sr_multi": (u64,) * (6 * OLD_MULTI_MAX) + (u32,) * (OLD_MULTI_MAX + 1) + (u32, f32, u64, u32, u64, u32),
    "reduce_sr": (u64, u64, u32, i32, f32, i32, u64, u64, u64, u64, u32, u32),
    "fill_u8": (u64, u64, u32),  # was fill_zero_u8 (u64, u64): the byte became an argument
    "norm_squared_finish": (u64, u32, u64, i32),
    "norm_squared": (u64, u64, u64),
    "philox_kat": (u64, u64, u64, u64),
    "seed_counter": (u64, u32, u64, u32, u32),  # + the rounding mode
}
OLD_SYMBOLS = 8 + 4 + 4 + 1 + 1 + 1 + 4 + 2
MULTI_LAYOUT = "=" + "Q" * 96 + "I" * 18 + "f4xQI4xQI4x"  # struct MultiAddSr as C lays it out: 880 bytes


def old_stem(symbol: str) -> str | None:
    """The old table's kernel that ``symbol`` is an entry point of (its name, then dtype tags
    only), or None for a kernel added since: derived from the table and the sources, so a new
    kernel needs no entry here."""
    stems = [k for k in OLD_ARGS if re.fullmatch(re.escape(k) + TAGS, symbol)]
    return max(stems, key=len) if stems else None


TAGS = "(?:_(?:" + "|".join(ks._TAG.values()) + "))*"  # the dtype suffixes of kernel symbols


def old_args(symbol: str) -> tuple[Any, ...]:
    stem = old_stem(symbol)
    assert stem is not None, symbol
    return OLD_ARGS[stem]


def test_table_read_from_the_sources_equals_the_old_hand_written_one() -> None:
    specs = {k: v for k, v in ks.kernel_specs().items() if old_stem(k) is not None}
    assert len(specs) == OLD_SYMBOLS
    assert old_stem("add_sr_multi_stats_f32_f32_f32") is None and old_stem("scale_sr_f32_f32") is None
    assert old_stem("add_sr_multi_bf16_bf16_f32") == "add_sr_multi" and old_stem("fill_u8") == "fill_u8"
    for symbol, spec in specs.items():
        assert spec.args == old_args(symbol), symbol
        assert spec.block == 256 and spec.struct == symbol.startswith("add_sr_multi"), symbol
    c = ks.constants("add_sr")
    assert (c["MULTI_MAX"], c["CHUNK_ELEMS"], c["GROUP_ELEMS"]) == (16, 4096, 8)


def test_loopback_structs_are_read_as_c_lays_them_out() -> None:
    sync, copy, reduce = (ks.kernel(n) for n in ("loopback_sync", "loopback_copy", "loopback_reduce_bf16"))
    assert sync.args == (u64,) * 19 + (u32,) * 16 + (u64,) + (u32,) * 3 + (u64,) and sync.block == 32
    assert copy.args == (u64,) * 5 + (u32,) and reduce.args == (u64,) * 5 + (u32,) * 3 + (ctypes.c_double,)
    assert all(s.struct for s in (sync, copy, reduce)) and ks.kernel("loopback_delay").args == (u64,)
    c = ks.constants("loopback")
    assert (c["LB_PTRS"], c["LB_MAX_WORLD"], c["LB_STATUS"]) == (16, 64, 68)


def test_struct_fields_keep_their_names_and_lengths() -> None:
    spec = ks.kernel_for("add_sr_multi", lg.bf16, lg.bf16, lg.fp32)
    assert [(p.name, p.count) for p in spec.params] == [
        ("dst", 16), ("a", 16), ("b", 16), ("seed", 16), ("offset", 16), ("n", 16), ("first", 17), ("count", 1),
        ("scale", 1), ("counter", 1), ("layer", 1), ("stats", 1), ("sets", 1)]
    assert spec.flatten({p.name: [] if p.count > 1 else 0 for p in spec.params}) == [0] * len(spec.args)
    with pytest.raises(ValueError, match="takes"):
        spec.flatten({"dst": []})
    with pytest.raises(ValueError, match="holds 16"):
        spec.flatten({p.name: [1] * 17 if p.count > 1 else 0 for p in spec.params})


def test_typed_lookup() -> None:
    from lowgrad import bf16, fp16, fp32, fp64

    assert ks.kernel_for("add_sr", bf16, fp32, "bf16").symbol == "add_sr_bf16_f32_bf16"
    assert ks.kernel_for("add_sr", bf16, bf16, bf16).args == (u64, u64, u64, f32, u64, u64, u64)
    assert ks.kernel_for("reduce_sr", fp32, bf16).symbol == "reduce_sr_f32_bf16"
    assert ks.kernel_for("scale_sr", bf16, fp32).args == (u64, u64, f32, u64, u64, u64)
    assert ks.kernel_for("norm_squared_finish", fp64).symbol == "norm_squared_finish_f64"
    assert ks.kernel("fill_u8").module == "fill" and ks.kernel("philox_kat").module == "philox_kat"
    with pytest.raises(ValueError, match="no kernel"):
        ks.kernel("add_sr_f16_f16_f16")
    with pytest.raises(TypeError, match=r"add_sr: no kernel for dtypes \(fp16, bf16, bf16\)"):
        ks.kernel_for("add_sr", fp16, bf16, bf16)
    with pytest.raises(TypeError, match=r"norm_squared: no kernel for dtypes \(fp32, bf16\)"):
        ks.kernel_for("norm_squared", fp32, bf16)
    with pytest.raises(ValueError, match="unknown kernel module"):
        ks.constants("nope")
    assert all(s.block == (32 if s.symbol in ("loopback_sync", "loopback_delay") else 256)
               for s in ks.kernel_specs().values() if s.module != "grad_stats")  # one-thread waits


def test_structs_and_constants_shared_with_python() -> None:
    """The seed counter's layout, modes and ops are the sources' (kernels/sr.cuh, seed_counter.cu)."""
    from lowgrad.sr import seedcounter as sc

    fields = ks.struct_fields("seed_counter", "SeedCounter")
    assert [(f.name, f.ctype, f.count) for f in fields] == [("base", u64, 1)] + [(n, u32, 1) for n in (
        "step", "micro", "mode", "done")]
    assert sc.COUNTER_DTYPE.names == tuple(f.name for f in fields) and sc.COUNTER_DTYPE.itemsize == 24
    c = ks.constants("seed_counter")
    assert sc.ROUNDINGS == {"sr": c["ROUND_SR"], "ldsr": c["ROUND_LDSR"], "rn": c["ROUND_RN"]}
    assert (sc.SET, sc.NEXT_MICRO, sc.NEXT_STEP, sc.LD_STEP) == (c["SET"], c["NEXT_MICRO"], c["NEXT_STEP"], 40503)
    with pytest.raises(ValueError, match="neither a scalar nor a struct"):
        ks.struct_fields("seed_counter", "NoSuchStruct")


def test_the_reader_finds_the_sources_of_a_checkout() -> None:
    assert (ks.kernel_dir() / "add_sr.cu").is_file() and ks.kernel_dir().name == "kernels"
    assert set(ks.modules()) == {p.stem for p in ks.kernel_dir().glob("*.cu")}


def write(tmp_path: Path, name: str, text: str) -> Path:
    (tmp_path / f"{name}.cu").write_text(text)
    return tmp_path


def test_reader_expands_macros_and_reads_constants(tmp_path: Path) -> None:
    d = write(tmp_path, "k", """
        #include "h.cuh"
        enum : u32 { WIDE = BASE * 2 + 1, ODD = sizeof(int) };  // ODD is not a constant of the source
        struct P { u64 p[WIDE]; float s; const int* q; };
        #define K(TN, T) \\
          extern "C" __global__ void __launch_bounds__(BASE) k_##TN(const T* __restrict__ x, int n, double d) { }
        K(f32, float)
        K(bf16, bf16_t)
        extern "C" __global__ void by_value(const __grid_constant__ P m) { }
        /* extern "C" __global__ void commented_out(float x) { } */
        """)
    (tmp_path / "h.cuh").write_text("enum { BASE = 0x20u };\n")
    specs, consts = ks.read_module("k", d)
    assert consts["BASE"] == 32 and consts["WIDE"] == 65 and "ODD" not in consts
    assert set(specs) == {"k_f32", "k_bf16", "by_value"}
    assert specs["k_bf16"].args == (u64, i32, ctypes.c_double) and specs["k_bf16"].block == 32
    assert specs["by_value"].struct and specs["by_value"].args == (u64,) * 65 + (f32, u64)
    assert specs["by_value"].block == ks.DEFAULT_BLOCK


@pytest.mark.parametrize("source, message", [
    ('extern "C" __global__ void k(short x) { }', "unsupported parameter type"),
    ('extern "C" __global__ void k(Q q) { }', "unsupported parameter type"),
    ('struct S { u64 a; }; extern "C" __global__ void k(S s, int n) { }', "only one"),
    ('#define K(A, B) extern "C" __global__ void k_##A(B x) { }\nK(f32)', "1 arguments for 2"),
])
def test_reader_refuses_what_it_cannot_pack(tmp_path: Path, source: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ks.read_module("k", write(tmp_path, "k", source))


# ---- packed bytes, before and after --------------------------------------------------------------
class Launches:
    """A stand-in for cuLaunchKernel: records (function, grid, block, argument bytes)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int, bytes]] = []
        self.sizes: dict[int, int] = {}

    def __call__(self, func: int, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, shmem: int, stream: int,
                 params: int, extra: Any) -> int:
        first = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))[0]
        self.calls.append((func, gx, bx, ctypes.string_at(first, self.sizes[func])))
        return 0


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> Launches:
    rec = Launches()
    monkeypatch.setattr(ck._cuda, "c_function", lambda name, *types: rec)
    return rec


def old_pack(args: tuple[Any, ...], *values: Any) -> bytes:
    """The old launcher's packing: natural alignment, the buffer padded to 8 bytes."""
    fmt, off = "=", 0
    for t in args:
        size = ctypes.sizeof(t)
        fmt += "x" * ((-off) % size) + ck._FMT[t]
        off += (-off) % size + size
    return struct.pack(fmt, *values) + bytes((-off) % 8 or (0 if off else 8))


def stand_in(sm_count: int = 132, resident: int = 2 * 132) -> ck.CudaKernels:
    """CudaKernels without a device: functions are ints from 1000 on, the resident grid is given."""
    k = object.__new__(ck.CudaKernels)
    c = ks.constants("add_sr")
    k.__dict__.update(max_grid=sm_count * ck.GRID_PER_SM, _kernels={}, _resident={}, group_elems=c["GROUP_ELEMS"],
                      multi_max=c["MULTI_MAX"], multi_chunk=c["CHUNK_ELEMS"])
    funcs: dict[str, ck.Kernel] = {}

    def kernel(spec: ks.KernelSpec) -> ck.Kernel:
        if spec.symbol not in funcs:
            funcs[spec.symbol] = ck.Kernel(spec, 1000 + len(funcs))
        return funcs[spec.symbol]
    k.kernel = kernel  # type: ignore[method-assign]
    k.resident_blocks = lambda func, block: resident  # type: ignore[method-assign]
    Kernels.__init__(k)  # the elementwise kernels, built as CudaKernels.__init__ builds them
    return k


def old_grid(n: int, max_grid: int) -> int:
    return min((n + 2047) >> 11, max_grid)


@pytest.mark.parametrize("n", [1, 7, 2047, 2048, 2049, 1 << 20, (1 << 31) + 5])
def test_grid_is_the_old_one(n: int) -> None:
    k = stand_in()
    assert k.grid(n, 256) == old_grid(n, k.max_grid)
    assert min(k.blocks(n, 256), ck.NORM_PARTIALS) == min((n + 2047) >> 11, ck.NORM_PARTIALS)


def test_single_tensor_launches_pack_the_old_bytes(launches: Launches) -> None:
    k = stand_in()
    h = lg.HostDevice()
    dst, a = h.alloc(5000, lg.bf16, kind="host"), h.alloc(5000, lg.fp32, kind="host")
    want = old_pack(OLD_ARGS["add_sr"], dst.ptr, dst.ptr, a.ptr, 0.5, 2**64 - 3, 17, 5000)
    launches.sizes[1000] = len(want)
    k.add_sr(dst, dst, a, 0.5, 2**64 - 3, 17, 0x1234)
    assert launches.calls[-1] == (1000, old_grid(5000, k.max_grid), 256, want)
    src = h.alloc(3 * 5000, lg.bf16, kind="host")
    want = old_pack(OLD_ARGS["reduce_sr"], dst.ptr, src.ptr, 3, 1, 2.0, 1, 9, 4, 5000, 0, 0, 0)
    launches.sizes[1001] = len(want)
    k.reduce_sr(dst, src, 3, 1, 2.0, True, 9, 4, 0)
    assert launches.calls[-1] == (1001, old_grid(5000, k.max_grid), 256, want)


def test_scale_sr_packs_its_entry_points_parameters(launches: Launches) -> None:
    """scale_sr, built from its declaration: (dst, a, scale, seed, index_offset, n) as declared in
    kernels/add_sr.cu, the grid of add_sr; nothing launched for no elements."""
    k = stand_in()
    h = lg.HostDevice()
    dst, a = h.alloc(5000, lg.fp32, kind="host"), h.alloc(5000, lg.bf16, kind="host")
    want = old_pack((u64, u64, f32, u64, u64, u64), dst.ptr, a.ptr, -0.5, 2**64 - 1, 3, 5000)
    launches.sizes[1000] = len(want)
    k.scale_sr(dst, a, -0.5, 2**64 - 1, 3, 0)
    k.scale_sr(dst.view(0, 0), a.view(0, 0), 1.0, 0, 0, 0)
    assert launches.calls == [(1000, old_grid(5000, k.max_grid), 256, want)]


def test_an_entry_point_unlike_its_declaration_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    k = stand_in()
    (decl,) = [d for d in ELEMENTWISE if d.name == "scale_sr"]
    spec = ks.kernel_for("scale_sr", lg.bf16, lg.bf16)
    wrong = ks.KernelSpec(spec.module, spec.symbol, tuple(ks.Param("x" if p.name == "a" else p.name, p.ctype)
                                                          for p in spec.params))
    monkeypatch.setattr(ck, "kernel_for",
                        lambda stem, *d: wrong if d == (lg.bf16, lg.bf16) else ks.kernel_for(stem, *d))
    with pytest.raises(ValueError, match=r"scale_sr_bf16_bf16 takes \['dst', 'x'"):
        k.build(decl)


@pytest.mark.parametrize("with_counter", [False, True])
def test_multi_tensor_launches_pack_the_old_bytes(launches: Launches, with_counter: bool) -> None:
    """bind_add_sr_multi packs MultiAddSr by field name now; the bytes are the old positional ones."""
    k = stand_in(resident=300)
    h = lg.HostDevice()
    sizes = [1, 4095, 4096, 4097, 100_000, 0, 3, 70_000] * 3  # 24 tensors: two launches
    dsts = [h.alloc(n, lg.bf16, kind="host") for n in sizes]
    items = [(d, d, h.alloc(d.numel, lg.fp32, kind="host"), 11 * i) for i, d in enumerate(dsts)]
    counter = SeedCounter(h, 5, 0) if with_counter else None
    seeds = [2 * i + 1 for i in range(len(items))] if with_counter else [2**63 + i for i in range(len(items))]
    spec = ks.kernel_for("add_sr_multi", lg.bf16, lg.bf16, lg.fp32)
    launches.sizes[1000] = struct.calcsize(MULTI_LAYOUT)
    run = k.bind_add_sr_multi(items, 0.25, (counter, 7 if with_counter else 0, seeds))
    run(0)
    want = []
    for c in range(0, len(items), OLD_MULTI_MAX):  # the old packing, verbatim
        part = items[c:c + OLD_MULTI_MAX]
        z = [0] * (OLD_MULTI_MAX - len(part))
        first = [0]
        for d, _, _, _ in part:
            first.append(first[-1] + -(-d.numel // 4096))
        cols = [[t.ptr for t in column] + z for column in zip(*[item[:3] for item in part])]
        buf = old_pack(OLD_ARGS["add_sr_multi"], *cols[0], *cols[1], *cols[2], *seeds[c:c + len(part)], *z,
                       *[off for *_, off in part], *z, *[d.numel for d, *_ in part], *z, *first,
                       *[first[-1]] * len(z), len(part), 0.25, counter.tensor.ptr if counter else 0,
                       7 if with_counter else 0, 0, 0)
        want.append((1000, min(first[-1], 300), spec.block, buf))
    fields = [(f, g, b, struct.unpack(MULTI_LAYOUT, buf)) for f, g, b, buf in want]
    assert [(f, g, b, struct.unpack(MULTI_LAYOUT, buf)) for f, g, b, buf in launches.calls] == fields
    assert launches.calls == want
