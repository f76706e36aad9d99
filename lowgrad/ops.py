"""The kernels of docs/design.md on lowgrad tensors of either backend, all asynchronous on
``stream`` (None: the device's default stream).

Every argument is checked here, once for both backends, before anything is queued; the backend
(``tensor.device.kernels``) then does the work: NVRTC-compiled kernels on a CUDA device, the numpy
reference on the host backend, bit for bit the same results.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lowgrad.base.dtypes import DType, bf16, byte, fp8_e4m3, fp16, fp32, fp64
from lowgrad.base.integers import integer
from lowgrad.base.limits import U64
from lowgrad.buffers import capture
from lowgrad.buffers.streams import StreamLike, stream_handle
from lowgrad.buffers.tensor import Tensor
from lowgrad.contracts.backend import check_copy
from lowgrad.contracts.kernels import SeedSource, StatsSink
from lowgrad.sr.checks import (
    F32_MAX,
    SR_DTYPES,
    check_accumulate,
    check_index_offset,
    check_scale,
    check_seed,
    check_shards,
    check_u32,
)
from lowgrad.sr.reference import QBLOCK, check_reduce_sr_args
from lowgrad.sr.seedcounter import SeedCounter

__all__ = ["NORM_OUT_DTYPES", "SR_DTYPES", "add_sr", "bind_add_sr", "bind_add_sr_multi", "bind_grad_stats",
           "bind_reduce_sr", "bind_stats_finish", "check_accumulate", "check_scale", "check_seed",
           "check_seed_source", "copy", "copy_on_cores", "fill_nan", "fill_zero", "norm_squared", "reduce_sr",
           "scale_sr", "stats_sink"]

Bound = Callable[[int, int], None]  # f(seed, stream handle): a launch packed once but for the seed
NORM_OUT_DTYPES = (fp32, fp64)
NAN_DTYPES = (bf16, fp16, fp32, fp64, fp8_e4m3)  # all bytes 0xFF is a NaN in each


def _tensor(t: Any, what: str) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{what} must be a lowgrad Tensor, got {type(t).__name__}")
    return t


def _dtype_in(t: Tensor, what: str, allowed: tuple[DType, ...]) -> None:
    if t.dtype not in allowed:
        names = ", ".join(d.name for d in allowed)
        raise TypeError(f"{what} {t.name!r} has dtype {t.dtype.name}; expected one of {names}")


def _same_device(ref: Tensor, *others: tuple[Tensor, str]) -> Any:
    dev = ref.device
    for t, what in others:
        if t.device is not dev:
            raise ValueError(f"{what} {t.name!r} lives on {t.device!r}, but dst {ref.name!r} on {dev!r}")
    return dev


def _kernel_memory(dev: Any, *ts: tuple[Tensor, str]) -> None:
    for t, what in ts:
        if t.kind not in dev.kernel_kinds:
            raise ValueError(f"{what} {t.name!r} is in {t.kind} memory, which kernels on {dev!r} cannot access "
                             "(use device or pinned memory)")


def _overlap(x: Tensor, y: Tensor) -> bool:
    if x.allocation is not y.allocation or not x.nbytes or not y.nbytes:
        return False
    return x.offset < y.offset + y.nbytes and y.offset < x.offset + x.nbytes


def _alias_only_exactly(kernel: str, dst: Tensor, a: Tensor) -> None:
    """``dst`` may be ``a`` itself (same memory and dtype: each element is read before it is
    written), but not overlap it otherwise."""
    if _overlap(dst, a) and (dst.offset != a.offset or dst.dtype is not a.dtype):
        raise ValueError(f"{kernel}: dst {dst.name!r} may alias a {a.name!r} only exactly (same memory and dtype)")


def _check_add_sr(dst: Tensor, a: Tensor, b: Tensor, scale: Any, seed: Any, index_offset: Any
                  ) -> tuple[Any, float, int, int]:
    """add_sr's checks (the common case inline: this is the launch hot path; anything unusual
    goes through the descriptive checks). Returns (device, scale, seed, index_offset)."""
    if type(dst) is not Tensor or type(a) is not Tensor or type(b) is not Tensor:
        for t, what in ((dst, "dst"), (a, "a"), (b, "b")):
            _tensor(t, what)
    ad, aa, ab = dst._alloc, a._alloc, b._alloc
    dev = ad.device
    n = dst.numel
    kinds = dev.kernel_kinds
    if (dst.dtype not in SR_DTYPES or a.dtype not in SR_DTYPES or b.dtype not in SR_DTYPES
            or aa.device is not dev or ab.device is not dev or a.numel != n or b.numel != n
            or ad.kind not in kinds or aa.kind not in kinds or ab.kind not in kinds):
        for t, what in ((dst, "dst"), (a, "a"), (b, "b")):
            _dtype_in(t, what, SR_DTYPES)
        _same_device(dst, (a, "a"), (b, "b"))
        if not (dst.numel == a.numel == b.numel):
            raise ValueError(f"add_sr size mismatch: dst {dst.shape}, a {a.shape}, b {b.shape}")
        _kernel_memory(dev, (dst, "dst"), (a, "a"), (b, "b"))
    if ad is ab and _overlap(dst, b):
        raise ValueError(f"add_sr: dst {dst.name!r} may not overlap b {b.name!r}")
    if ad is aa:
        _alias_only_exactly("add_sr", dst, a)
    if (type(seed) is not int or type(index_offset) is not int
            or not (0 <= seed < U64 and 0 <= index_offset < U64 and index_offset + n <= U64)):
        seed, index_offset = check_seed(seed), check_index_offset(index_offset, n)
    if type(scale) is not float or not -F32_MAX <= scale <= F32_MAX:
        scale = check_scale(scale)
    return dev, scale, seed, index_offset


def add_sr(dst: Tensor, a: Tensor, b: Tensor, scale: float = 1.0, seed: int = 0, index_offset: int = 0,
           stream: StreamLike = None) -> None:
    """``dst = SR(scale * (a + b))`` elementwise in float32, on ``stream``.

    fp32 or bf16 each; equal element counts; ``dst`` may alias ``a`` exactly but may not overlap
    ``b`` or partially overlap ``a``. The noise of element ``i`` uses index ``index_offset + i``.
    """
    h = stream if type(stream) is int and stream >= 0 else stream_handle(stream)
    dev, scale, seed, index_offset = _check_add_sr(dst, a, b, scale, seed, index_offset)
    if capture.active[0]:
        capture.keep_tensors(dst, a, b)
    dev.kernels.add_sr(dst, a, b, scale, seed, index_offset, h)


def bind_add_sr(dst: Tensor, a: Tensor, b: Tensor, scale: float = 1.0, index_offset: int = 0) -> Bound:
    """``add_sr`` with everything but the seed checked and packed once: the returned callable
    ``f(seed, stream)`` queues ``dst = SR(scale * (a + b))`` with that seed on ``stream`` (an
    int handle). It raises ClosedError once any of the tensors was closed."""
    dev, scale, _, index_offset = _check_add_sr(dst, a, b, scale, 0, index_offset)
    return dev.kernels.bind_add_sr(dst, a, b, scale, index_offset)


def scale_sr(dst: Tensor, a: Tensor, scale: float = 1.0, seed: int = 0, index_offset: int = 0,
             stream: StreamLike = None) -> None:
    """``dst = SR(a * scale)`` elementwise in float32, on ``stream``: :func:`add_sr`'s rounding
    without the sum.

    fp32 or bf16 each; equal element counts; ``dst`` may alias ``a`` exactly but may not partially
    overlap it. The noise of element ``i`` uses index ``index_offset + i``.
    """
    h = stream_handle(stream)
    for t, what in ((dst, "dst"), (a, "a")):
        _tensor(t, what)
        _dtype_in(t, what, SR_DTYPES)
    dev = _same_device(dst, (a, "a"))
    if dst.numel != a.numel:
        raise ValueError(f"scale_sr size mismatch: dst {dst.shape}, a {a.shape}")
    _kernel_memory(dev, (dst, "dst"), (a, "a"))
    _alias_only_exactly("scale_sr", dst, a)
    scale, seed, index_offset = check_scale(scale), check_seed(seed), check_index_offset(index_offset, dst.numel)
    capture.keep_tensors(dst, a)
    dev.kernels.scale_sr(dst, a, scale, seed, index_offset, h)


def check_seed_source(seeds: Any, count: int, device: Any) -> SeedSource:
    """Validate ``seeds`` for ``count`` SR uses on ``device``: ``count`` fixed 64-bit seeds (an int
    when ``count`` is 1), or ``(counter, layer, lanes)`` with a :class:`SeedCounter` of ``device``
    whose per-use seeds of ``(layer, lane)`` the kernels read when they run (``lanes``: an int,
    or ``count`` ints, each ``2 * tensor + phase``). Returns the backends' form,
    :data:`~lowgrad.contracts.kernels.SeedSource`: ``(counter, layer, lanes)`` or ``(None, 0, seeds)``
    with one entry per use."""
    if isinstance(seeds, tuple):
        if len(seeds) != 3 or not isinstance(seeds[0], SeedCounter):
            raise TypeError("seeds must be seed ints or (SeedCounter, layer, lanes)")
        counter, layer, lanes = seeds
        if counter.device is not device:
            raise ValueError(f"seed counter lives on {counter.device!r}, the tensors on {device!r}")
        one_each: list[int] = list(lanes) if isinstance(lanes, (list, tuple)) else [lanes] * count
        if isinstance(lanes, (list, tuple)) and len(lanes) != count:
            raise ValueError(f"{len(lanes)} lanes for {count} tensors")
        for v, what in ((layer, "layer"), *((x, "lane") for x in one_each)):
            check_u32(v, f"seed counter {what}")
        return counter, int(layer), [int(x) for x in one_each]
    many = [seeds] if count == 1 and not isinstance(seeds, (list, tuple)) else seeds
    if not isinstance(many, (list, tuple)) or len(many) != count:
        raise ValueError(f"need {count} seeds, got {seeds!r}")
    return None, 0, [check_seed(v) for v in many]


def bind_add_sr_multi(items: list[tuple[Tensor, Tensor, Tensor, int]], seeds: Any, scale: float = 1.0,
                      stats: tuple[StatsSink, list[int]] | None = None) -> Callable[[int], None]:
    """Many ``add_sr`` of one dtype triple (``dst`` of ``a``'s dtype) checked and packed once:
    ``items`` are ``(dst, a, b, index_offset)``, ``seeds`` one seed per item or ``(counter,
    layer, lanes)`` (see :func:`check_seed_source`). The returned ``f(stream)`` queues all of
    them on ``stream`` (an int handle) in as few launches as the backend can (one per 16
    tensors on CUDA). Results equal separate :func:`add_sr` calls with those seeds.

    ``stats=(sink, columns)`` (:func:`stats_sink`; seeds from the sink's counter): the same
    launches measure each item's ``b`` as :func:`bind_grad_stats` does, for row ``m`` of the
    sink's ``out`` (the counter's micro-step when the work runs, from micro-step 1, below the
    sink's ``micro_steps`` and ``rows``) at column ``columns[i]``, and at micro-step 1 its ``a``
    before the add for row 0 (a shard that accumulates then holds micro-step 0's gradient); the
    sink's finish writes the rows."""
    if not items:
        raise ValueError("bind_add_sr_multi needs at least one (dst, a, b, index_offset)")
    if stats is not None:
        if not isinstance(stats, tuple) or len(stats) != 2 or not isinstance(stats[0], StatsSink):
            raise TypeError(f"stats must be (sink, columns) with a sink of ops.stats_sink, got {stats!r}")
        if not (isinstance(seeds, tuple) and seeds and seeds[0] is stats[0].counter is not None):
            raise ValueError("bind_add_sr_multi: stats= needs seeds from the sink's SeedCounter (its micro-step "
                             "picks the row)")
        columns = _check_columns(stats[0], stats[1], len(items), items[0][0].device, "bind_add_sr_multi")
    d0, a0, b0, _ = items[0]
    for dst, a, b, off in items:
        _check_add_sr(dst, a, b, scale, 0, off)
        if dst.device is not d0.device or (dst.dtype, a.dtype, b.dtype) != (d0.dtype, d0.dtype, b0.dtype):
            raise TypeError(f"bind_add_sr_multi: {dst.name!r} is ({dst.dtype.name}, {a.dtype.name}, {b.dtype.name}) "
                            f"on {dst.device!r}; every item needs ({d0.dtype.name}, {d0.dtype.name}, "
                            f"{b0.dtype.name}) on {d0.device!r}")
    seeds = check_seed_source(seeds, len(items), d0.device)
    target = None if stats is None else (stats[0], columns)
    return d0.device.kernels.bind_add_sr_multi(list(items), check_scale(scale), seeds, target)


def stats_sink(out: Tensor, counter: SeedCounter | None = None, micro_steps: int | None = None) -> StatsSink:
    """Where launches bound with statistics put them: ``out``, a float64 tensor of shape ``(rows,
    columns, 3)`` in memory the kernels can write, whose (row, column) entries take a tensor's
    ``(sum of squares, non-finite count, largest finite |x|)``; ``counter``, the
    :class:`SeedCounter` whose micro-step picks the rows that follow it; ``micro_steps``, the
    most micro-steps a step has (default ``rows``): the launches keep what they measure at each
    micro-step below it until the step ends, in memory that grows with it. Bind the launches
    (:func:`bind_add_sr_multi` with ``stats=``, :func:`bind_grad_stats`), then
    :func:`bind_stats_finish`, whose launch writes what they measured once the counter's step is
    complete (after its ``next_step``)."""
    _tensor(out, "out")
    if out.dtype is not fp64 or out.ndim != 3 or out.shape[2] != 3:
        raise TypeError(f"stats_sink: out {out.name!r} must be fp64 of shape (rows, columns, 3), got "
                        f"{out.dtype.name} {out.shape}")
    if out.shape[0] == 0:  # the launches' slot sets follow the rows: none would leave nowhere to write
        raise ValueError(f"stats_sink: out {out.name!r} needs at least one row, got shape {out.shape}")
    _kernel_memory(out.device, (out, "out"))
    if counter is not None and (not isinstance(counter, SeedCounter) or counter.device is not out.device):
        raise TypeError(f"stats_sink: counter must be a SeedCounter of {out.device!r}, got {counter!r}")
    m = out.shape[0] if micro_steps is None else integer("micro_steps", micro_steps)
    if m < 1:
        raise ValueError(f"stats_sink: micro_steps must be at least 1, got {m}")
    return StatsSink(out, counter, m)


def _check_columns(sink: StatsSink, columns: Any, count: int, device: Any, what: str) -> list[int]:
    """``count`` columns of the sink's ``out``, which lives on ``device``."""
    if sink.out.device is not device:
        raise ValueError(f"{what}: the sink's out {sink.out.name!r} lives on {sink.out.device!r}, the tensors on "
                         f"{device!r}")
    if not isinstance(columns, (list, tuple)) or len(columns) != count:
        raise ValueError(f"{what}: need one column per tensor ({count}), got {columns!r}")
    out = [integer("a column", c) for c in columns]
    for c in out:
        if c not in range(sink.out.shape[1]):
            raise ValueError(f"{what}: column {c} outside [0, {sink.out.shape[1]})")
    return out


def bind_grad_stats(tensors: list[Tensor], sink: StatsSink, columns: list[int], row: int,
                    per_micro: bool = False) -> Callable[[int], None]:
    """The gradient statistics of ``tensors`` (fp32 or bf16, one dtype, one device) checked and
    packed once: the returned ``f(stream)`` measures ``(sum of squares, non-finite count, largest
    finite |x|)`` of ``tensors[i]`` on ``stream`` (an int handle) for row ``row`` (plus the
    sink counter's micro-step when the work runs, with ``per_micro``: a micro-step at or past the
    sink's ``micro_steps``, or whose row is past the end, is not measured), column
    ``columns[i]`` of the sink's ``out``; the sink's finish
    (:func:`bind_stats_finish`) writes the rows. The values are
    :func:`lowgrad.sr.reference.grad_stats`' (the device sums in an order fixed by its launch
    shape: the same bits from run to run, the sum of squares within a relative 1e-5 of the
    reference's, the count and the largest |x| exact)."""
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise ValueError("bind_grad_stats needs a non-empty list of tensors")
    if not isinstance(sink, StatsSink):
        raise TypeError(f"bind_grad_stats: sink must come from ops.stats_sink, got {type(sink).__name__}")
    t0 = _tensor(tensors[0], "tensors[0]")
    for i, t in enumerate(tensors):
        _tensor(t, f"tensors[{i}]")
        _dtype_in(t, f"tensors[{i}]", SR_DTYPES)
        if t.dtype is not t0.dtype or t.device is not t0.device:
            raise TypeError(f"bind_grad_stats: {t.name!r} is {t.dtype.name} on {t.device!r}; every tensor needs "
                            f"{t0.dtype.name} on {t0.device!r}")
        _kernel_memory(t.device, (t, f"tensors[{i}]"))
    cols = _check_columns(sink, columns, len(tensors), t0.device, "bind_grad_stats")
    if integer("row", row) not in range(sink.out.shape[0]):
        raise ValueError(f"bind_grad_stats: row {row} outside [0, {sink.out.shape[0]})")
    if not isinstance(per_micro, bool):
        raise TypeError(f"bind_grad_stats: per_micro must be a bool, got {per_micro!r}")
    if per_micro and sink.counter is None:
        raise ValueError("bind_grad_stats: per_micro=True needs a sink with a seed counter")
    return t0.device.kernels.bind_grad_stats(list(tensors), sink, cols, int(row), per_micro)


def bind_stats_finish(sink: StatsSink) -> Callable[[int], None]:
    """The launch that writes the rows of every launch bound into ``sink`` so far: the returned
    ``f(stream)`` queues it on ``stream`` (an int handle), after those launches on their stream.
    With a counter, it writes what the counter's last completed step measured (queue it after
    the counter's ``next_step``): the rows of the micro-steps that step had; without one, the
    rows the launches measured last."""
    if not isinstance(sink, StatsSink):
        raise TypeError(f"bind_stats_finish: sink must come from ops.stats_sink, got {type(sink).__name__}")
    return sink.out.device.kernels.bind_stats_finish(sink)


def _check_reduce_sr(dst: Tensor, src: Tensor, n_shards: Any, skip: Any, scale: Any, accumulate: Any, seed: Any,
                     index_offset: Any) -> tuple[Any, int, int, float, bool, int, int]:
    """reduce_sr's checks (:func:`lowgrad.sr.reference.check_reduce_sr_args` after the tensor ones);
    returns (device, n_shards, skip, scale, accumulate, seed, index_offset)."""
    _tensor(dst, "dst")
    _tensor(src, "src")
    _dtype_in(dst, "dst", SR_DTYPES)
    _dtype_in(src, "src", SR_DTYPES)
    dev = _same_device(dst, (src, "src"))
    checked = check_reduce_sr_args(dst.numel, src.numel, dst.dtype, src.dtype, n_shards, skip, scale, accumulate,
                                   seed, index_offset)
    if _overlap(dst, src):
        raise ValueError(f"reduce_sr: dst {dst.name!r} may not overlap src {src.name!r}")
    _kernel_memory(dev, (dst, "dst"), (src, "src"))
    return (dev, *checked)


def reduce_sr(dst: Tensor, src: Tensor, n_shards: int, skip: int = -1, scale: float = 1.0,
              accumulate: bool = False, seed: int = 0, index_offset: int = 0, stream: StreamLike = None) -> None:
    """``dst = SR(scale * ((dst if accumulate else 0) + sum_{k != skip} src[k]))`` on ``stream``.

    ``src`` holds ``n_shards`` consecutive blocks, each of ``dst.numel`` elements; ``skip`` is a
    block index or -1. Sums run in float32 in block order starting from +0.0.
    """
    h = stream if type(stream) is int and stream >= 0 else stream_handle(stream)
    dev, n_shards, skip, scale, accumulate, seed, index_offset = _check_reduce_sr(
        dst, src, n_shards, skip, scale, accumulate, seed, index_offset)
    capture.keep_tensors(dst, src)
    dev.kernels.reduce_sr(dst, src, n_shards, skip, scale, accumulate, seed, index_offset, h)


def bind_reduce_sr(dst: Tensor, src: Tensor, n_shards: int, skip: int = -1, scale: float = 1.0,
                   accumulate: bool = False, index_offset: int = 0, seeds: Any = 0) -> Callable[[int], None]:
    """``reduce_sr`` checked and packed once, ``seeds`` one seed int or ``(counter, layer, lane)``
    (see :func:`check_seed_source`); the returned ``f(stream)`` queues it on ``stream`` (an int
    handle)."""
    dev, n_shards, skip, scale, accumulate, _, index_offset = _check_reduce_sr(
        dst, src, n_shards, skip, scale, accumulate, 0, index_offset)
    return dev.kernels.bind_reduce_sr(dst, src, n_shards, skip, scale, accumulate, index_offset,
                                      check_seed_source(seeds, 1, dev))


def _check_i8_slots(call: str, dst: Tensor, q: Tensor, scales: Tensor, slots: int) -> Any:
    """The 8-bit hop's tensors: ``q`` (byte) of ``slots`` x ``dst.numel`` elements, ``scales``
    (fp32) of ``slots`` x one per QBLOCK of them, ``dst`` fp32 or bf16, none overlapping, on one
    device in kernel memory; returns the device."""
    name = "x" if call == "quantize_i8_sr" else "dst"
    for t, what in ((dst, name), (q, "q"), (scales, "scales")):
        _tensor(t, what)
    _dtype_in(dst, name, SR_DTYPES)
    _dtype_in(q, "q", (byte,))
    _dtype_in(scales, "scales", (fp32,))
    n, blocks = dst.numel, -(-dst.numel // QBLOCK)
    if q.numel != slots * n or scales.numel != slots * blocks:
        raise ValueError(f"{call}: q has {q.numel} and scales {scales.numel} elements; {slots} slot(s) of "
                         f"{n} elements need {slots * n} and {slots * blocks} (one scale per {QBLOCK})")
    dev = _same_device(dst, (q, "q"), (scales, "scales"))
    for a, b in ((dst, q), (dst, scales), (q, scales)):
        if _overlap(a, b):
            raise ValueError(f"{call}: {a.name!r} may not overlap {b.name!r}")
    _kernel_memory(dev, (dst, "dst"), (q, "q"), (scales, "scales"))
    return dev


def bind_quantize_i8_sr(q: Tensor, scales: Tensor, x: Tensor, index_offset: int = 0,
                        seeds: Any = 0) -> Callable[[int], None]:
    """:func:`lowgrad.sr.reference.quantize_i8_sr` of ``x`` into ``q`` (byte, ``x.numel``) and
    ``scales`` (fp32, one per ``QBLOCK`` elements), checked and packed once; ``seeds`` one seed int or
    ``(counter, layer, lane)``. The returned ``f(stream)`` queues it on an int handle."""
    dev = _check_i8_slots("quantize_i8_sr", x, q, scales, 1)
    index_offset = check_index_offset(index_offset, x.numel)
    return dev.kernels.bind_quantize_i8_sr(q, scales, x, index_offset, check_seed_source(seeds, 1, dev))


def bind_dequant_reduce_sr(dst: Tensor, q: Tensor, scales: Tensor, n_shards: int, skip: int = -1,
                           scale: float = 1.0, index_offset: int = 0, seeds: Any = 0) -> Callable[[int], None]:
    """:func:`lowgrad.sr.reference.dequant_reduce_sr` into ``dst`` (its value added first) from
    ``n_shards`` slots of ``q`` and ``scales`` (:func:`bind_quantize_i8_sr`'s), checked and packed
    once, ``skip`` a slot or -1."""
    n_shards, skip = check_shards(n_shards, skip)
    dev = _check_i8_slots("dequant_reduce_sr", dst, q, scales, n_shards)
    scale, index_offset = check_scale(scale), check_index_offset(index_offset, dst.numel)
    return dev.kernels.bind_dequant_reduce_sr(dst, q, scales, n_shards, skip, scale, index_offset,
                                              check_seed_source(seeds, 1, dev))


def fill_zero(dst: Tensor, stream: StreamLike = None) -> None:
    """Set every byte of ``dst`` to zero on ``stream``."""
    _fill(dst, 0, stream)


def fill_nan(dst: Tensor, stream: StreamLike = None) -> None:
    """Set every element of the floating-point tensor ``dst`` to NaN on ``stream`` (every byte
    0xFF: a NaN in each of lowgrad's float dtypes, so one byte fill serves them all)."""
    _tensor(dst, "dst")
    _dtype_in(dst, "dst", NAN_DTYPES)
    _fill(dst, 0xFF, stream)


def _fill(dst: Tensor, byte: int, stream: StreamLike) -> None:
    h = stream_handle(stream)
    _tensor(dst, "dst")
    _kernel_memory(dst.device, (dst, "dst"))
    dst.ptr  # noqa: B018 - the property raises on a closed tensor before anything is queued
    capture.keep_tensors(dst)
    dst.device.kernels.fill(dst, byte, h)


def copy(dst: Tensor, src: Tensor, stream: StreamLike = None) -> None:
    """Copy ``src`` into ``dst`` (same dtype and element count; device, pinned or host memory in
    any direction) on ``stream``. ``dst`` and ``src`` may not overlap unless they are the same
    memory (then the copy leaves it unchanged); a partial overlap is a ValueError (the CUDA copy
    engines do not order overlapping bytes)."""
    _tensor(dst, "dst")
    _tensor(src, "src")
    if _overlap(dst, src) and (dst.offset != src.offset or dst.nbytes != src.nbytes):
        raise ValueError(f"copy: dst {dst.name!r} and src {src.name!r} partially overlap (bytes "
                         f"[{dst.offset}, {dst.offset + dst.nbytes}) and [{src.offset}, {src.offset + src.nbytes}) "
                         "of one allocation)")
    dst.device.copy(dst, src, stream)


def copy_on_cores(dst: Tensor, src: Tensor, stream: StreamLike = None) -> None:
    """Copy ``src`` into ``dst`` (same dtype and element count, one device, memory its kernels can
    access, no overlap) on ``stream`` with a kernel on the GPU's cores, where :func:`copy` uses a
    copy engine: a copy engine is one queue shared by every stream of the process, so a copy queued
    there can wait behind another rank's work (the loopback communicator's graph replays)."""
    h = stream_handle(stream)
    _tensor(dst, "dst")
    check_copy(dst.device, dst, src)
    if _overlap(dst, src):
        raise ValueError(f"copy_on_cores: dst {dst.name!r} may not overlap src {src.name!r}")
    _kernel_memory(dst.device, (dst, "dst"), (src, "src"))
    dst.ptr, src.ptr  # noqa: B018 - the properties raise on a closed tensor before anything is queued
    capture.keep_tensors(dst, src)
    dst.device.kernels.copy(dst, src, h)


def norm_squared(x: Tensor, out: Tensor, accumulate: bool = False, stream: StreamLike = None) -> None:
    """``out[0] = (out[0] if accumulate else 0) + sum(x**2)`` on ``stream``.

    ``x`` is fp32 or bf16; ``out`` a one-element fp32 or fp64 tensor whose dtype is the
    accumulation type. Deterministic for a given device and size.
    """
    h = stream_handle(stream)
    _tensor(x, "x")
    _tensor(out, "out")
    _dtype_in(x, "x", SR_DTYPES)
    _dtype_in(out, "out", NORM_OUT_DTYPES)
    dev = _same_device(out, (x, "x"))
    if out.numel != 1:
        raise ValueError(f"norm_squared: out {out.name!r} must hold one element, has shape {out.shape}")
    if _overlap(x, out):
        raise ValueError("norm_squared: out may not overlap x")
    _kernel_memory(dev, (x, "x"), (out, "out"))
    x.ptr  # noqa: B018 - the property raises on a closed tensor before anything is queued
    out.ptr  # noqa: B018
    capture.keep_tensors(x, out)
    dev.kernels.norm_squared(x, out, check_accumulate(accumulate), h)
