"""The host backend's kernels: the numpy reference applied in place to host tensors (eager)."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from lowgrad.core import trace
from lowgrad.core.kernels import Kernels, SeedSource
from lowgrad.core.tensor import Tensor
from lowgrad.sr import reference
from lowgrad.sr.seedcounter import COUNTER_DTYPE, Rounding, apply_op


def _roundings(source: SeedSource) -> list[Rounding]:
    """The fixed seeds' roundings, or those a counter's ``(layer, lanes)`` give right now."""
    counter, layer, values = source
    return [Rounding(s) for s in values] if counter is None else counter.host_roundings(layer, values)


def _trace(name: str, t: Tensor, stream: int) -> None:
    """The trace line of a host kernel writing ``t`` (CUDA's launches trace grid and block)."""
    trace.log("kernel", name, dst=t.name, numel=t.numel, dtype=t.dtype.name, stream=hex(stream))


class HostKernels(Kernels):
    """The :class:`~lowgrad.core.kernels.Kernels` contract on host memory, eagerly: arguments
    arrive checked by :mod:`lowgrad.ops`; each call (and each bound launch) completes before
    returning, whatever the stream."""

    def add_sr(self, dst: Tensor, a: Tensor, b: Tensor, scale: float, seed: int, index_offset: int,
               stream: int) -> None:
        self._add_sr(dst, a, b, scale, Rounding(seed), index_offset, stream)

    def _add_sr(self, dst: Tensor, a: Tensor, b: Tensor, scale: float, rd: Rounding, index_offset: int,
                stream: int) -> None:
        if trace.ENABLED:
            _trace("add_sr", dst, stream)
        out = reference.add_sr(a.numpy().reshape(-1), b.numpy().reshape(-1), scale, rd.seed, index_offset, dst.dtype,
                               rd.shift, rd.nearest)
        dst.numpy().reshape(-1)[:] = out

    def reduce_sr(self, dst: Tensor, src: Tensor, n_shards: int, skip: int, scale: float, accumulate: bool,
                  seed: int, index_offset: int, stream: int) -> None:
        self._reduce_sr(dst, src, n_shards, skip, scale, accumulate, Rounding(seed), index_offset, stream)

    def _reduce_sr(self, dst: Tensor, src: Tensor, n_shards: int, skip: int, scale: float, accumulate: bool,
                   rd: Rounding, index_offset: int, stream: int) -> None:
        if trace.ENABLED:
            _trace("reduce_sr", dst, stream)
        d = dst.numpy().reshape(-1)
        d[:] = reference.reduce_sr(d, src.numpy().reshape(-1), n_shards, skip, scale, accumulate, rd.seed,
                                   index_offset, rd.shift, rd.nearest)

    def bind_add_sr(self, dst: Tensor, a: Tensor, b: Tensor, scale: float, index_offset: int
                    ) -> Callable[[int, int], None]:
        return lambda seed, stream: self.add_sr(dst, a, b, scale, seed, index_offset, stream)

    def bind_add_sr_multi(self, items: list[tuple[Tensor, Tensor, Tensor, int]], scale: float, seeds: SeedSource
                          ) -> Callable[[int], None]:
        def run(stream: int) -> None:
            for (dst, a, b, off), rd in zip(items, _roundings(seeds)):
                self._add_sr(dst, a, b, scale, rd, off, stream)
        return run

    def bind_reduce_sr(self, dst: Tensor, src: Tensor, n_shards: int, skip: int, scale: float, accumulate: bool,
                       index_offset: int, seed: SeedSource) -> Callable[[int], None]:
        return lambda stream: self._reduce_sr(dst, src, n_shards, skip, scale, accumulate, _roundings(seed)[0],
                                              index_offset, stream)

    def seed_counter(self, counter: Tensor, op: int, base: int, step: int, mode: int, stream: int) -> None:
        if trace.ENABLED:
            _trace("seed_counter", counter, stream)
        apply_op(counter.numpy().view(COUNTER_DTYPE)[0:1], op, base, step, mode)

    def fill(self, dst: Tensor, byte: int, stream: int) -> None:
        if trace.ENABLED:
            _trace("fill", dst, stream)
        dst.allocation.host_bytes()[dst.offset:dst.offset + dst.nbytes] = byte

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
