"""The kernel table contract: what :attr:`lowgrad.contracts.backend.DeviceBase.kernels` returns on
every backend (CUDA: NVRTC-compiled kernels, ``lowgrad.cuda.kernels.CudaKernels``; host: the
numpy reference, ``lowgrad.host.kernels.HostKernels``). :mod:`lowgrad.ops` checks every argument
and then calls in here, so implementations may assume: tensors are live, on this device, in
memory its kernels can access, of the dtypes and sizes stated, and the ints and floats in range.
``stream`` is always a raw stream handle (int); work is queued on it in order with the stream's
other work (the host backend completes it before returning). How a kernel is launched (grid,
block, chunking) is the backend's own business and no part of this contract.

An elementwise kernel is declared here (:func:`elementwise`) rather than written per backend:
each backend builds it from the declaration once, at construction (:meth:`Kernels.build`).
"""
from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Concatenate, Generic, ParamSpec, overload

from lowgrad.buffers.tensor import Tensor

P = ParamSpec("P")

#: the seeds of bound SR launches (``lowgrad.ops.check_seed_source`` makes it): ``(None, 0, one
#: fixed seed per SR use)``, or ``(counter, layer, one lane per SR use)`` with a
#: :class:`lowgrad.sr.seedcounter.SeedCounter` whose per-use seeds are read when the work runs
SeedSource = tuple[Any, int, list[int]]



@dataclass
class StatsSink:
    """Where bound launches put gradient statistics: ``out``, a float64 tensor of shape ``(rows,
    columns, 3)`` whose (row, column) entries take ``(sum of squares, non-finite count, largest
    finite |x|)`` of a tensor (:func:`lowgrad.sr.reference.grad_stats`); ``counter``, the seed
    counter whose micro-step picks the rows that follow it (None: there are none);
    ``micro_steps``, the most micro-steps a step has (the rows of micro-steps below it are
    measured, each launch keeping its measurements until the step ends); ``jobs``, what the bound launches
    registered (the backend's own records), which the launch :meth:`Kernels.bind_stats_finish`
    makes writes into ``out``. ``lowgrad.ops.stats_sink`` makes one, checked."""

    out: Tensor
    counter: Any
    micro_steps: int
    jobs: list[Any] = field(default_factory=list)
    #: the tensors the backend allocated for the bound launches (closed with their owner)
    owned: list[Tensor] = field(default_factory=list)

    def add_sets(self) -> list[tuple[int, int, int]]:
        """The ``(set, row, micro)`` of a multi-tensor add_sr's measurements: set ``m`` is row
        ``m``, measured at micro-step ``m`` (b's); set 0 at micro-step 1 (a's, micro-step 0's sum)."""
        return [(m, m, max(m, 1)) for m in range(min(self.micro_steps, self.out.shape[0]))]

    def grad_stats_sets(self, row: int, per_micro: bool) -> list[tuple[int, int, int]]:
        """The ``(set, row, micro)`` of a grad_stats launch for ``row``: one per micro-step
        (``per_micro``: set ``m`` at micro-step ``m``, row ``row + m``), or one, written whenever it runs."""
        if not per_micro:
            return [(0, row, 0)]
        return [(m, row + m, m) for m in range(min(self.micro_steps, self.out.shape[0] - row))]


#: the statistics of a bound multi-tensor launch: the sink and the column of each item
StatsTarget = tuple[StatsSink, list[int]]


class Elementwise(Generic[P]):
    """An elementwise kernel of the contract: the declared method's signature and docstring are
    its specification; each backend builds it from this declaration (:meth:`Kernels.build`).

    The method's arguments are its tensors (``dst`` first: ``n = dst.numel`` elements are
    written), then scalars, with ``seed`` and ``index_offset`` (element ``i`` rounds with the
    noise of ``seed`` at index ``index_offset + i``), then ``stream``. Its CUDA entry points are
    ``<name>_<tag>...`` with one dtype tag per tensor, in order
    (:func:`lowgrad.contracts.kernel_source.kernel_for`), whose parameters are the method's arguments
    by name (tensors as pointers), ``n``, and the names of ``unset`` (passed as 0). Its host twin
    is the function ``<name>`` of :mod:`lowgrad.sr.reference`, given the arguments by name
    (tensors as flat arrays; ``dst`` as ``out_dtype`` when the function does not read it) and the
    rounding of ``seed``; ``dst`` takes its result.

    Accessed on a backend's instance, the name is the function that backend built (stored on the
    instance, so a call costs no lookup beyond the attribute's); on the class, this declaration.
    """

    def __init__(self, method: Callable[Concatenate[Any, P], None], tensors: tuple[str, ...],
                 unset: tuple[str, ...]) -> None:
        params = list(inspect.signature(method).parameters)
        self.name, self.__doc__ = method.__name__, method.__doc__
        #: the signature of the built function (the method's, without ``self``)
        self.signature = inspect.signature(method).replace(
            parameters=list(inspect.signature(method).parameters.values())[1:])
        #: the kernel's arguments in order: the method's between ``self`` and ``stream``
        self.args: tuple[str, ...] = tuple(params[1:-1])
        self.tensors, self.unset = tensors, unset
        if params[-1] != "stream" or self.args[:len(tensors)] != tensors or tensors[:1] != ("dst",) \
                or not {"seed", "index_offset"} <= set(self.args):
            raise TypeError(f"{self.name}: an elementwise kernel takes (dst, other tensors, scalars with seed and "
                            f"index_offset, stream), got {params} with tensors {tensors}")

    @overload
    def __get__(self, obj: None, owner: type) -> Elementwise[P]: ...
    @overload
    def __get__(self, obj: object, owner: type) -> Callable[P, None]: ...

    def __get__(self, obj: object, owner: type) -> Elementwise[P] | Callable[P, None]:
        if obj is None:
            return self
        raise AttributeError(f"{type(obj).__name__} has no {self.name}: Kernels.__init__ builds it")


def elementwise(*tensors: str, unset: tuple[str, ...] = ()
                ) -> Callable[[Callable[Concatenate[Any, P], None]], Elementwise[P]]:
    """Declare the method below as an :class:`Elementwise` kernel whose tensor arguments are
    ``tensors`` (``dst`` first); ``unset``: parameters of its entry points a call leaves 0."""
    return lambda method: Elementwise(method, tensors, unset)


class Kernels(ABC):
    """A backend's kernels. Both backends derive from this class; results are bit for bit the
    same on both (the numpy reference :mod:`lowgrad.sr.reference` defines them), except the last
    bits of :meth:`norm_squared`, whose summation order is the backend's."""

    def __init__(self) -> None:
        for kernel in ELEMENTWISE:
            self.__dict__[kernel.name] = self.build(kernel)

    @abstractmethod
    def build(self, kernel: Elementwise[...]) -> Callable[..., None]:
        """This backend's function for the elementwise ``kernel``, with its signature; called once
        per kernel at construction."""

    @elementwise("dst", "a", "b")  # noqa: B027 - a declaration, built by each backend
    def add_sr(self, dst: Tensor, a: Tensor, b: Tensor, scale: float, seed: int, index_offset: int,
               stream: int) -> None:
        """``dst = SR((a + b) * scale)`` elementwise in float32 on ``stream``: three tensors of
        ``n`` elements (fp32 or bf16 each; ``dst`` may alias ``a`` exactly, never ``b``);
        ``scale`` finite in float32; element ``i`` rounds with the noise of seed ``seed`` (64-bit)
        and index ``index_offset + i`` (< 2**64)."""

    @elementwise("dst", "a")  # noqa: B027 - a declaration, built by each backend
    def scale_sr(self, dst: Tensor, a: Tensor, scale: float, seed: int, index_offset: int, stream: int) -> None:
        """``dst = SR(a * scale)`` elementwise in float32 on ``stream``: two tensors of ``n``
        elements (fp32 or bf16 each; ``dst`` may alias ``a`` exactly); scale and noise as in
        :meth:`add_sr`."""

    @elementwise("dst", "src", unset=("counter", "layer", "lane"))  # noqa: B027 - a declaration, built by each backend
    def reduce_sr(self, dst: Tensor, src: Tensor, n_shards: int, skip: int, scale: float, accumulate: bool,
                  seed: int, index_offset: int, stream: int) -> None:
        """``dst = SR(((dst if accumulate else +0) + sum_{k != skip} src[k]) * scale)`` on
        ``stream``: ``src`` holds ``n_shards`` consecutive blocks of ``dst.numel`` elements, summed
        in float32 in block order; ``skip`` a block index or -1; noise as in :meth:`add_sr`."""

    @abstractmethod
    def bind_add_sr(self, dst: Tensor, a: Tensor, b: Tensor, scale: float, index_offset: int
                    ) -> Callable[[int, int], None]:
        """:meth:`add_sr` with everything but the seed fixed now: the returned ``f(seed, stream)``
        queues it. ``f`` raises :class:`~lowgrad.base.errors.ClosedError` once a tensor was
        closed, before queueing anything."""

    @abstractmethod
    def bind_add_sr_multi(self, items: list[tuple[Tensor, Tensor, Tensor, int]], scale: float,
                          seeds: SeedSource, stats: StatsTarget | None = None) -> Callable[[int], None]:
        """:meth:`add_sr` of every ``(dst, a, b, index_offset)`` of ``items`` (one dtype triple,
        ``dst`` of ``a``'s dtype) fixed now: the returned ``f(stream)`` queues all of them. ``seeds``
        is ``(None, 0, one seed per item)`` or ``(counter, layer, one lane per item)``, whose
        per-use roundings are read when the work runs. Results equal separate :meth:`add_sr` calls;
        ``f`` raises ClosedError as :meth:`bind_add_sr`'s does. With ``stats`` (seeds from the
        sink's counter) the same work also measures item ``i``'s ``b`` for row ``m`` (the counter's
        micro-step when it runs; from micro-step 1), column ``stats[1][i]``, and at micro-step 1
        its ``a`` before the add for row 0 (where a shard then holds micro-step 0's gradient); the
        rows are written by the sink's finish (:meth:`bind_stats_finish`) after the step."""

    @abstractmethod
    def bind_grad_stats(self, tensors: list[Tensor], sink: StatsSink, columns: list[int], row: int,
                        per_micro: bool) -> Callable[[int], None]:
        """The statistics of every tensor (fp32 or bf16, one dtype) fixed now: the returned
        ``f(stream)`` measures ``tensors[i]`` for row ``row`` (plus the sink counter's micro-step
        when it runs, with ``per_micro``), column ``columns[i]`` of the sink's ``out``, written by
        the sink's finish; ClosedError as :meth:`bind_add_sr`'s."""

    @abstractmethod
    def bind_stats_finish(self, sink: StatsSink) -> Callable[[int], None]:
        """The returned ``f(stream)`` writes the rows of every launch bound into ``sink`` so far,
        from what those launches measured last (queue it after them on their stream). With a
        counter it writes only what the counter's last completed step measured: the rows of
        micro-steps below its ``done`` (a launch's row of a micro-step that step did not have is
        left as it is); without one, every row."""

    @abstractmethod
    def bind_reduce_sr(self, dst: Tensor, src: Tensor, n_shards: int, skip: int, scale: float, accumulate: bool,
                       index_offset: int, seeds: SeedSource) -> Callable[[int], None]:
        """:meth:`reduce_sr` fixed now, ``seeds`` as ``(None, 0, [seed])`` or ``(counter, layer,
        [lane])``: the returned ``f(stream)`` queues it (ClosedError as :meth:`bind_add_sr`)."""

    @abstractmethod
    def bind_quantize_i8_sr(self, q: Tensor, scales: Tensor, x: Tensor, index_offset: int,
                            seeds: SeedSource) -> Callable[[int], None]:
        """``f(stream)`` queues :func:`lowgrad.sr.reference.quantize_i8_sr` of ``x`` (fp32 or
        bf16) into ``q`` (``byte``, ``x.numel``) and ``scales`` (fp32, one per block of
        ``QBLOCK``), ``seeds`` as in :meth:`bind_reduce_sr`."""

    @abstractmethod
    def bind_dequant_reduce_sr(self, dst: Tensor, q: Tensor, scales: Tensor, n_shards: int, skip: int,
                               scale: float, index_offset: int, seeds: SeedSource) -> Callable[[int], None]:
        """``f(stream)`` queues :func:`lowgrad.sr.reference.dequant_reduce_sr` into ``dst`` (its
        own value added first): ``q`` holds ``n_shards`` slots of ``dst.numel`` bytes, ``scales``
        theirs."""

    @abstractmethod
    def seed_counter(self, counter: Tensor, op: int, base: int, step: int, mode: int, stream: int) -> None:
        """Update the seed counter ``counter`` (one ``COUNTER_DTYPE`` record of
        :mod:`lowgrad.sr.seedcounter`) on ``stream``: op ``SET`` to ``(base, step, micro 0,
        mode)``, ``NEXT_MICRO`` or ``NEXT_STEP``."""

    @abstractmethod
    def fill(self, dst: Tensor, byte: int, stream: int) -> None:
        """Set each of the ``dst.nbytes`` bytes of ``dst`` to ``byte`` (0-255) on ``stream``."""

    @abstractmethod
    def copy(self, dst: Tensor, src: Tensor, stream: int) -> None:
        """Copy the ``src.nbytes`` bytes of ``src`` into ``dst`` (as many bytes; the two do not
        overlap) on ``stream``, with the GPU's cores rather than a copy engine (its front is
        ``lowgrad.ops.copy_on_cores``): a copy engine is one queue shared by every stream of the
        process, so a copy queued there can wait behind another rank's (the loopback
        communicator's graph replays)."""

    @abstractmethod
    def norm_squared(self, x: Tensor, out: Tensor, accumulate: bool, stream: int) -> None:
        """``out[0] = (out[0] if accumulate else 0) + sum(x**2)`` on ``stream``: ``x`` fp32 or
        bf16, ``out`` one fp32 or fp64 element (the accumulation type). Deterministic for a given
        backend, device and size."""


#: the elementwise kernels of the contract, in declaration order
ELEMENTWISE: tuple[Elementwise[...], ...] = tuple(v for v in vars(Kernels).values() if isinstance(v, Elementwise))
