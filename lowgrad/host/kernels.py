"""The host backend's kernels: the numpy reference applied in place to host tensors (eager)."""
from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import numpy as np

from lowgrad.base import trace
from lowgrad.buffers.tensor import Tensor
from lowgrad.contracts.kernels import Elementwise, Kernels, SeedSource, StatsSink, StatsTarget
from lowgrad.sr import reference
from lowgrad.sr.seedcounter import COUNTER_DTYPE, Rounding, apply_op


def _roundings(source: SeedSource) -> list[Rounding]:
    """The fixed seeds' roundings, or those a counter's ``(layer, lanes)`` give right now."""
    counter, layer, values = source
    return [Rounding(s) for s in values] if counter is None else counter.host_roundings(layer, values)


def _counter(counter: Any, field: str) -> int:
    """A seed counter's ``field`` now (the host backend runs work when it is queued)."""
    return int(counter.tensor.numpy().view(COUNTER_DTYPE)[0][field])


def _stats_slots(sink: StatsSink, columns: list[int], sets: list[tuple[int, int, int]]) -> np.ndarray:
    """A launch's measurements of ``len(columns)`` tensors, one set each of ``sets`` (``(set, row,
    micro)``: :meth:`StatsSink.add_sets`), kept until the sink's finish writes them as the CUDA
    backend's slots are; a job per tensor and set in the sink."""
    slots = np.full((len(sets), len(columns), 3), np.nan)
    sink.jobs.extend((slots, s, t, column, row, micro) for t, column in enumerate(columns) for s, row, micro in sets)
    return slots


def _measure(tensors: list[Tensor]) -> np.ndarray:
    """:func:`lowgrad.sr.reference.grad_stats` of each tensor, one row each."""
    return np.array([reference.grad_stats(t.numpy().reshape(-1)) for t in tensors], np.float64).reshape(-1, 3)


def _trace(name: str, t: Tensor, stream: int) -> None:
    """The trace line of a host kernel writing ``t`` (CUDA's launches trace grid and block)."""
    trace.log("kernel", name, dst=t.name, numel=t.numel, dtype=t.dtype.name, stream=hex(stream))


class Twin:
    """The host twin of an elementwise kernel (:class:`~lowgrad.contracts.kernels.Elementwise`): its
    reference function applied to the kernel's arguments, the result written to ``dst``. Called
    like the contract's method (the rounding of ``seed``), or through :meth:`apply` with a
    rounding (a bound launch's, maybe from a seed counter)."""

    def __init__(self, kernel: Elementwise[...]) -> None:
        self.name, self.tensors = kernel.name, kernel.tensors
        self.fn: Callable[..., np.ndarray] = getattr(reference, kernel.name)
        takes = inspect.signature(self.fn).parameters
        # the kernel's arguments the reference reads (dst only where it is an input), by name
        self.args = tuple(a for a in kernel.args if a in takes and a != "seed")
        self.out_dtype = "dst" not in takes
        self.__signature__ = kernel.signature

    def __call__(self, *args: Any) -> None:
        *values, stream = args
        named = dict(zip(self.__signature__.parameters, values))
        self.apply(named, Rounding(named["seed"]), stream)

    def apply(self, named: dict[str, Any], rd: Rounding, stream: int) -> None:
        """The kernel on ``named`` arguments (those of the contract's method) with rounding ``rd``."""
        dst = named["dst"]
        if trace.ENABLED:
            _trace(self.name, dst, stream)
        kw = {a: named[a].numpy().reshape(-1) if a in self.tensors else named[a] for a in self.args}
        if self.out_dtype:
            kw["out_dtype"] = dst.dtype
        dst.numpy().reshape(-1)[:] = self.fn(**kw, seed=rd.seed, shift=rd.shift, nearest=rd.nearest)


class HostKernels(Kernels):
    """The :class:`~lowgrad.contracts.kernels.Kernels` contract on host memory, eagerly: arguments
    arrive checked by :mod:`lowgrad.ops`; each call (and each bound launch) completes before
    returning, whatever the stream."""

    def build(self, kernel: Elementwise[...]) -> Twin:
        return Twin(kernel)

    def bind_add_sr(self, dst: Tensor, a: Tensor, b: Tensor, scale: float, index_offset: int
                    ) -> Callable[[int, int], None]:
        return lambda seed, stream: self.add_sr(dst, a, b, scale, seed, index_offset, stream)

    def bind_add_sr_multi(self, items: list[tuple[Tensor, Tensor, Tensor, int]], scale: float, seeds: SeedSource,
                          stats: StatsTarget | None = None) -> Callable[[int], None]:
        twin: Twin = self.__dict__["add_sr"]
        counter = seeds[0]
        slots = None if stats is None else _stats_slots(stats[0], stats[1], stats[0].add_sets())

        def run(stream: int) -> None:
            if slots is not None:  # measured before the adds (a may be dst), as the device does
                micro = _counter(counter, "micro")
                if 1 <= micro < len(slots):
                    slots[micro] = _measure([b for _, _, b, _ in items])
                if micro == 1:
                    slots[0] = _measure([a for _, a, _, _ in items])
            for (dst, a, b, off), rd in zip(items, _roundings(seeds)):
                twin.apply({"dst": dst, "a": a, "b": b, "scale": scale, "index_offset": off}, rd, stream)
        return run

    def bind_grad_stats(self, tensors: list[Tensor], sink: StatsSink, columns: list[int], row: int,
                        per_micro: bool) -> Callable[[int], None]:
        slots = _stats_slots(sink, columns, sink.grad_stats_sets(row, per_micro))

        def run(stream: int) -> None:
            if trace.ENABLED:
                _trace("grad_stats", sink.out, stream)
            s = _counter(sink.counter, "micro") if per_micro else 0
            if s < len(slots):
                slots[s] = _measure(tensors)
        return run

    def bind_stats_finish(self, sink: StatsSink) -> Callable[[int], None]:
        jobs = list(sink.jobs)

        def run(stream: int) -> None:
            if trace.ENABLED:
                _trace("grad_stats_finish", sink.out, stream)
            done = None if sink.counter is None else _counter(sink.counter, "done")
            out = sink.out.numpy()
            for slots, s, t, column, row, micro in jobs:
                if done is None or micro < done:
                    out[row, column] = slots[s, t]
        return run

    def bind_reduce_sr(self, dst: Tensor, src: Tensor, n_shards: int, skip: int, scale: float, accumulate: bool,
                       index_offset: int, seeds: SeedSource) -> Callable[[int], None]:
        twin: Twin = self.__dict__["reduce_sr"]
        named = {"dst": dst, "src": src, "n_shards": n_shards, "skip": skip, "scale": scale, "accumulate": accumulate,
                 "index_offset": index_offset}
        return lambda stream: twin.apply(named, _roundings(seeds)[0], stream)

    def bind_quantize_i8_sr(self, q: Tensor, scales: Tensor, x: Tensor, index_offset: int,
                            seeds: SeedSource) -> Callable[[int], None]:
        def run(stream: int) -> None:
            if trace.ENABLED:
                _trace("quantize_i8_sr", q, stream)
            rd = _roundings(seeds)[0]
            qv, sv = reference.quantize_i8_sr(x.numpy().reshape(-1), rd.seed, index_offset, rd.shift, rd.nearest)
            q.numpy().reshape(-1)[:] = qv.view(np.uint8)
            scales.numpy().reshape(-1)[:] = sv
        return run

    def bind_dequant_reduce_sr(self, dst: Tensor, q: Tensor, scales: Tensor, n_shards: int, skip: int,
                               scale: float, index_offset: int, seeds: SeedSource) -> Callable[[int], None]:
        def run(stream: int) -> None:
            if trace.ENABLED:
                _trace("dequant_reduce_sr", dst, stream)
            rd = _roundings(seeds)[0]
            d = dst.numpy().reshape(-1)
            d[:] = reference.dequant_reduce_sr(d, q.numpy().reshape(-1), scales.numpy().reshape(-1), n_shards, skip,
                                               scale, rd.seed, index_offset, rd.shift, rd.nearest)
        return run

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
