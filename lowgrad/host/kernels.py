"""The host backend's kernels: the numpy reference applied in place to host tensors (eager)."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from lowgrad.core import trace
from lowgrad.core.kernels import Kernels, SeedSource
from lowgrad.core.tensor import Tensor
from lowgrad.sr import reference
from lowgrad.sr.seedcounter import COUNTER_DTYPE, apply_op


def _seeds(source: SeedSource) -> list[int]:
    """The fixed seeds, or those a counter's ``(layer, lanes)`` give right now."""
    counter, layer, values = source
    return values if counter is None else counter.host_seeds(layer, values)


def _trace(name: str, t: Tensor, stream: int) -> None:
    """The trace line of a host kernel writing ``t`` (CUDA's launches trace grid and block)."""
    trace.log("kernel", name, dst=t.name, numel=t.numel, dtype=t.dtype.name, stream=hex(stream))


class HostKernels(Kernels):
    """The :class:`~lowgrad.core.kernels.Kernels` contract on host memory, eagerly: arguments
    arrive checked by :mod:`lowgrad.ops`; each call (and each bound launch) completes before
    returning, whatever the stream."""

    def add_sr(self, dst: Tensor, a: Tensor, b: Tensor, scale: float, seed: int, index_offset: int,
               stream: int) -> None:
        if trace.ENABLED:
            _trace("add_sr", dst, stream)
        out = reference.add_sr(a.numpy().reshape(-1), b.numpy().reshape(-1), scale, seed, index_offset, dst.dtype)
        dst.numpy().reshape(-1)[:] = out

    def reduce_sr(self, dst: Tensor, src: Tensor, n_shards: int, skip: int, scale: float, accumulate: bool,
                  seed: int, index_offset: int, stream: int) -> None:
        if trace.ENABLED:
            _trace("reduce_sr", dst, stream)
        d = dst.numpy().reshape(-1)
        d[:] = reference.reduce_sr(d, src.numpy().reshape(-1), n_shards, skip, scale, accumulate, seed, index_offset)

    def bind_add_sr(self, dst: Tensor, a: Tensor, b: Tensor, scale: float, index_offset: int
                    ) -> Callable[[int, int], None]:
        return lambda seed, stream: self.add_sr(dst, a, b, scale, seed, index_offset, stream)

    def bind_add_sr_multi(self, items: list[tuple[Tensor, Tensor, Tensor, int]], scale: float, seeds: SeedSource
                          ) -> Callable[[int], None]:
        def run(stream: int) -> None:
            for (dst, a, b, off), seed in zip(items, _seeds(seeds)):
                self.add_sr(dst, a, b, scale, seed, off, stream)
        return run

    def bind_reduce_sr(self, dst: Tensor, src: Tensor, n_shards: int, skip: int, scale: float, accumulate: bool,
                       index_offset: int, seed: SeedSource) -> Callable[[int], None]:
        return lambda stream: self.reduce_sr(dst, src, n_shards, skip, scale, accumulate, _seeds(seed)[0],
                                             index_offset, stream)

    def seed_counter(self, counter: Tensor, op: int, base: int, step: int, stream: int) -> None:
        if trace.ENABLED:
            _trace("seed_counter", counter, stream)
        apply_op(counter.numpy().view(COUNTER_DTYPE)[0:1], op, base, step)

    def fill_zero(self, dst: Tensor, stream: int) -> None:
        if trace.ENABLED:
            _trace("fill_zero", dst, stream)
        dst.allocation.host_bytes()[dst.offset:dst.offset + dst.nbytes] = 0

    def copy(self, dst: Tensor, src: Tensor, stream: int) -> None:
        if trace.ENABLED:
            _trace("copy", dst, stream)
        dst.allocation.host_bytes()[dst.offset:dst.offset + dst.nbytes] = \
            src.allocation.host_bytes()[src.offset:src.offset + src.nbytes]

    def norm_squared(self, x: Tensor, out: Tensor, accumulate: bool, stream: int) -> None:
        if trace.ENABLED:
            _trace("norm_squared", x, stream)
        o = out.numpy().reshape(-1)
        acc = "float64" if o.dtype == np.float64 else "float32"
        total = reference.norm_squared(x.numpy().reshape(-1), accum=acc)
        o[0] = (o[0] if accumulate else 0) + total
