"""The hooks: :class:`Attached`, a gradient manager fed by a module's backward (each
parameter's post-accumulate-grad hook copies its gradient into the manager's buffer and
notifies the block once its last gradient arrived), the micro-step around it, the torch views of
the shards and the clip coefficient; and :func:`attach`, which makes one."""
from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from time import perf_counter_ns
from typing import Any

import torch

from lowgrad.base.errors import ProtocolError
from lowgrad.buffers.dlpack import KDL_CPU, KDL_CUDA, KDL_CUDA_HOST
from lowgrad.diagnostics.report import StepStats
from lowgrad.managers import create_gradient_manager
from lowgrad.managers.stats import StatsReading
from lowgrad.torch.layout import module_layout


def _whose(layer: int | None, name: str) -> str:
    """A gradient's name in messages: ``block 3 mlp.up_proj.weight``, or the non-block name."""
    return name if layer is None else f"block {layer} {name}"


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module ``torch.compile`` wrapped (its parameters are the same objects), or ``model``."""
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, torch.nn.Module) else model


_SECOND_BACKWARD = ("a second backward pass in one micro-step: with overlap=True (the default) each block's "
                    "gradients are handed over as soon as its backward ends, on every communicator alike; sum the "
                    "losses into one backward, or attach(..., overlap=False) to accumulate several backward "
                    "passes exactly as plain PyTorch does")


class Attached:
    """A gradient manager fed by a module's backward (see :func:`attach`). ``gm`` is the
    manager (its protocol state is the one state: the adapter keeps no copy of it); shards and
    the norm are read through it or through the torch views below. ``block_params[l]`` and
    ``non_block_params`` are the ``(name, parameter)`` pairs in layout order."""

    def __init__(self, model: torch.nn.Module, comm: Any, blocks: str | None = None, overlap: bool = True,
                 **manager_args: Any) -> None:
        if not isinstance(overlap, bool):
            raise TypeError(f"attach: overlap must be a bool, got {overlap!r}")
        model = _unwrap(model)
        layout, block_params, non_block_params = module_layout(model, blocks)
        params = [p for ps in block_params for _, p in ps] + [p for _, p in non_block_params]
        taken = [n for n, p in model.named_parameters() if _attached_to(p) is not None]
        if taken:
            raise ValueError(f"attach: {type(model).__name__} is already attached to a gradient manager (parameters "
                             f"{taken[:3]}): close() that Attached first, or keep using it")
        self.gm = create_gradient_manager(layout, comm, **manager_args)  # checks every manager argument
        wrong = [(n, p.dtype) for n, p in model.named_parameters()
                 if p.requires_grad and p.dtype != _torch_dtype(self.gm)]
        if wrong:
            self.gm.close()
            raise TypeError(f"attach: parameters {wrong[:3]} are not {self.gm.dtype.name}, the manager's gradient "
                            f"dtype (convert the model with .to({_torch_dtype(self.gm)}), or pass dtype= to attach)")
        self.model, self.overlap, self.layout = model, overlap, layout
        self.block_params, self.non_block_params = block_params, non_block_params
        full = {id(p): n for n, p in model.named_parameters()}  # the statistics' columns by module name
        self._stats_names = tuple(full[id(p)] for _, p in non_block_params) + tuple(
            full[id(p)] for ps in block_params for _, p in ps)
        self.device = comm.device
        self._meets = bool(comm.meets_peers_on_host)  # a capability of the communicator contract
        self._thread = 0  # the thread that entered the micro-step
        self._defer: bool | None = None  # this micro-step delivers at the end (decided at its first gradient)
        self._host_ns = 0
        self._params = params
        self._cuda = params[0].device if params[0].is_cuda else None  # where PyTorch's streams are
        self._snapshot = self._param_signature()
        self._views: dict[tuple[int, tuple[int, ...], str], torch.Tensor] = {}
        self._stream: Any = None
        self._seen: set[int] = set()  # the parameters whose gradient arrived in this micro-step
        self._missing: set[str] = set()  # the fetched block's parameters still to arrive
        self._buffers: dict[str, torch.Tensor] = {}
        self._accumulate = False
        self._handles: list[Any] = []
        for layer, ps in enumerate(block_params):
            for n, p in ps:
                self._handles.append(p.register_post_accumulate_grad_hook(
                    self._hook(n, partial(self._block_arrived, layer, n))))
        for n, p in non_block_params:
            self._handles.append(p.register_post_accumulate_grad_hook(
                self._hook(n, partial(self._non_block_arrived, n))))
        for p in params:
            p._lowgrad_attached = weakref.ref(self)  # type: ignore[attr-defined]

    # ---- the micro-step ----------------------------------------------------------------
    @contextmanager
    def micro_step(self, micro_step: int, total_micro_steps: int) -> Iterator[Attached]:
        """Run the forward and backward of micro-batch ``micro_step`` of ``total_micro_steps``
        inside this block; on exit every block must have delivered all its gradients (then the
        manager's micro-step ends on PyTorch's current stream).

        Refused before anything changes: micro-steps that nest or come out of order (the
        manager's checks), a model whose parameters changed since ``attach``, and a gradient
        already in some ``p.grad`` (it would be folded into this step). An exception inside the
        block (an OOM in backward, a NaN check of the user's, misuse found here) clears every
        ``p.grad`` and discards the step (:meth:`discard_step`) before it propagates: the
        manager is between steps again and every rank sees a non-finite step."""
        t0 = perf_counter_ns()
        if self.gm.in_micro_step:
            raise ProtocolError("attached.micro_step: micro-steps do not nest")
        if self._param_signature() != self._snapshot:
            raise ValueError("attached.micro_step: the model's parameters changed after attach (added, removed, "
                             "replaced, reshaped or retyped): attach again")
        if any(p.grad is not None for p in self._params):  # names only on the error path
            stale = [n for n, p in self._named() if p.grad is not None]
            raise ProtocolError(f"attached.micro_step: parameters {stale[:3]} already hold a gradient in p.grad "
                                "(from a backward outside a micro-step, or from before attach): it would be folded "
                                "into this step; clear it with model.zero_grad(set_to_none=True)")
        stream = self.current_stream()
        self.gm.start_micro_step(stream, micro_step, total_micro_steps)
        self._stream, self._thread, self._defer = stream, threading.get_ident(), None
        self._seen.clear()
        self._missing = set()
        self._host_ns += perf_counter_ns() - t0
        try:
            yield self
            t0 = perf_counter_ns()
            if self._defer:
                self._deliver_deferred()
            if self._missing:
                raise ProtocolError(f"attached.micro_step: block {self.gm.fetched_layer} produced only part of its "
                                    f"gradients (missing {sorted(self._missing)})")
            try:
                self.gm.end_micro_step(stream)
            except ProtocolError as e:
                raise ProtocolError(f"attached.micro_step {micro_step}: {e} (every block's parameters must take part "
                                    "in each backward)") from e
            self._host_ns += perf_counter_ns() - t0
        except BaseException:
            self._abandon(stream)
            raise
        finally:
            self._defer = None

    def discard_step(self, total_micro_steps: int | None = None) -> bool:
        """Give up the step in progress after a fault outside ``micro_step`` (the data loader
        raised between micro-steps, say): every ``p.grad`` cleared, then
        :meth:`GradientManager.discard_step <lowgrad.managers.manager.GradientManager.discard_step>`
        on PyTorch's current stream (``total_micro_steps``: discard a whole step that has not
        begun, so that peers running it are not left waiting). Faults inside ``micro_step``
        discard by themselves."""
        discarded = self.gm.discard_step(self.current_stream(), total_micro_steps)  # checks its arguments first
        self._drop_grads()
        return discarded

    def _abandon(self, stream: Any) -> None:
        """After an exception inside a micro-step: no gradient left in ``p.grad``, the step
        discarded (nothing to do where the micro-step never started)."""
        self._drop_grads()
        self._missing = set()
        self.gm.discard_step(stream)

    def _drop_grads(self) -> None:
        for p in self._params:
            p.grad = None

    def _deferring(self, name: str) -> bool:
        """Whether this micro-step leaves the gradients in ``p.grad`` until its end: always with
        ``overlap=False``; and where the communicator meets its peers on the host while the hooks
        run on another thread than the micro-step's (PyTorch runs a CUDA backward's hooks on one
        autograd thread per GPU, shared by every rank that uses the GPU: a rank waiting there for
        its peers would wait forever)."""
        if self._defer is None:
            self._defer = not self.overlap or (self._meets and threading.get_ident() != self._thread)
        return self._defer

    def _deliver_deferred(self) -> None:
        """Deliver the gradients the hooks left in ``p.grad``: the non-block ones, then the
        blocks from the last to the first, as an overlapped backward would have."""
        for name, p in self.non_block_params:
            if p.grad is not None:
                self._non_block_arrived(name, p)
        for layer in reversed(range(self.layout.num_layers)):
            for name, p in self.block_params[layer]:
                if p.grad is not None:
                    self._block_arrived(layer, name, p)

    def _hook(self, name: str, arrived: Callable[[torch.Tensor], None]) -> Any:
        """The post-accumulate-grad hook of parameter ``name``: ``arrived(p)`` now, unless this
        micro-step delivers at its end; its host time counted in :attr:`host_seconds`. A
        gradient it refuses (outside a micro-step; a second backward with ``overlap=True``) is
        dropped from ``p.grad`` before the error: a refused backward leaves nothing."""
        def hook(p: torch.Tensor) -> None:
            t0 = perf_counter_ns()
            try:
                if not self.gm.in_micro_step:
                    raise ProtocolError(f"lowgrad.torch: a gradient of {name} outside "
                                        "`with attached.micro_step(m, M)`: the attached model's backward runs "
                                        "inside a micro-step")
                if self.overlap:
                    if id(p) in self._seen:
                        raise ProtocolError(f"lowgrad.torch: {name}: {_SECOND_BACKWARD}")
                    self._seen.add(id(p))
                if not self._deferring(name):
                    arrived(p)
            except BaseException:
                p.grad = None
                raise
            finally:
                self._host_ns += perf_counter_ns() - t0
        return hook

    def _block_arrived(self, layer: int, name: str, p: torch.Tensor) -> None:
        if self.gm.fetched_layer != layer:
            if self._missing:
                raise ProtocolError(f"lowgrad.torch: a gradient of block {layer} ({name}) arrived while block "
                                    f"{self.gm.fetched_layer} still misses {sorted(self._missing)}: blocks must finish "
                                    "their backward one after another, from the last to the first")
            try:
                dw, self._accumulate = self.gm.block_full(layer, self._stream)
            except ProtocolError as e:
                raise ProtocolError(f"lowgrad.torch: a gradient of block {layer} ({name}) arrived out of order ({e}): "
                                    "backward goes from the last block to the first, and every block's parameters "
                                    "must take part in each backward") from e
            self._buffers = {n: self.view(dw[n]) for n, _ in self.block_params[layer]}
            self._missing = set(self._buffers)
        if name not in self._missing:
            raise ProtocolError(f"lowgrad.torch: block {layer}'s {name} delivered a gradient twice in one backward")
        self._deliver(p, self._buffers[name], self._accumulate, layer, name)
        self._missing.discard(name)
        if not self._missing:
            self.gm.notify_block(layer, self._stream)

    def _non_block_arrived(self, name: str, p: torch.Tensor) -> None:
        buf, accumulate = self.gm.non_block_full(name, self._stream)
        self._deliver(p, self.view(buf), accumulate, None, name)
        self.gm.notify_non_block(name, self._stream)

    def _deliver(self, p: torch.Tensor, buf: torch.Tensor, accumulate: bool, layer: int | None, name: str) -> None:
        """``p.grad`` into (or, with ``accumulate``, added to) ``buf`` on the current stream; ``p.grad``
        released. ``layer``/``name`` say whose gradient it is (block ``layer``, or None: non-block)."""
        g = p.grad
        p.grad = None
        if g is None or g.layout != torch.strided:
            raise TypeError(f"lowgrad.torch: {_whose(layer, name)}: expected a dense gradient, "
                            f"got {g if g is None else g.layout}")
        if g.dtype != buf.dtype or g.shape != buf.shape:
            raise TypeError(f"lowgrad.torch: {_whose(layer, name)}: gradient {g.dtype} {tuple(g.shape)}, the "
                            f"manager's buffer is {buf.dtype} {tuple(buf.shape)} (make the model's parameters "
                            f"{buf.dtype}, or create the manager with their dtype)")
        if accumulate:
            buf.add_(g)
        else:
            buf.copy_(g)

    @property
    def host_seconds(self) -> float:
        """Host time spent so far in this adapter's hooks and micro-step bookkeeping (including the
        manager calls they make), in seconds: what lowgrad adds to the threads that run backward."""
        return self._host_ns * 1e-9

    # ---- reading the step's result -----------------------------------------------------
    def block_shards(self, layer: int) -> dict[str, torch.Tensor]:
        """This rank's shards of block ``layer`` (views; after a completed step, until the next
        micro-step), ready on PyTorch's current stream."""
        c = self.gm.block_shard(layer, self.current_stream())
        return {n: self.view(c[n]) for n, _ in self.block_params[layer]}

    def non_block_shard(self, name: str) -> torch.Tensor:
        """This rank's shard of the non-block gradient ``name`` (a view)."""
        return self.view(self.gm.non_block_shard(name, self.current_stream()))

    def grad_norm_squared(self) -> torch.Tensor:
        """The completed step's squared global gradient norm (every rank's shards; a collective)
        as a one-element float32 device tensor, no host sync; the manager reuses it."""
        return self.view(self.gm.grad_norm_squared(self.current_stream()))

    def stats(self) -> torch.Tensor:
        """The completed step's gradient statistics (attach with ``stats=True``) as a float64
        device tensor of shape ``(world, rows, tensors, 3)``, no host sync; a collective
        (:meth:`lowgrad.GradientManager.stats`, layout in docs/diagnostics.md)."""
        return self.view(self.gm.stats(self.current_stream()))

    def step_stats(self) -> StepStats:
        """:meth:`stats` on the host (one sync) as a :class:`lowgrad.diagnostics.StepStats` whose
        tensors carry the module's parameter names (``model.layers.17.mlp.down_proj.weight``)."""
        return self.read_stats().result()

    def read_stats(self) -> StatsReading:
        """:meth:`step_stats` without a host sync: the rows' copy to the host queued on PyTorch's
        current stream (:meth:`lowgrad.GradientManager.read_stats`); the reading's ``result()``
        is the :class:`lowgrad.diagnostics.StepStats`, with the module's parameter names."""
        return self.gm.read_stats(self.current_stream(), self._stats_names)

    def clip_coefficient(self, max_norm: float, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
        """``(coefficient, finite)`` as 0-d device tensors, no host sync: ``min(1, max_norm /
        (norm + eps))`` of the global gradient norm over every rank's shards, computed in
        float64; ``finite`` False (and the coefficient 0) for a non-finite norm. A coefficient
        of 0 does not make an optimizer step a no-op (AdamW's moments decay and its weight decay
        still moves the weights; NaN times 0 is NaN): skip such a step, as
        :meth:`ShardOptimizer.step` does. ``max_norm`` and ``eps`` must be finite numbers > 0
        (TypeError for a bool or a non-number, ValueError otherwise)."""
        max_norm, eps = _positive_finite("max_norm", max_norm), _positive_finite("eps", eps)
        norm = self.grad_norm_squared().to(torch.float64).reshape(()).sqrt()
        finite = torch.isfinite(norm)
        coef = torch.clamp(max_norm / (norm + eps), max=1.0)
        return torch.where(finite, coef, torch.zeros_like(coef)), finite

    def close(self) -> None:
        """Remove the hooks and close the manager (idempotent); the module may be attached again."""
        for h in self._handles:
            h.remove()
        self._handles = []
        for p in self._params:
            if _attached_to(p) is self:
                del p._lowgrad_attached  # type: ignore[attr-defined]
        self._views.clear()
        self.gm.close()

    # ---- helpers -----------------------------------------------------------------------
    def view(self, t: Any) -> torch.Tensor:
        """A cached torch view of the lowgrad tensor ``t`` (its memory lives as long as the manager)."""
        key = (t.ptr, t.shape, t.dtype.name)  # the shape, not the count: zero-size tensors share pointers
        v = self._views.get(key)
        if v is None:
            v = self._views[key] = _from_lowgrad(t, self._cuda is not None).reshape(t.shape)
        return v

    def current_stream(self) -> Any:
        """PyTorch's current stream on the module's GPU, as the manager takes it (a raw handle);
        None where the module lives in host memory (the host backend)."""
        if self._cuda is None:
            return None
        return torch.cuda.current_stream(self._cuda).cuda_stream

    def _named(self) -> Iterator[tuple[str, torch.Tensor]]:
        for layer, ps in enumerate(self.block_params):
            for n, p in ps:
                yield f"{layer}.{n}", p
        yield from self.non_block_params

    def _param_signature(self) -> list[tuple[int, tuple[int, ...], torch.dtype, bool]]:
        return [(id(p), tuple(p.shape), p.dtype, p.requires_grad) for p in self.model.parameters()]


def _attached_to(p: torch.Tensor) -> Attached | None:
    """The open :class:`Attached` whose hooks are on ``p``, if any."""
    ref = getattr(p, "_lowgrad_attached", None)
    return ref() if ref is not None else None


def _torch_dtype(gm: Any) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[gm.dtype.name]


def _from_lowgrad(t: Any, on_gpu: bool) -> torch.Tensor:
    """``torch.from_dlpack`` of the lowgrad tensor ``t``, no copy. Memory both sides address (an
    offloaded shard in mapped pinned memory, DLPack's ``kDLCUDAHost``, which PyTorch 2.11 refuses:
    "Unsupported device_type: 3") becomes a CUDA tensor of its GPU for a module on the GPU (one
    pointer on both sides, unified addressing: its kernels read the host memory), else a CPU one."""
    if t.__dlpack_device__()[0] == KDL_CUDA_HOST:
        return torch.from_dlpack(t.__dlpack__(dl_device=(KDL_CUDA, t.device.ordinal) if on_gpu else (KDL_CPU, 0)))
    return torch.from_dlpack(t)


def _positive_finite(what: str, value: Any) -> float:
    """``value`` as a float: TypeError unless an int or float (not a bool), ValueError unless
    finite and > 0 (``max_norm`` and ``eps``: 0, a negative, NaN or inf would divide by zero, flip
    the update's sign or turn clipping off without a word)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a positive finite number, got {type(value).__name__} {value!r}")
    if not 0 < value < math.inf:  # False for NaN too
        raise ValueError(f"{what} must be a positive finite number, got {value!r}")
    return float(value)


def attach(model: torch.nn.Module, comm: Any, blocks: str | None = None, overlap: bool = True,
           **manager_args: Any) -> Attached:
    """Attach a gradient manager to ``model`` for rank ``comm.rank``: the layout derived from the
    module (:func:`module_layout`), ``manager_args`` as for :func:`lowgrad.create_gradient_manager`
    (``strategy``, ``offload``, ``dtype``, ``seed``, ``step``, ``rounding``, ``inline``). The
    model's parameters must live where ``comm.device`` can read them through DLPack (a CUDA device:
    the same GPU; the host backend: the CPU) and have the manager's gradient dtype (bf16 by default;
    TypeError at attach otherwise). A module wrapped by ``torch.compile`` is attached through the
    module it wraps. A module attached already (its hooks still on) is refused: ``close()`` the first.

    ``overlap=False`` leaves each gradient in ``p.grad`` until the end of the micro-step and
    delivers them all there (no overlap with backward, one full set of gradients at a time, as
    plain PyTorch); several backward passes in one micro-step then accumulate as in plain
    PyTorch. The same delivery is chosen by itself where ranks share one GPU through the loopback
    communicator (PyTorch runs their backward hooks on one shared autograd thread), but a second
    backward is refused there as with ``overlap=True``, so that a loop behaves the same on every
    communicator."""
    return Attached(model, comm, blocks, overlap, **manager_args)
