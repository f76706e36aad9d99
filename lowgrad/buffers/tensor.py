"""Tensors: typed, shaped, contiguous views of an :class:`~lowgrad.buffers.memory.Allocation`, and
named containers of them.

What a tensor exports follows who can address its memory, as the backend reported it
(:attr:`Allocation.device_accessible`, :attr:`Allocation.host_accessible`), never the backend's
name: GPU-addressable memory has ``__cuda_array_interface__`` (v3); DLPack names GPU-only memory
``kDLCUDA``, memory both sides address (mapped pinned) ``kDLCUDAHost`` and CPU-only memory
``kDLCPU``; CPU-addressable memory gives a writable numpy view through :meth:`Tensor.numpy`.
"""
from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from lowgrad.base.dtypes import DType, as_dtype
from lowgrad.base.errors import ClosedError
from lowgrad.base.integers import integer
from lowgrad.buffers import dlpack
from lowgrad.buffers.memory import Allocation, align_up, check_kind


def check_shape(shape: Any) -> tuple[int, ...]:
    """Normalise a shape (int or sequence of ints) and reject negative or non-integer dims."""
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
        shape = (shape,)
    try:
        dims = tuple(shape)
    except TypeError:
        raise TypeError(f"shape must be an int or a sequence of ints, got {shape!r}") from None
    for d in dims:
        if not isinstance(d, (int, np.integer)) or isinstance(d, bool):
            raise TypeError(f"shape {shape!r}: dimensions must be ints")
        if d < 0:
            raise ValueError(f"shape {shape!r}: negative dimension")
        if d >= 1 << 63:
            raise ValueError(f"shape {shape!r}: dimension {d} does not fit int64")
    return tuple(int(d) for d in dims)


class Tensor:
    """A contiguous, typed, shaped view: ``ptr`` (int address), ``dtype``, ``shape``, ``device``,
    ``kind`` ("device" | "pinned" | "write_combined" | "host") and ``name``.

    Using a tensor whose memory was closed raises :class:`~lowgrad.base.errors.ClosedError`. Memory
    exported through DLPack, the CUDA array interface or :meth:`numpy` stays valid while the
    exported view lives (see ``docs/resources.md``).
    """

    __slots__ = ("_alloc", "_offset", "dtype", "shape", "name", "numel", "nbytes", "_export")

    def __init__(self, alloc: Allocation, offset: int, dtype: DType, shape: tuple[int, ...], name: str) -> None:
        self._alloc, self._offset, self.dtype, self.shape, self.name = alloc, offset, dtype, shape, name
        self.numel = math.prod(shape)
        self.nbytes = self.numel * dtype.itemsize

    @property
    def ptr(self) -> int:
        """Device-visible address of element 0 (raises after close)."""
        p = self._alloc._ptr
        if p is None:
            raise ClosedError(self._alloc._state_message())
        return p + self._offset

    @property
    def device(self) -> Any:
        return self._alloc.device

    @property
    def kind(self) -> str:
        return self._alloc.kind

    @property
    def allocation(self) -> Allocation:
        return self._alloc

    @property
    def offset(self) -> int:
        """Bytes from the start of :attr:`allocation` to element 0 (valid after close too)."""
        return self._offset

    @property
    def closed(self) -> bool:
        return self._alloc.closed

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def close(self) -> None:
        """Free the memory under this tensor now (every view of it becomes unusable)."""
        self._alloc.close()

    def __enter__(self) -> Tensor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- views -------------------------------------------------------------------------
    def view(self, start: int, numel: int, shape: Any = None) -> Tensor:
        """A contiguous sub-view of ``numel`` elements from flat element ``start`` (1-D unless
        ``shape`` is given)."""
        if start < 0 or numel < 0 or start + numel > self.numel:
            raise ValueError(f"view [{start}, {start + numel}) outside tensor {self.name!r} of {self.numel} elements")
        shp = (numel,) if shape is None else check_shape(shape)
        if math.prod(shp) != numel:
            raise ValueError(f"shape {shp} does not hold {numel} elements")
        return Tensor(self._alloc, self._offset + start * self.dtype.itemsize, self.dtype, shp, self.name)

    def flat(self) -> Tensor:
        """The same memory as a 1-D tensor."""
        return self.view(0, self.numel)

    def reshape(self, *shape: Any) -> Tensor:
        """The same contiguous memory with another shape (same number of elements)."""
        shp = check_shape(shape[0] if len(shape) == 1 else shape)
        if math.prod(shp) != self.numel:
            raise ValueError(f"cannot reshape tensor {self.name!r} of shape {self.shape} to {shp}")
        return Tensor(self._alloc, self._offset, self.dtype, shp, self.name)

    def __getitem__(self, key: Any) -> Tensor:
        """Contiguous slicing along dim 0 (``t[a:b]``, step 1) or one index (``t[i]``)."""
        if not self.shape:
            raise IndexError("cannot index a 0-d tensor")
        rows, row = self.shape[0], math.prod(self.shape[1:])
        if isinstance(key, slice):
            start, stop, step = key.indices(rows)
            if step != 1:
                raise ValueError("only contiguous slices (step 1) along dim 0 are supported")
            stop = max(stop, start)
            return self.view(start * row, (stop - start) * row, (stop - start,) + self.shape[1:])
        if isinstance(key, (int, np.integer)):
            i = int(key) + rows if key < 0 else int(key)
            if not 0 <= i < rows:
                raise IndexError(f"index {key} out of range for dim 0 of size {rows}")
            return self.view(i * row, row, self.shape[1:])
        raise TypeError(f"tensors index along dim 0 with an int or a slice, not {type(key).__name__}")

    # ---- host access -------------------------------------------------------------------
    def numpy(self) -> np.ndarray:
        """A writable numpy view of host-accessible memory (host, pinned, write-combined kinds, and
        every tensor of the host backend) or a host copy of device-only memory (after a device
        synchronise)."""
        if self._alloc.host_accessible:
            raw = self._alloc.host_bytes()[self._offset:self._offset + self.nbytes]
            return raw.view(self.dtype.np).reshape(self.shape)
        out = np.empty(self.shape, self.dtype.np)
        self.device.copy_to_host(out, self)
        return out

    def __float__(self) -> float:
        """The value of a one-element tensor as a Python float (through :meth:`numpy`: a host
        sync for device memory), e.g. ``float(gm.grad_norm_squared())``."""
        if self.numel != 1:
            raise TypeError(f"only one-element tensors convert to float; {self.name!r} has shape {self.shape}")
        return float(self.numpy().reshape(-1)[0])

    # ---- interop -----------------------------------------------------------------------
    def bitcast(self, dtype: DType | str) -> Tensor:
        """The same bytes as another dtype (e.g. bf16 as fp16 or byte); the last dimension scales
        by the ratio of the item sizes and must divide evenly."""
        dt = as_dtype(dtype)
        shape = self.shape or (1,)
        last = shape[-1] * self.dtype.itemsize
        if last % dt.itemsize:
            raise ValueError(f"cannot bitcast tensor {self.name!r} of shape {self.shape} ({self.dtype.name}) to "
                             f"{dt.name}: the last dimension's {last} bytes are not a multiple of {dt.itemsize}")
        return Tensor(self._alloc, self._offset, dt, shape[:-1] + (last // dt.itemsize,), self.name)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """CUDA array interface v3 (GPU-addressable memory: CUDA device, pinned and write-combined
        tensors). The interface has no deleter: consumers (CuPy, Numba, PyTorch) keep this tensor
        object, so from now on the tensor holds its memory until the tensor object itself is
        gone, even after ``close()``."""
        if not self._access()[0]:
            raise AttributeError("__cuda_array_interface__ is provided by CUDA device and pinned tensors only")
        self._export = self._alloc.memory  # ClosedError when closed
        return {"shape": self.shape, "typestr": self.dtype.typestr, "data": (self.ptr, False),
                "strides": None, "version": 3}

    def __dlpack__(self, stream: Any = None, max_version: Any = None, dl_device: Any = None,
                   copy: Any = None) -> Any:
        """A DLPack capsule over this tensor's memory (no copy): versioned and writable when the
        consumer passes ``max_version`` >= (1, 0), legacy otherwise. The memory stays valid until
        the consumer releases the view, whatever is closed meanwhile. The consumer's ``stream``
        is not synchronised with lowgrad's streams: order work through events before sharing."""
        versioned, device = dlpack.check_request(self._dl_devices(), max_version, dl_device, copy)
        return dlpack.to_capsule(self, device, max_version if versioned else None)

    def __dlpack_device__(self) -> tuple[int, int]:
        """(kDLCUDA, ordinal) for GPU-only memory, (kDLCUDAHost, 0) for memory both the GPU and
        the CPU address, (kDLCPU, 0) for CPU-only memory."""
        return self._dl_devices()[0]

    def _dl_devices(self) -> tuple[tuple[int, int], ...]:
        """The DLPack devices that name this memory without a copy, its own first."""
        on_device, on_host = self._access()
        if not on_device:
            return ((dlpack.KDL_CPU, 0),)
        gpu = (dlpack.KDL_CUDA, self.device.ordinal)
        return ((dlpack.KDL_CUDA_HOST, 0), (dlpack.KDL_CPU, 0), gpu) if on_host else (gpu,)

    def _access(self) -> tuple[bool, bool]:
        """(device-accessible, host-accessible) of the memory; ClosedError before a lazy commit."""
        a = self._alloc
        if not a.bound:
            raise ClosedError(a._state_message())
        return a.device_accessible, a.host_accessible

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"0x{self._alloc._ptr or 0:x}+{self._offset}"
        return f"Tensor({self.name!r}, {self.dtype.name}, shape={self.shape}, {self.kind}, {state})"


def shard_view(t: Tensor, rank: int, world: int) -> Tensor:
    """The ``rank``-th of ``world`` equal contiguous slices of ``t`` along dim 0 (``rank`` and
    ``world`` Python or NumPy integers); a 0-d ``t`` is its own one slice at world 1."""
    if not isinstance(t, Tensor):
        raise TypeError(f"shard_view needs a lowgrad Tensor, got {type(t).__name__}")
    world, rank = integer("world", world), integer("rank", rank)
    if world < 1:
        raise ValueError(f"world must be a positive int, got {world!r}")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank!r} outside [0, {world})")
    if not t.shape:
        if world == 1:
            return t
        raise ValueError(f"tensor {t.name!r} is 0-d (one element) and cannot be split into {world} slices")
    if t.shape[0] % world:
        raise ValueError(f"tensor {t.name!r} of shape {t.shape}: dim 0 ({t.shape[0]}) is not divisible "
                         f"by world {world}")
    rows = t.shape[0] // world
    return t[rank * rows:(rank + 1) * rows]


def span(tensors: Sequence[Tensor], dtype: DType | str, name: str | None = None) -> Tensor:
    """One 1-D ``dtype`` tensor over the bytes from the first of ``tensors`` to the end of the last
    (e.g. a layer's gradients, packed in one allocation): the tensors share one allocation, the
    first starts lowest and the last ends highest, and the spanned bytes hold whole ``dtype``
    elements. Named ``name`` (default: the first tensor's name)."""
    if not tensors or not all(isinstance(t, Tensor) for t in tensors):
        raise TypeError("span needs a non-empty sequence of lowgrad Tensors")
    dt, first = as_dtype(dtype), tensors[0]
    start = first.offset
    end = max(t.offset + t.nbytes for t in tensors)
    for t in tensors:
        if t.allocation is not first.allocation:
            raise ValueError(f"span: {t.name!r} is not in the allocation of {first.name!r}")
        if t.offset < start:
            raise ValueError(f"span: {t.name!r} starts before the first tensor {first.name!r}")
    if (end - start) % dt.itemsize:
        raise ValueError(f"span: {end - start} bytes are not a whole number of {dt.name} elements")
    return Tensor(first.allocation, start, dt, ((end - start) // dt.itemsize,), name or first.name)


class Container:
    """An ordered, named collection of tensors (a layer's gradients); ``None`` slots are allowed
    and skipped by iteration. Index by name or position."""

    __slots__ = ("_names", "_tensors", "_index")

    def __init__(self, items: list[tuple[str, Tensor | None]]) -> None:
        self._names = tuple(n for n, _ in items)
        self._tensors = tuple(t for _, t in items)
        self._index = {n: i for i, n in enumerate(self._names)}
        if len(self._index) != len(self._names):
            raise ValueError("container names must be unique")

    def __getitem__(self, key: str | int) -> Tensor | None:
        if isinstance(key, str):
            try:
                return self._tensors[self._index[key]]
            except KeyError:
                raise KeyError(f"no tensor named {key!r}; have {list(self._names)}") from None
        return self._tensors[key]

    def __len__(self) -> int:
        return len(self._names)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def names(self) -> tuple[str, ...]:
        return self._names

    def items(self) -> Iterator[tuple[str, Tensor]]:
        """(name, tensor) for every non-empty slot, in order."""
        return ((n, t) for n, t in zip(self._names, self._tensors) if t is not None)

    def tensors(self) -> Iterator[Tensor]:
        return (t for t in self._tensors if t is not None)

    def __repr__(self) -> str:
        return f"Container({list(self._names)})"


def from_numpy(array: np.ndarray, device: Any, kind: str = "device", name: str = "from_numpy") -> Tensor:
    """A new tensor on ``device`` holding a copy of ``array`` (synchronous)."""
    arr = np.ascontiguousarray(array)
    t = device.alloc(arr.shape, as_dtype(arr.dtype), kind=kind, name=name)
    device.copy_from_host(t, arr)
    return t


class LazyAllocator:
    """Collects many tensors and commits them as one allocation (each aligned to 256 bytes).

    ``alloc`` returns tensors at once; they raise on use until :meth:`commit`. The report lists
    every tensor under its own name.
    """

    def __init__(self, device: Any, kind: str = "device") -> None:
        self.device, self.kind = device, check_kind(kind)
        self._parts: dict[str, int] = {}
        self._allocation = Allocation(device, kind, 0, self._parts)
        self._offset = 0
        self._committed = False

    def alloc(self, shape: Any, dtype: DType | str, name: str) -> Tensor:
        """Reserve a tensor of ``shape``/``dtype`` named ``name`` in the pending block."""
        if self._committed:
            raise ValueError("LazyAllocator already committed; create a new one")
        dt, shp = as_dtype(dtype), check_shape(shape)
        t = Tensor(self._allocation, self._offset, dt, shp, name)
        self._parts[name] = self._parts.get(name, 0) + t.nbytes
        self._offset = align_up(self._offset + t.nbytes)
        return t

    @property
    def nbytes(self) -> int:
        return self._offset

    def commit(self) -> Allocation:
        """Allocate the block for every reserved tensor; returns the allocation."""
        if self._committed:
            raise ValueError("LazyAllocator already committed")
        self._committed = True
        self._allocation.nbytes = self._offset
        self.device._bind(self._allocation, self._offset)
        return self._allocation
