"""The kernel table contract: what :attr:`lowgrad.core.backend.DeviceBase.kernels` returns on
every backend (CUDA: NVRTC-compiled kernels, ``lowgrad.cuda.kernels.CudaKernels``; host: the
numpy reference, ``lowgrad.host.kernels.HostKernels``). :mod:`lowgrad.ops` checks every argument
(:mod:`lowgrad.sr.checks`) and then calls in here, so implementations may assume: tensors are
live, on this device, in memory its kernels can access, of the dtypes and sizes stated, and the
ints and floats in range. ``stream`` is always a raw stream handle (int); work is queued on it
in order with the stream's other work (the host backend completes it before returning). How a
kernel is launched (grid, block, chunking) is the backend's own business and no part of this
contract.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from lowgrad.core.tensor import Tensor

#: the seeds of bound SR launches (``lowgrad.ops.check_seed_source`` makes it): ``(None, 0, one
#: fixed seed per SR use)``, or ``(counter, layer, one lane per SR use)`` with a
#: :class:`lowgrad.sr.seedcounter.SeedCounter` whose per-use seeds are read when the work runs
SeedSource = tuple[Any, int, list[int]]


class Kernels(ABC):
    """A backend's kernels. Both backends derive from this class; results are bit for bit the
    same on both (the numpy reference :mod:`lowgrad.sr.reference` defines them), except the last
    bits of :meth:`norm_squared`, whose summation order is the backend's."""

    @abstractmethod
    def add_sr(self, dst: Tensor, a: Tensor, b: Tensor, scale: float, seed: int, index_offset: int,
               stream: int) -> None:
        """``dst = SR((a + b) * scale)`` elementwise in float32 on ``stream``: three tensors of
        ``n`` elements (fp32 or bf16 each; ``dst`` may alias ``a`` exactly, never ``b``);
        ``scale`` finite in float32; element ``i`` rounds with the noise of seed ``seed`` (64-bit)
        and index ``index_offset + i`` (< 2**64)."""

    @abstractmethod
    def reduce_sr(self, dst: Tensor, src: Tensor, n_shards: int, skip: int, scale: float, accumulate: bool,
                  seed: int, index_offset: int, stream: int) -> None:
        """``dst = SR(((dst if accumulate else +0) + sum_{k != skip} src[k]) * scale)`` on
        ``stream``: ``src`` holds ``n_shards`` consecutive blocks of ``dst.numel`` elements, summed
        in float32 in block order; ``skip`` a block index or -1; noise as in :meth:`add_sr`."""

    @abstractmethod
    def bind_add_sr(self, dst: Tensor, a: Tensor, b: Tensor, scale: float, index_offset: int
                    ) -> Callable[[int, int], None]:
        """:meth:`add_sr` with everything but the seed fixed now: the returned ``f(seed, stream)``
        queues it. ``f`` raises :class:`~lowgrad.core.errors.ClosedError` once a tensor was
        closed, before queueing anything."""

    @abstractmethod
    def bind_add_sr_multi(self, items: list[tuple[Tensor, Tensor, Tensor, int]], scale: float,
                          seeds: SeedSource) -> Callable[[int], None]:
        """:meth:`add_sr` of every ``(dst, a, b, index_offset)`` of ``items`` (one dtype triple,
        ``dst`` of ``a``'s dtype) fixed now: the returned ``f(stream)`` queues all of them. ``seeds``
        is ``(None, 0, one seed per item)`` or ``(counter, layer, one lane per item)``, whose
        per-use roundings are read when the work runs. Results equal separate :meth:`add_sr` calls;
        ``f`` raises ClosedError as :meth:`bind_add_sr`'s does."""

    @abstractmethod
    def bind_reduce_sr(self, dst: Tensor, src: Tensor, n_shards: int, skip: int, scale: float, accumulate: bool,
                       index_offset: int, seed: SeedSource) -> Callable[[int], None]:
        """:meth:`reduce_sr` fixed now, ``seed`` as ``(None, 0, [seed])`` or ``(counter, layer,
        [lane])``: the returned ``f(stream)`` queues it (ClosedError as :meth:`bind_add_sr`)."""

    @abstractmethod
    def seed_counter(self, counter: Tensor, op: int, base: int, step: int, mode: int, stream: int) -> None:
        """Update the 24-byte seed counter ``counter`` (``COUNTER_DTYPE`` of
        :mod:`lowgrad.sr.seedcounter`) on ``stream``: op ``SET`` to ``(base, step, micro 0,
        mode)``, ``NEXT_MICRO`` or ``NEXT_STEP``."""

    @abstractmethod
    def fill(self, dst: Tensor, byte: int, stream: int) -> None:
        """Set each of the ``dst.nbytes`` bytes of ``dst`` to ``byte`` (0-255) on ``stream``."""

    @abstractmethod
    def copy(self, dst: Tensor, src: Tensor, stream: int) -> None:
        """Copy the ``src.nbytes`` bytes of ``src`` into ``dst`` (as many bytes; the two do not
        overlap) on ``stream``, with the GPU's cores rather than a copy engine: a copy engine is
        one queue shared by every stream of the process, so a copy queued there can wait behind
        another rank's (the loopback communicator's graph replays)."""

    @abstractmethod
    def norm_squared(self, x: Tensor, out: Tensor, accumulate: bool, stream: int) -> None:
        """``out[0] = (out[0] if accumulate else 0) + sum(x**2)`` on ``stream``: ``x`` fp32 or
        bf16, ``out`` one fp32 or fp64 element (the accumulation type). Deterministic for a given
        backend, device and size."""
