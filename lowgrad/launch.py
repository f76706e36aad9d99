"""The CUDA backend's kernels: modules loaded from NVRTC cubins, and a launch path that packs
arguments into a buffer made once per kernel (no per-call allocation beyond the binding's)."""
from __future__ import annotations

import ctypes
import struct
import threading
from typing import Any

from . import _cuda
from .compiler import compile_kernels
from .dtypes import DType, fp64
from .tensor import Tensor

BLOCK = 256  # threads per block of the elementwise kernels
ELEMS_PER_THREAD = 8  # one Philox call covers 8 consecutive elements
NORM_PARTIALS = 1024  # blocks of norm_squared stage 1 at most

_TAG = {"fp32": "f32", "bf16": "bf16"}
_FMT = {ctypes.c_uint64: "Q", ctypes.c_int64: "q", ctypes.c_uint32: "I", ctypes.c_int32: "i",
        ctypes.c_float: "f", ctypes.c_double: "d"}


class Kernel:
    """One ``extern "C"`` entry point with its argument buffer packed in place per launch.

    ``launch(grid, stream, *args)`` writes ``args`` into the buffer (struct.pack_into, one C
    call) and calls ``cuLaunchKernel`` with the prebuilt pointer array; a lock keeps concurrent
    launches from different threads from sharing the buffer mid-call.
    """

    __slots__ = ("name", "func", "block", "_pack", "_buf", "_ptrs", "_params", "_lock", "_launch")

    def __init__(self, name: str, func: Any, argtypes: tuple[Any, ...], block: int = BLOCK) -> None:
        self.name, self.func, self.block = name, func, block
        offsets, off = [], 0
        for t in argtypes:
            size = ctypes.sizeof(t)
            off = (off + size - 1) // size * size
            offsets.append(off)
            off += size
        fmt = "="
        pos = 0
        for t, o in zip(argtypes, offsets):
            fmt += "x" * (o - pos) + _FMT[t]
            pos = o + ctypes.sizeof(t)
        self._pack = struct.Struct(fmt).pack_into
        self._buf = (ctypes.c_char * max(off, 8))()
        base = ctypes.addressof(self._buf)
        self._ptrs = (ctypes.c_void_p * len(argtypes))(*[base + o for o in offsets])
        self._params = ctypes.addressof(self._ptrs)
        self._lock = threading.Lock()
        self._launch = _cuda.driver().cuLaunchKernel

    def launch(self, grid: int, stream: int, *args: Any) -> None:
        with self._lock:
            self._pack(self._buf, 0, *args)
            err = self._launch(self.func, grid, 1, 1, self.block, 1, 1, 0, stream, self._params, 0)[0]
        if err:
            raise _cuda.fail(f"cuLaunchKernel({self.name})", err)


class CudaKernels:
    """Every lowgrad kernel on one device; modules load at construction, functions at first use."""

    def __init__(self, device: Any) -> None:
        drv = _cuda.driver()
        device.activate()
        self.device = device
        self._modules = {name: _cuda.check("cuModuleLoadData", drv.cuModuleLoadData(cubin))
                         for name, cubin in compile_kernels(device.arch).items()}
        self._kernels: dict[str, Kernel] = {}
        self._workspaces: dict[tuple[int, DType], Tensor] = {}
        self._lock = threading.Lock()
        self.max_grid = device.sm_count * 16

    def kernel(self, module: str, symbol: str, argtypes: tuple[Any, ...], block: int = BLOCK) -> Kernel:
        """The cached :class:`Kernel` for ``symbol`` in ``module``."""
        k = self._kernels.get(symbol)
        if k is None:
            with self._lock:
                k = self._kernels.get(symbol)
                if k is None:
                    func = _cuda.check(f"cuModuleGetFunction({symbol})",
                                       _cuda.driver().cuModuleGetFunction(self._modules[module], symbol.encode()))
                    k = self._kernels[symbol] = Kernel(symbol, func, argtypes, block)
        return k

    def grid(self, n: int) -> int:
        """Blocks for ``n`` elements at 8 per thread, capped for the grid-stride loop."""
        return max(1, min(-(-n // (BLOCK * ELEMS_PER_THREAD)), self.max_grid))

    # ---- the kernels (arguments checked by lowgrad.ops) --------------------------------
    def add_sr(self, dst: Tensor, a: Tensor, b: Tensor, scale: float, seed: int, index_offset: int,
               stream: int) -> None:
        n = dst.numel
        if not n:
            return
        sym = f"add_sr_{_TAG[dst.dtype.name]}_{_TAG[a.dtype.name]}_{_TAG[b.dtype.name]}"
        k = self.kernel("add_sr", sym, _ADD_SR_ARGS)
        k.launch(self.grid(n), stream, dst.ptr, a.ptr, b.ptr, scale, seed, index_offset, n)

    def reduce_sr(self, dst: Tensor, src: Tensor, n_shards: int, skip: int, scale: float, accumulate: bool,
                  seed: int, index_offset: int, stream: int) -> None:
        n = dst.numel
        if not n:
            return
        sym = f"reduce_sr_{_TAG[dst.dtype.name]}_{_TAG[src.dtype.name]}"
        k = self.kernel("reduce_sr", sym, _REDUCE_SR_ARGS)
        k.launch(self.grid(n), stream, dst.ptr, src.ptr, n_shards, skip, scale, int(accumulate), seed,
                 index_offset, n)

    def fill_zero(self, dst: Tensor, stream: int) -> None:
        if dst.nbytes:
            k = self.kernel("fill_zero", "fill_zero_u8", _FILL_ARGS)
            k.launch(self.grid(max(1, dst.nbytes // 2)), stream, dst.ptr, dst.nbytes)

    def norm_squared(self, x: Tensor, out: Tensor, accumulate: bool, stream: int) -> None:
        acc = "f64" if out.dtype is fp64 else "f32"
        ws = self._workspace(stream, out.dtype)
        grid = max(1, min(-(-x.numel // (BLOCK * ELEMS_PER_THREAD)), NORM_PARTIALS))
        stage1 = self.kernel("norm_squared", f"norm_squared_{_TAG[x.dtype.name]}_{acc}", _NORM_ARGS)
        stage2 = self.kernel("norm_squared", f"norm_squared_finish_{acc}", _NORM_FINISH_ARGS)
        if x.numel:
            stage1.launch(grid, stream, x.ptr, x.numel, ws.ptr)
        else:
            grid = 0
        stage2.launch(1, stream, ws.ptr, grid, out.ptr, int(accumulate))

    def _workspace(self, stream: int, dtype: DType) -> Tensor:
        """Per-stream partial sums, so norms on different streams never share scratch memory."""
        key = (stream, dtype)
        ws = self._workspaces.get(key)
        if ws is None:
            ws = self._workspaces[key] = self.device.alloc(NORM_PARTIALS, dtype, name="norm_workspace")
        return ws

    def philox(self, ctr: Tensor, key: Tensor, out: Tensor, stream: int = 0) -> None:
        """Philox4x32-10 of ``ctr`` ((n, 4) uint32 as byte tensors) with ``key`` ((n, 2)) into ``out``."""
        n = out.nbytes // 16
        self.kernel("philox_kat", "philox_kat", _PHILOX_ARGS).launch(self.grid(n * 8), stream, ctr.ptr, key.ptr,
                                                                     out.ptr, n)


_u64, _u32, _i32, _f32 = ctypes.c_uint64, ctypes.c_uint32, ctypes.c_int32, ctypes.c_float
_ADD_SR_ARGS = (_u64, _u64, _u64, _f32, _u64, _u64, _u64)
_REDUCE_SR_ARGS = (_u64, _u64, _u32, _i32, _f32, _i32, _u64, _u64, _u64)
_FILL_ARGS = (_u64, _u64)
_NORM_ARGS = (_u64, _u64, _u64)
_NORM_FINISH_ARGS = (_u64, _u32, _u64, _i32)
_PHILOX_ARGS = (_u64, _u64, _u64, _u64)
__all__ = ["CudaKernels", "Kernel"]
