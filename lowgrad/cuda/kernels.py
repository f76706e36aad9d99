"""The CUDA backend's kernels: modules loaded from NVRTC cubins, and a launch path that packs
arguments into a buffer made once per kernel.

The launch itself calls the driver's ``cuLaunchKernel`` through ctypes on the libcuda that
cuda.bindings already loaded (:func:`lowgrad.cuda.driver.c_function`: no argument conversion per
call); everything else goes through cuda.bindings.
"""
from __future__ import annotations

import ctypes
import itertools
import struct
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from lowgrad.base import trace
from lowgrad.base.dtypes import DType, byte
from lowgrad.base.errors import ClosedError
from lowgrad.buffers import capture
from lowgrad.buffers.tensor import Tensor, from_numpy
from lowgrad.contracts.kernel_source import KernelSpec, constants, kernel, kernel_for, struct_fields
from lowgrad.contracts.kernels import Elementwise, Kernels, SeedSource, StatsSink, StatsTarget
from lowgrad.cuda import driver as _cuda
from lowgrad.cuda.compiler import compile_kernels
from lowgrad.sr.checks import SR_DTYPES

GRID_PER_SM = 64  # blocks per SM of the grid-stride kernels (measured: tools/bench_kernels.py)
NORM_PARTIALS = 1024  # blocks of norm_squared stage 1 at most

_FMT = {ctypes.c_uint64: "Q", ctypes.c_int64: "q", ctypes.c_uint32: "I", ctypes.c_int32: "i",
        ctypes.c_float: "f", ctypes.c_double: "d"}
class Kernel:
    """One ``extern "C"`` entry point with its argument buffer, packed in place per launch.

    ``launch(grid, stream, *args)`` writes ``args`` into the buffer (one ``pack_into`` call) and
    launches with the prebuilt pointer array; a lock keeps launches from different threads from
    sharing the buffer mid-call (the driver copies the arguments during the call).
    """

    __slots__ = ("name", "func", "block", "_pack", "_buf", "_ptrs", "_params", "_lock", "_launch")

    def __init__(self, spec: KernelSpec, func: Any) -> None:
        self.name, self.func, self.block = spec.symbol, int(func), spec.block
        fmt, off = "=", 0
        offsets = []
        for t in spec.args:
            size = ctypes.sizeof(t)
            pad = (-off) % size
            fmt += "x" * pad + _FMT[t]
            off += pad
            offsets.append(off)
            off += size
        self._pack = struct.Struct(fmt).pack_into
        self._buf = (ctypes.c_char * max(off + (-off) % 8, 8))()
        base = ctypes.addressof(self._buf)
        if spec.struct:  # one by-value struct parameter: a single pointer to the whole buffer
            offsets = [0]
        self._ptrs = (ctypes.c_void_p * len(offsets))(*[base + o for o in offsets])
        self._params = ctypes.addressof(self._ptrs)
        self._lock = threading.Lock()
        v, u = ctypes.c_void_p, ctypes.c_uint
        self._launch = _cuda.c_function("cuLaunchKernel", v, u, u, u, u, u, u, u, v, v, v)

    def launch(self, grid: int, stream: int, *args: Any) -> None:
        """Queue one launch of ``grid`` blocks on raw stream ``stream`` (asynchronous)."""
        with self._lock:
            self._pack(self._buf, 0, *args)
            err = self._launch(self.func, grid, 1, 1, self.block, 1, 1, 0, stream, self._params, None)
        if err:
            raise _cuda.fail(f"cuLaunchKernel({self.name})", err)
        if trace.ENABLED:
            trace.log("kernel", self.name, grid=grid, block=self.block, stream=hex(stream), args=args)

    def pack(self, *args: Any) -> None:
        """Fill the argument buffer once, for a kernel object that only :meth:`launch_packed`."""
        with self._lock:
            self._pack(self._buf, 0, *args)

    def launch_packed(self, grid: int, stream: int) -> None:
        """Launch with the arguments :meth:`pack` stored (never changed after, so no lock)."""
        err = self._launch(self.func, grid, 1, 1, self.block, 1, 1, 0, stream, self._params, None)
        if err:
            raise _cuda.fail(f"cuLaunchKernel({self.name})", err)
        if trace.ENABLED:
            trace.log("kernel", self.name, grid=grid, block=self.block, stream=hex(stream), packed=True)


def _struct_dtype(name: str) -> np.dtype:
    """``struct <name>`` of kernels/grad_stats.cu(h) as a numpy record (C's natural alignment)."""
    fields = struct_fields("grad_stats", name)
    return np.dtype({"names": [f.name for f in fields], "formats": [np.dtype(f.ctype) for f in fields],
                     "aligned": True})


def _counter_args(counter: Any) -> tuple[int, tuple[Any, ...]]:
    """The counter's device address (0: fixed seeds) and the allocation a bound launch must check."""
    return (counter.tensor.ptr, (counter.tensor.allocation,)) if counter is not None else (0, ())


def _run_packed(launches: list[tuple[Kernel, int]], allocs: tuple[Any, ...], name: str) -> Callable[[int], None]:
    """A bound launch: ``f(stream)`` checks ``allocs`` (:func:`_check_open`) and launches each
    packed kernel of ``launches`` on its grid, in order."""
    def run(stream: int) -> None:
        _check_open(allocs, name)
        for k, grid in launches:
            k.launch_packed(grid, stream)
    return run


def _check_open(allocs: tuple[Any, ...], name: str) -> None:
    """A bound launch's guard: its tensors are open (and held by a graph being captured)."""
    for a in allocs:
        if a._ptr is None:
            raise ClosedError(f"bound kernel on {name!r}: one of its tensors was closed")
    if capture.active[0]:
        capture.keep(allocs)


class CudaKernels(Kernels):
    """Every lowgrad kernel on one device; modules load at construction, functions at first use.
    Arguments arrive checked by :mod:`lowgrad.ops`. Launch shapes follow the sources' constants:
    ``GROUP_ELEMS`` elements a thread, the block of ``__launch_bounds__``, at most
    :data:`GRID_PER_SM` blocks per SM; the multi-tensor add_sr packs ``MULTI_MAX`` tensors a
    launch in chunks of ``CHUNK_ELEMS`` (``kernels/add_sr.cu``)."""

    def __init__(self, device: Any) -> None:
        drv = _cuda.driver()
        device.activate()
        self.device = device
        self._modules = {name: _cuda.check("cuModuleLoadData", drv.cuModuleLoadData(cubin))
                         for name, cubin in compile_kernels(device.arch).items()}
        self._kernels: dict[str, Kernel] = {}
        self._norm_kernels: dict[tuple[DType, DType], tuple[Kernel, Kernel]] = {}
        self._workspaces: dict[tuple[int, DType], Tensor] = {}
        # ranks sharing this device as threads (the loopback) may queue norms on one stream: a
        # norm's two stages are queued under this lock, so another thread's first stage cannot
        # land between them and overwrite the partial sums they share
        self._norm_lock = threading.Lock()
        self._resident: dict[int, int] = {}
        self._lock = threading.Lock()
        self.max_grid = device.sm_count * GRID_PER_SM
        c = constants("add_sr")
        self.group_elems, self.multi_max, self.multi_chunk = c["GROUP_ELEMS"], c["MULTI_MAX"], c["CHUNK_ELEMS"]
        s = constants("grad_stats")  # the statistics' chunks are add_sr_multi's (a static_assert in add_sr.cu)
        assert (s["STATS_MAX"], s["STATS_CHUNK"]) == (self.multi_max, self.multi_chunk)
        self.slot_bytes = _struct_dtype("StatsPartial").itemsize
        self.job_dtype = _struct_dtype("StatsJob")
        self._fill, self._copy, self._philox, self._seed_counter = (
            kernel(name) for name in ("fill_u8", "copy_u8", "philox_kat", "seed_counter"))
        super().__init__()

    def kernel(self, spec: KernelSpec) -> Kernel:
        """The cached :class:`Kernel` for ``spec``."""
        k = self._kernels.get(spec.symbol)
        if k is None:
            with self._lock:
                k = self._kernels.get(spec.symbol)
                if k is None:
                    func = _cuda.check(f"cuModuleGetFunction({spec.symbol})", _cuda.driver().cuModuleGetFunction(
                        self._modules[spec.module], spec.symbol.encode()))
                    k = self._kernels[spec.symbol] = Kernel(spec, func)
        return k

    def build(self, kernel: Elementwise[...]) -> Callable[..., None]:
        """The elementwise ``kernel`` as a function of the contract's arguments, generated from its
        declaration and its entry points' parameters: a call does what a hand-written launch
        method did (the dtypes' kernel from a dict, the pointers, one :meth:`Kernel.launch` with
        the arguments in the entry point's order), with no per-call mapping of names to
        parameters. ValueError when an entry point's parameters are not the declared ones."""
        name, ts = kernel.name, kernel.tensors
        want = {*kernel.args, "n", *kernel.unset}
        order: tuple[str, ...] = ()
        for dtypes in itertools.product(SR_DTYPES, repeat=len(ts)):  # every dtype mix the front lets through
            spec = kernel_for(name, *dtypes)
            got = tuple(p.name for p in spec.params)
            if set(got) != want or len(got) != len(want) or order and got != order:
                raise ValueError(f"{spec.symbol} takes {list(got)}; the contract's {name} needs "
                                 f"{sorted(want)} in the order of every {name} entry point")
            order = got
        table: dict[tuple[DType, ...], Kernel] = {}

        def load(key: tuple[DType, ...]) -> Kernel:
            k = table[key] = self.kernel(kernel_for(name, *key))
            return k
        value = {a: f"p_{a}" if a in ts else a for a in (*kernel.args, "n")} | dict.fromkeys(kernel.unset, "0")
        key = "(" + "".join(f"{t}.dtype, " for t in ts) + ")"
        source = (f"def {name}({', '.join(kernel.args)}, stream):\n"
                  f"    k = table.get({key})\n"
                  f"    if k is None:\n"
                  f"        k = load({key})\n"
                  f"    {''.join(f'p_{t}, ' for t in ts)}= {''.join(f'{t}.ptr, ' for t in ts)}\n"
                  f"    n = dst.numel\n"
                  f"    if n:\n"
                  f"        k.launch(grid(n, k.block), stream, {', '.join(value[p] for p in order)})\n")
        scope: dict[str, Any] = {"table": table, "load": load, "grid": self.grid}
        exec(compile(source, f"<lowgrad elementwise kernel {name}>", "exec"), scope)
        fn: Callable[..., None] = scope[name]
        fn.__doc__ = kernel.__doc__
        return fn

    def _norm_stages(self, x_dtype: DType, out_dtype: DType) -> tuple[Kernel, Kernel]:
        """norm_squared's two stages for these dtypes, looked up once."""
        key = (x_dtype, out_dtype)
        stages = self._norm_kernels.get(key)
        if stages is None:
            stages = self._norm_kernels[key] = (self.kernel(kernel_for("norm_squared", x_dtype, out_dtype)),
                                                self.kernel(kernel_for("norm_squared_finish", out_dtype)))
        return stages

    def blocks(self, n: int, block: int) -> int:
        """Blocks of ``block`` threads that give each thread one group (``GROUP_ELEMS``) of ``n``
        elements, uncapped."""
        per_block = block * self.group_elems
        return (n + per_block - 1) // per_block

    def grid(self, n: int, block: int) -> int:
        """:meth:`blocks` capped at :attr:`max_grid` for the grid-stride loop."""
        g = self.blocks(n, block)
        return g if g < self.max_grid else self.max_grid

    def bind_add_sr(self, dst: Tensor, a: Tensor, b: Tensor, scale: float, index_offset: int
                    ) -> Callable[[int, int], None]:
        """``f(seed, stream)``: this add_sr with its pointers, grid and constants fixed."""
        k, n = self.kernel(kernel_for("add_sr", dst.dtype, a.dtype, b.dtype)), dst.numel
        grid, p, pa, pb, launch = self.grid(n, k.block), dst.ptr, a.ptr, b.ptr, k.launch
        allocs = (dst.allocation, a.allocation, b.allocation)

        def run(seed: int, stream: int) -> None:
            _check_open(allocs, dst.name)
            if n:
                launch(grid, stream, p, pa, pb, scale, seed, index_offset, n)
        return run

    def bind_add_sr_multi(self, items: list[tuple[Tensor, Tensor, Tensor, int]], scale: float,
                          seeds: SeedSource, stats: StatsTarget | None = None,
                          blocks: int | None = None) -> Callable[[int], None]:
        """``f(stream)``: add_sr of every ``(dst, a, b, index_offset)`` (one dtype triple, ``dst``
        of ``a``'s dtype) in launches of up to ``MULTI_MAX`` tensors, everything packed here, once.
        ``seeds``: ``(None, 0, a seed per item)`` or ``(counter, layer, a lane per item)`` (seeds
        read on the device when the kernel runs). With ``stats``, ``add_sr_multi_stats_*`` writes
        each block's statistics of b at micro-step m (and at micro-step 1 of a, for row 0) to slot
        set m of slots made here, registered in the sink as jobs for its finish. The grid is the
        resident one; ``blocks`` overrides it (CUDA only, for tuning: launch shape is no part of
        the kernel contract)."""
        stem = "add_sr_multi" if stats is None else "add_sr_multi_stats"
        spec = kernel_for(stem, items[0][0].dtype, items[0][0].dtype, items[0][2].dtype)
        func = self.kernel(spec).func
        counter, layer, cols_seed = seeds
        counter_ptr, counter_alloc = _counter_args(counter)
        grid_max = blocks or self.resident_blocks(func, spec.block)
        mm = self.multi_max
        launches: list[tuple[Kernel, int]] = []
        owned: list[Tensor] = []  # the statistics' slots, held as long as the bound launch
        for c in range(0, len(items), mm):
            part = items[c:c + mm]
            first = self._chunks([d for d, _, _, _ in part], mm)
            grid = min(first[-1], grid_max)
            slots, sets = 0, []
            if stats is not None:
                sink, columns = stats[0], stats[1][c:c + len(part)]
                sets = sink.add_sets()
                t = self._stats_jobs(sink, grid, columns, sets)
                owned.append(t)
                slots = t.ptr
            k = Kernel(spec, func)
            k.pack(*spec.flatten({
                "dst": [d.ptr for d, _, _, _ in part], "a": [a.ptr for _, a, _, _ in part],
                "b": [b.ptr for _, _, b, _ in part], "seed": cols_seed[c:c + len(part)],
                "offset": [off for *_, off in part], "n": [d.numel for d, *_ in part],
                "first": first, "count": len(part), "scale": scale, "counter": counter_ptr, "layer": layer,
                "stats": slots, "sets": len(sets)}))
            if grid:
                launches.append((k, grid))
        held = [t for item in items for t in item[:3]] + owned
        return _run_packed(launches, tuple(dict.fromkeys(t.allocation for t in held)) + counter_alloc, items[0][0].name)

    def _chunks(self, tensors: list[Tensor], size: int) -> list[int]:
        """``first``: tensor t owns chunks ``[first[t], first[t + 1])`` of ``CHUNK_ELEMS``
        elements, padded with the total to ``size + 1`` entries."""
        first = [0]
        for t in tensors:
            first.append(first[-1] + -(-t.numel // self.multi_chunk))
        return first + [first[-1]] * (size - len(tensors))

    def _stats_jobs(self, sink: StatsSink, grid: int, columns: list[int], sets: list[tuple[int, int, int]]
                    ) -> Tensor:
        """The statistics slots of a launch of ``len(columns)`` tensors on ``grid`` blocks: for each
        ``(set, row, micro)`` of ``sets`` every block's slot of every tensor
        (kernels/grad_stats.cuh), ``[set][tensor][block]``; and one job per tensor and set in the
        sink: row ``row``, finished when the step had micro-step ``micro``."""
        count = len(columns)
        slots = self.device.alloc(max(len(sets) * count * grid, 1) * self.slot_bytes, byte, name="grad_stats_slots")
        sink.owned.append(slots)
        for t, column in enumerate(columns):
            for s, row, micro in sets:
                first = slots.ptr + ((s * count + t) * grid) * self.slot_bytes if grid else 0
                sink.jobs.append((first, grid, column, row, micro))
        return slots

    def bind_grad_stats(self, tensors: list[Tensor], sink: StatsSink, columns: list[int], row: int,
                        per_micro: bool) -> Callable[[int], None]:
        """``f(stream)``: ``grad_stats_<dtype>`` over up to ``STATS_MAX`` tensors a launch (a
        persistent grid over their chunks), each block's statistics into slots registered in the
        sink (with ``per_micro`` a set per micro-step, picked by the counter when it runs);
        everything packed here."""
        spec = kernel_for("grad_stats", tensors[0].dtype)
        func = self.kernel(spec).func
        grid_max = self.resident_blocks(func, spec.block)
        counter_ptr, counter_alloc = _counter_args(sink.counter if per_micro else None)
        sets = sink.grad_stats_sets(row, per_micro)
        mm = self.multi_max
        launches: list[tuple[Kernel, int]] = []
        owned: list[Tensor] = []
        for c in range(0, len(tensors), mm):
            part = tensors[c:c + mm]
            first = self._chunks(part, mm)
            grid = min(first[-1], grid_max)
            slots = self._stats_jobs(sink, grid, columns[c:c + mm], sets)
            owned.append(slots)
            k = Kernel(spec, func)
            k.pack(*spec.flatten({"x": [t.ptr for t in part], "n": [t.numel for t in part], "first": first,
                                  "count": len(part), "partials": slots.ptr, "counter": counter_ptr,
                                  "sets": len(sets)}))
            if grid:
                launches.append((k, grid))
        allocs = tuple(dict.fromkeys(t.allocation for t in (*tensors, *owned))) + counter_alloc
        return _run_packed(launches, allocs, tensors[0].name)

    def bind_stats_finish(self, sink: StatsSink) -> Callable[[int], None]:
        """``f(stream)``: ``grad_stats_finish`` over the sink's jobs (their table copied to the
        device here), one block per job."""
        if not sink.jobs:
            return lambda stream: None
        table = from_numpy(np.array(sink.jobs, self.job_dtype).view(np.uint8), self.device, name="grad_stats_jobs")
        sink.owned.append(table)  # with every launch's slots
        spec = kernel("grad_stats_finish")
        k = Kernel(spec, self.kernel(spec).func)
        out, (counter_ptr, counter_alloc) = sink.out, _counter_args(sink.counter)
        k.pack(table.ptr, len(sink.jobs), out.ptr, out.shape[1], counter_ptr)
        allocs = tuple(dict.fromkeys(t.allocation for t in (out, *sink.owned))) + counter_alloc
        return _run_packed([(k, len(sink.jobs))], allocs, out.name)

    def resident_blocks(self, func: int, block: int) -> int:
        """Blocks of ``func`` that fit on the whole GPU at once (its occupancy x SMs)."""
        n = self._resident.get(func)
        if n is None:
            drv = _cuda.driver()
            per_sm = _cuda.check("cuOccupancyMaxActiveBlocksPerMultiprocessor",
                                 drv.cuOccupancyMaxActiveBlocksPerMultiprocessor(drv.CUfunction(func), block, 0))
            n = self._resident[func] = max(1, int(per_sm)) * self.device.sm_count
        return n

    def bind_reduce_sr(self, dst: Tensor, src: Tensor, n_shards: int, skip: int, scale: float, accumulate: bool,
                       index_offset: int, seeds: SeedSource) -> Callable[[int], None]:
        """``f(stream)``: this reduce_sr packed once; ``seeds``: ``(None, 0, [seed])`` or
        ``(counter, layer, [lane])``."""
        spec, n = kernel_for("reduce_sr", dst.dtype, src.dtype), dst.numel
        k = Kernel(spec, self.kernel(spec).func)
        counter, layer, (s,) = seeds
        counter_ptr, counter_alloc = _counter_args(counter)
        k.pack(dst.ptr, src.ptr, n_shards, skip, scale, int(accumulate), s, index_offset, n, counter_ptr, layer, s)
        grid, allocs = self.grid(n, spec.block), (dst.allocation, src.allocation) + counter_alloc

        def run(stream: int) -> None:
            _check_open(allocs, dst.name)
            if n:
                k.launch_packed(grid, stream)
        return run

    def bind_quantize_i8_sr(self, q: Tensor, scales: Tensor, x: Tensor, index_offset: int,
                            seeds: SeedSource) -> Callable[[int], None]:
        """``f(stream)``: one warp per block of QBLOCK elements (kernels/quant8.cu), packed once (an
        empty ``x`` launches one block that finds no work)."""
        spec, n = kernel_for("quantize_i8_sr", x.dtype), x.numel
        k = Kernel(spec, self.kernel(spec).func)
        counter, layer, (s,) = seeds
        counter_ptr, counter_alloc = _counter_args(counter)
        k.pack(q.ptr, scales.ptr, x.ptr, n, s, index_offset, counter_ptr, layer, s)
        warps = spec.block // 32
        grid = max(1, min(-(-scales.numel // warps), self.max_grid))
        return _run_packed([(k, grid)], (q.allocation, scales.allocation, x.allocation) + counter_alloc, q.name)

    def bind_dequant_reduce_sr(self, dst: Tensor, q: Tensor, scales: Tensor, n_shards: int, skip: int,
                               scale: float, index_offset: int, seeds: SeedSource) -> Callable[[int], None]:
        """``f(stream)``: one element a thread (kernels/quant8.cu), packed once."""
        spec, n = kernel_for("dequant_reduce_sr", dst.dtype), dst.numel
        k = Kernel(spec, self.kernel(spec).func)
        counter, layer, (s,) = seeds
        counter_ptr, counter_alloc = _counter_args(counter)
        k.pack(dst.ptr, q.ptr, scales.ptr, n_shards, skip, scale, s, index_offset, n, counter_ptr, layer, s)
        grid = max(1, min(-(-n // spec.block), self.max_grid))
        return _run_packed([(k, grid)], (dst.allocation, q.allocation, scales.allocation) + counter_alloc, dst.name)

    def seed_counter(self, counter: Tensor, op: int, base: int, step: int, mode: int, stream: int) -> None:
        self.kernel(self._seed_counter).launch(1, stream, counter.ptr, op, base, step, mode)

    def fill(self, dst: Tensor, byte: int, stream: int) -> None:
        if dst.nbytes:  # a thread stores 16 bytes: GROUP_ELEMS 2-byte elements
            k = self.kernel(self._fill)
            k.launch(self.grid(max(1, dst.nbytes // 2), k.block), stream, dst.ptr, dst.nbytes, byte)

    def copy(self, dst: Tensor, src: Tensor, stream: int) -> None:
        if src.nbytes:
            k = self.kernel(self._copy)
            k.launch(self.grid(max(1, src.nbytes // 2), k.block), stream, dst.ptr, src.ptr, src.nbytes)

    def norm_squared(self, x: Tensor, out: Tensor, accumulate: bool, stream: int) -> None:
        stage1, stage2 = self._norm_stages(x.dtype, out.dtype)
        grid = min(self.blocks(x.numel, stage1.block), NORM_PARTIALS)
        with self._norm_lock:
            ws = self._workspace(stream, out.dtype)
            if grid:
                stage1.launch(grid, stream, x.ptr, x.numel, ws.ptr)
            stage2.launch(1, stream, ws.ptr, grid, out.ptr, int(accumulate))

    def _workspace(self, stream: int, dtype: DType) -> Tensor:
        """Partial sums per stream handle (NORM_PARTIALS elements, 8 KiB at most), so norms on
        different streams never share scratch memory; kept for the device's lifetime."""
        key = (stream, dtype)
        ws = self._workspaces.get(key)
        if ws is None:
            ws = self._workspaces[key] = self.device.alloc(NORM_PARTIALS, dtype, name="norm_workspace")
        return ws

    def philox(self, ctr: Tensor, key: Tensor, out: Tensor, stream: int = 0) -> None:
        """Philox4x32-10 of ``ctr`` (n x 4 uint32) with ``key`` (n x 2 uint32) into ``out`` (n x 4)."""
        n = out.nbytes // 16
        if ctr.nbytes != 16 * n or key.nbytes != 8 * n or out.nbytes != 16 * n:
            raise ValueError(f"philox: ctr ({ctr.nbytes} B), key ({key.nbytes} B) and out ({out.nbytes} B) "
                             "must hold n x 16, n x 8 and n x 16 bytes")
        if n:
            k = self.kernel(self._philox)  # one (counter, key) pair a thread
            k.launch(min(-(-n // k.block), self.max_grid), stream, ctr.ptr, key.ptr, out.ptr, n)
