"""PyTorch adapter: a gradient manager attached to an ``nn.Module`` (imports torch only here).

::

    attached = lowgrad.torch.attach(model, comm, strategy="scatter_reduce")   # model.model.layers found
    for m in range(M):
        with attached.micro_step(m, M):
            loss_fn(model(batch[m])).backward()
    shards = attached.block_shards(layer)          # torch views of this rank's shards, after the step
    coef, finite = attached.clip_coefficient(1.0)  # device tensors; no host sync

The layout comes from the module: the parameters of each transformer block (an ``nn.ModuleList``,
by default the first of ``model.model.layers``, ``model.layers``, ``model.transformer.h``) are the
block parameters, named relative to the block (``self_attn.q_proj.weight``: the names of
:func:`lowgrad.llama_layout`); every other trainable parameter is non-block, named by its full
module path. Every block must have the same parameter names, shapes and dtypes.

During backward each parameter's gradient goes, in its post-accumulate-grad hook, into the
manager's buffer on PyTorch's current stream (``copy_`` or ``add_`` as the manager's
``accumulate`` flag says), and ``p.grad`` is released; the block is notified as soon as its last
gradient arrived, so the exchange and SR accumulation of block ``l`` overlap the backward of block
``l - 1``. Autograd always computes a gradient into a fresh tensor (it writes into an existing
``.grad`` only by adding), so this one copy per gradient is the least PyTorch allows; the
gradients never exist as a second full set: at most one parameter's temporary at a time.

Ranks that share one GPU (the loopback communicator) deliver at the end of each micro-step instead
(see ``overlap`` in :func:`attach`): their collectives meet on the host, and PyTorch runs the
backward hooks of every rank on the GPU's one autograd thread.

Checkpoints: :meth:`ShardOptimizer.state_dict` is everything lowgrad holds for a rank (a
``torch.distributed.checkpoint`` ``Stateful`` whose sharded tensors DCP reshards at any world);
:func:`save_checkpoint` / :func:`load_checkpoint` write and read it in lowgrad's own crash-safe
format (:mod:`lowgrad.checkpoint`). Model weights loaded after the optimizer exists take effect
(the master weights follow them at the next step, state_dict or save_checkpoint).

Misuse raises: a block that produced no gradient, or only part of its gradients, in a micro-step
(at the end of the ``with``), gradients of blocks out of backward order, a parameter shared
between blocks or between a block and the rest, a model whose parameters changed after
``attach`` (checked at each micro-step), a gradient whose dtype or shape is not the buffer's, and
a backward outside ``micro_step``.
"""
from __future__ import annotations

import json
import math
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from time import perf_counter_ns
from typing import Any

import ml_dtypes
import numpy as np
import torch

from lowgrad import checkpoint
from lowgrad.base.errors import CheckpointError, NonFiniteGradientError, ProtocolError
from lowgrad.buffers.dlpack import KDL_CPU, KDL_CUDA_HOST
from lowgrad.diagnostics.report import StepStats
from lowgrad.managers import create_gradient_manager
from lowgrad.managers.layout import Layout, ParamSpec
from lowgrad.managers.state import ManagerState, resume_state
from lowgrad.managers.stats import StatsReading

__all__ = ["attach", "Attached", "ShardOptimizer", "module_layout", "find_blocks", "NONFINITE_POLICIES"]

_BLOCK_PATHS = ("model.layers", "layers", "transformer.h", "model.decoder.layers")


def find_blocks(model: torch.nn.Module, blocks: str | None = None) -> tuple[str, torch.nn.ModuleList]:
    """The transformer blocks of ``model``: the ``nn.ModuleList`` at the dotted path ``blocks``
    or, when None, at the first of ``model.layers``, ``layers``, ``transformer.h`` and
    ``model.decoder.layers`` that exists; ValueError naming the paths tried otherwise."""
    for path in (blocks,) if blocks is not None else _BLOCK_PATHS:
        obj: Any = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if isinstance(obj, torch.nn.ModuleList) and len(obj):
            return path, obj
        if blocks is not None:
            raise ValueError(f"attach: {blocks!r} is not a non-empty nn.ModuleList of {type(model).__name__}")
    raise ValueError(f"attach: no transformer blocks found in {type(model).__name__} "
                     f"(tried {', '.join(_BLOCK_PATHS)}); pass blocks='dotted.path.to.the.ModuleList'")


def module_layout(model: torch.nn.Module, blocks: str | None = None
                  ) -> tuple[Layout, list[list[tuple[str, torch.nn.Parameter]]], list[tuple[str, torch.nn.Parameter]]]:
    """``(layout, block_params, non_block_params)`` of ``model``: ``block_params[l]`` the
    ``(name, parameter)`` pairs of block ``l`` in layout order, ``non_block_params`` the others.
    Only parameters with ``requires_grad`` count."""
    path, layers = find_blocks(model, blocks)
    per_block = [[(n, p) for n, p in blk.named_parameters() if p.requires_grad] for blk in layers]
    first = [(n, tuple(p.shape), p.dtype) for n, p in per_block[0]]
    if not first:
        raise ValueError(f"attach: the blocks at {path!r} have no trainable parameters")
    for layer, params in enumerate(per_block[1:], 1):
        got = [(n, tuple(p.shape), p.dtype) for n, p in params]
        if got != first:
            raise ValueError(f"attach: block {layer} of {path!r} differs from block 0 (names, shapes, dtypes): "
                             f"{sorted(set(got) ^ set(first))[:4]}")
    owner: dict[int, str] = {}
    for layer, params in enumerate(per_block):
        for n, p in params:
            where = f"{path}.{layer}.{n}"
            if id(p) in owner:
                raise ValueError(f"attach: parameter {where} is shared with {owner[id(p)]}: a block's gradients "
                                 "must be its own (untie them, or leave them out of the blocks)")
            owner[id(p)] = where
    in_blocks = set(owner)
    non_block = []
    for n, p in model.named_parameters():  # deduplicated: a tied parameter appears once
        if p.requires_grad and id(p) not in in_blocks:
            non_block.append((n, p))
    shared = [n for n, p in model.named_parameters(remove_duplicate=False)
              if id(p) in in_blocks and not n.startswith(path + ".")]
    if shared:
        raise ValueError(f"attach: parameter(s) {shared[:4]} outside the blocks are also block parameters")
    layout = Layout(block=tuple(ParamSpec(n, s) for n, s, _ in first),
                    non_block=tuple(ParamSpec(n, tuple(p.shape)) for n, p in non_block), num_layers=len(layers))
    return layout, per_block, non_block


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
            v = self._views[key] = _from_lowgrad(t).reshape(t.shape)
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


def _from_lowgrad(t: Any) -> torch.Tensor:
    """``torch.from_dlpack`` of the lowgrad tensor ``t``, no copy. Memory both sides address (an
    offloaded shard in mapped pinned memory, DLPack's ``kDLCUDAHost``) becomes the CPU tensor it
    also is: PyTorch 2.11 refuses ``kDLCUDAHost`` ("Unsupported device_type: 3")."""
    if t.__dlpack_device__()[0] == KDL_CUDA_HOST:
        return torch.from_dlpack(t.__dlpack__(dl_device=(KDL_CPU, 0)))
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


class ShardRows(torch.Tensor):
    """This rank's rows ``[start, start + local.shape[0])`` of a parameter-shaped tensor of
    ``global_shape``, as :meth:`ShardOptimizer.state_dict` returns them: ``size()`` is the global
    shape, and the three methods ``torch.distributed.checkpoint`` asks a DTensor for
    (``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``) describe
    and hand over the local rows, so ``dcp.save`` writes each rank's rows as one chunk of the
    whole tensor and ``dcp.load`` fills them from whichever chunks overlap them: resharding at
    any world, with no process group of its own and no DTensor mesh. ``local`` is the tensor
    itself (the live rows); anything else should read it, not this wrapper."""

    local: torch.Tensor
    global_shape: torch.Size
    start: int

    @staticmethod
    def __new__(cls, local: torch.Tensor, global_shape: Any, start: int) -> ShardRows:
        r = torch.Tensor._make_subclass(cls, local.detach())
        r.local, r.global_shape, r.start = local.detach(), torch.Size(global_shape), start
        return r

    # operations on it give plain tensors of the local rows (the wrapper is only for DCP's planner)
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    def size(self, dim: int | None = None) -> Any:
        return self.global_shape if dim is None else self.global_shape[dim]

    # torch's own printing would index the local rows by the global size()
    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return (f"ShardRows(rows [{self.start}, {self.start + self.local.shape[0]}) of {tuple(self.global_shape)}, "
                f"{self.local!r})")

    def clone(self, *args: Any, **kwargs: Any) -> ShardRows:
        """A copy that still says where its rows belong (a plain tensor would not: a load refuses it)."""
        return ShardRows(self.local.clone(*args, **kwargs), self.global_shape, self.start)

    def __deepcopy__(self, memo: dict[int, Any]) -> ShardRows:  # copy.deepcopy(state_dict) keeps it one too
        memo[id(self)] = out = self.clone()
        return out

    def _check_process_group(self) -> None:
        """DCP writes and reads each rank's rows as its own chunk only where a process group of
        the run's ranks exists: without one every rank is "rank 0" of a world of 1 and writes the
        same file and ``.metadata`` (the last writer wins: a checkpoint of one rank's rows, and a
        load that fills every rank's rows from it without a word). The rows are one of ``parts``
        equal parts of the parameter (how ShardOptimizer splits it), so the group must have that
        world and this part's rank."""
        rows = self.local.shape[0] if self.local.dim() else 0
        if not rows or rows == self.global_shape[0]:
            return  # the whole parameter: any process (world 1) writes and reads it whole
        parts, part = self.global_shape[0] // rows, self.start // rows
        import torch.distributed as dist
        found = (dist.get_world_size(), dist.get_rank()) if dist.is_available() and dist.is_initialized() else None
        if found != (parts, part):
            raise RuntimeError(
                f"lowgrad.torch.ShardRows: dcp.save / dcp.load of a rank's rows (rank {part} of {parts}) needs a "
                f"torch.distributed process group of the run's ranks; found "
                f"{'none' if found is None else f'rank {found[1]} of {found[0]}'}. lowgrad's launchers start "
                "none: call torch.distributed.init_process_group('gloo', rank=comm.rank, world_size=comm.world, "
                "...) first (docs/torch.md), or use lowgrad.torch.save_checkpoint / load_checkpoint")

    def _chunk(self) -> Any:
        self._check_process_group()
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        offsets = torch.Size([self.start] + [0] * (len(self.global_shape) - 1))
        return ChunkStorageMetadata(offsets=offsets, sizes=self.local.size())

    def __create_write_items__(self, fqn: str, obj: Any) -> list[Any]:
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
        chunk = self._chunk()
        return [WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=chunk, size=self.global_shape,
                                                      properties=TensorProperties.create_from_tensor(self.local)))]

    def __create_chunk_list__(self) -> list[Any]:
        return [self._chunk()]

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        return self.local

    def __reduce_ex__(self, protocol: Any) -> Any:  # torch.save keeps what it is: the rows and their place
        return ShardRows, (self.local, tuple(self.global_shape), self.start)


# torch.load's default (weights_only=True) loads a torch.save of a state dict: the class rebuilds
# from a tensor, a tuple of ints and an int, and runs no other code
torch.serialization.add_safe_globals([ShardRows])


def _local(t: Any) -> Any:
    """The rows a state-dict value holds (a :class:`ShardRows`' local tensor, else the value)."""
    return t.local if isinstance(t, ShardRows) else t


def _json_scalar(v: Any) -> Any:
    """A param group's hyper-parameter that JSON cannot hold as is: a one-element tensor (lr)."""
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        return v.item()
    raise TypeError(f"a param group value of type {type(v).__name__} cannot be saved in a checkpoint")


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:  # numpy has no bf16: its bits, as ml_dtypes' bfloat16
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _from_numpy(a: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    if like.dtype == torch.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).to(like.device)
    return torch.from_numpy(a).to(like.device)


def _as_rows(state: dict[str, Any], data: bool = True) -> dict[str, checkpoint.Rows]:
    """The tensors of a :meth:`ShardOptimizer.state_dict` as the framework-free checkpoint's rows
    (``data=False``: templates of the right dtype and shape, nothing copied off the device)."""
    out = {}
    for key, v in state.items():
        if isinstance(v, torch.Tensor):
            t = _local(v)
            a = _to_numpy(t) if data else np.empty(tuple(t.shape), _to_numpy(t.new_empty(0)).dtype)
            out[key] = checkpoint.Rows(a, tuple(v.size()), v.start if isinstance(v, ShardRows) else 0)
    return out


def save_checkpoint(path: str | os.PathLike[str], optimizer: ShardOptimizer) -> Path:
    """Save everything lowgrad holds for the run (:meth:`ShardOptimizer.state_dict` of every
    rank: master weights, optimizer state, manager state) in lowgrad's own format
    (:func:`lowgrad.checkpoint.save`): a directory that appears whole or not at all, every chunk
    checksummed, loadable at any world by :func:`load_checkpoint`. A collective, between steps;
    ``path`` must not exist. The model's buffers and anything else of the run are the caller's to
    save (``torch.save(model.state_dict(), ...)`` from one rank)."""
    optimizer._check_between_steps("save_checkpoint")
    optimizer._follow_module()  # weights loaded into the model since the optimizer last wrote it are saved
    state = optimizer._state(copy=False)  # _as_rows copies the live tensors to the host
    return checkpoint.save(path, optimizer.attached.gm, _as_rows(state), {"optimizer": state["optimizer"]})


def load_checkpoint(path: str | os.PathLike[str], optimizer: ShardOptimizer) -> None:
    """Load a :func:`save_checkpoint` saved at any world into ``optimizer`` (and its manager, and
    the module's trainable parameters, which get the master weights): this rank's rows read from
    whichever ranks' files hold them, every byte checked first; CheckpointError on every rank
    (naming the rank, the file and what is wrong) for a missing, half-written, truncated,
    corrupted or foreign checkpoint, with nothing changed. A collective, between steps."""
    optimizer._check_between_steps("load_checkpoint")
    live = optimizer._state(copy=False)

    def saved_optimizer() -> Any:
        # the optimizer first (its class, master_weights): a clearer refusal than the arrays' dtypes
        saved = checkpoint.read_manifest(path)["meta"].get("optimizer")
        try:
            optimizer._check_optimizer(saved)
        except CheckpointError as e:
            raise CheckpointError(f"{path}: {e}") from None
        return saved
    # every rank's verdict: a manifest one rank cannot read is refused on all (none waits in a collective)
    saved = checkpoint.agree(optimizer.attached.gm.comm, saved_optimizer, f"load {path}")
    found = checkpoint.read(path, optimizer.attached.gm, _as_rows(live, data=False))
    state: dict[str, Any] = {}
    for key, v in live.items():
        if isinstance(v, torch.Tensor):
            t = _from_numpy(found.arrays[key], _local(v))
            v = ShardRows(t, v.global_shape, v.start) if isinstance(v, ShardRows) else t
        state[key] = v
    state["manager"], state["optimizer"] = found.manager.portable(), saved
    optimizer.load_state_dict(state)


def _group_value(where: str, live: Any, saved: Any) -> Any:
    """A param group's saved value (as JSON holds it) checked against this optimizer's ``live``
    one and made its kind: a number stays a number, a flag (bool or None: ``foreach``) a flag,
    a string a string, a one-element tensor a tensor of its shape, dtype and device, a tuple a
    tuple of as many; CheckpointError naming the key otherwise (before anything changes). A NaN
    or infinite number where this optimizer's is finite is refused too (JSON holds them)."""
    def number(v: Any, like: float) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and (math.isfinite(v) or not math.isfinite(like))
    if isinstance(live, torch.Tensor):
        if live.numel() == 1 and number(saved, live.item()):
            return torch.full_like(live, saved)
    elif live is None or isinstance(live, bool):
        if saved is None or isinstance(saved, bool):
            return saved
    elif isinstance(live, (int, float)):
        if number(saved, live):
            return saved
    elif isinstance(live, str):
        if isinstance(saved, str):
            return saved
    elif isinstance(live, (tuple, list)):
        if isinstance(saved, list) and len(saved) == len(live):  # JSON made the tuple a list
            return type(live)(_group_value(f"{where}[{i}]", a, b) for i, (a, b) in enumerate(zip(live, saved)))
    raise CheckpointError(f"{where} is {saved!r}, which is not a value of this optimizer's kind "
                          f"({type(live).__name__} {live!r})")


NONFINITE_POLICIES = ("skip", "raise")


def _buckets(sizes: list[int], capacity: int) -> list[list[tuple[int, int]]]:
    """``(index, offset)`` of each size, packed in order into buckets of ``capacity`` elements
    (each size fits one: ``capacity`` is at least the largest)."""
    buckets: list[list[tuple[int, int]]] = [[]]
    used = 0
    for i, n in enumerate(sizes):
        if used + n > capacity and buckets[-1]:
            buckets.append([])
            used = 0
        buckets[-1].append((i, used))
        used += n
    return buckets


class ShardOptimizer:
    """A PyTorch optimizer over this rank's gradient shards (ZeRO-2): after each completed step,
    :meth:`step` hands the shards to ``optimizer_cls`` as the gradients of this rank's slices of
    the parameters (rows ``[rank * d0 / world, (rank + 1) * d0 / world)`` of each; a 0-d
    parameter, which trains at world 1 only, whole), updates them, writes them back into the
    module and, at world > 1, all-gathers every updated parameter so each rank's module holds
    the whole model again. Runs on PyTorch's current stream.

    ``master_weights=True`` keeps float32 copies of the slices (the optimizer updates those;
    the module gets them rounded to nearest); False updates the module's bf16 rows in place.
    ``nonfinite`` says what a step whose global gradient norm is not finite does (a loss spike,
    or a step discarded after a fault on any rank): ``"skip"`` (the default, as
    ``torch.amp.GradScaler``) changes nothing and counts it in :attr:`skipped_steps`;
    ``"raise"`` changes nothing and raises :class:`lowgrad.NonFiniteGradientError`.
    ``optimizer_kwargs`` go to ``optimizer_cls`` (e.g. ``lr``, ``weight_decay``, ``foreach``).
    :meth:`state_dict` / :meth:`load_state_dict` checkpoint it with the manager (docs/torch.md)."""

    def __init__(self, attached: Attached, optimizer_cls: Any = None, master_weights: bool = True,
                 nonfinite: str = "skip", **optimizer_kwargs: Any) -> None:
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}")
        self.attached, self.nonfinite = attached, nonfinite
        comm = attached.gm.comm
        self.rank, self.world = comm.rank, comm.world
        # the module's parameters in the order of the shards step() reads: blocks, then non-block
        self._module_params = ([p for ps in attached.block_params for _, p in ps]
                               + [p for _, p in attached.non_block_params])
        self._module_rows = [self._rows(p) for p in self._module_params]
        self.master_weights = master_weights
        self.params: list[torch.Tensor] = [
            torch.nn.Parameter(rows.detach().float().clone() if master_weights else rows.detach())
            for rows in self._module_rows]
        self.optimizer = (optimizer_cls or torch.optim.AdamW)(self.params, **optimizer_kwargs)
        #: steps skipped (or raised) for a non-finite gradient norm
        self.skipped_steps = 0
        #: the global gradient norm of the last step (finite or not)
        self.last_norm = math.nan
        self._stepped: int | None = None  # the manager's step count when step() last ran
        self._first_step = attached.gm.step  # before any step(): no completed step is waiting
        full = {id(p): n for n, p in attached.model.named_parameters()}
        #: the module's name of each parameter, in the order of :attr:`params` (the checkpoint's keys)
        self.names = [full[id(p)] for p in self._module_params]
        self._versions = self._module_versions()  # see _follow_module
        self._fresh: list[dict[str, tuple[torch.Size, torch.dtype, torch.device]]] | None = None  # _fresh_state
        # the all-gather after each step: parameters packed in order into buckets of the biggest
        # parameter's size, each bucket one grouped NCCL launch (not one launch per parameter)
        biggest = max(p.numel() for p in self._module_params)
        self._buckets = _buckets([p.numel() for p in self._module_params], biggest)
        self._gather = attached.device.alloc((biggest,), attached.gm.dtype, name="lowgrad_torch_gather") \
            if self.world > 1 else None
        self._gather_event = attached.device.event(name="lowgrad_torch_gather") if self.world > 1 else None

    def _rows(self, p: torch.Tensor) -> torch.Tensor:
        if not p.dim():  # 0-d: the whole parameter (world 1: the layout refuses it at world > 1)
            return p.detach()
        per = p.shape[0] // self.world
        return p.detach()[self.rank * per:(self.rank + 1) * per]

    def step(self, max_norm: float | None = None, eps: float = 1e-6) -> bool:
        """One optimizer step from the completed step's shards; True when it was applied, False
        when it was skipped for a non-finite global gradient norm (then nothing changed:
        parameters, master weights and optimizer state are as before; with ``nonfinite="raise"``
        it raises instead); ProtocolError, with nothing changed, when no step has completed since
        the last call. With ``max_norm`` the gradients are first scaled by ``min(1,
        max_norm / (norm + eps))``, computed in float64 as :meth:`Attached.clip_coefficient`.
        ``max_norm`` and ``eps`` must be finite numbers > 0 (TypeError for a bool or a non-number,
        ValueError otherwise), checked before anything is read or counted: a corrected call
        afterwards applies the step.

        Reads the norm on the host: one sync per step, as ``GradScaler`` makes (the host waits
        for backward to finish; every rank gets the same norm from the same all-reduce, so every
        rank takes the same branch)."""
        if max_norm is not None:  # every argument checked before anything is read or counted
            max_norm = _positive_finite("max_norm", max_norm)
        eps = _positive_finite("eps", eps)
        att = self.attached
        if att.gm.step == self._stepped:  # the shards still hold the step already applied (or skipped)
            raise ProtocolError(f"ShardOptimizer.step: no step has completed since the last call (the manager is "
                                f"at step {att.gm.step}): its gradients would be applied twice")
        self._follow_module()
        norm = math.sqrt(float(att.grad_norm_squared()))  # float64 from the float32 sum of squares
        coef = 1.0 if max_norm is None or not math.isfinite(norm) else min(1.0, max_norm / (norm + eps))
        self.last_norm, self._stepped = norm, att.gm.step
        if not math.isfinite(norm):
            self.skipped_steps += 1
            if self.nonfinite == "raise":
                raise NonFiniteGradientError(f"step {att.gm.step - 1}: the global gradient norm is {norm} on rank "
                                             f"{self.rank}; nothing was updated")
            return False
        shards: list[torch.Tensor] = []
        for layer in range(att.layout.num_layers):
            shards.extend(att.block_shards(layer).values())
        shards.extend(att.non_block_shard(n) for n, _ in att.non_block_params)
        dtype = torch.float32 if self.master_weights else shards[0].dtype
        grads = [s.to(dtype, copy=True) for s in shards]  # the optimizer may change its gradients
        if coef < 1.0:
            torch._foreach_mul_(grads, torch.tensor(coef, dtype=torch.float32, device=grads[0].device))
        for param, grad in zip(self.params, grads):
            param.grad = grad
        self.optimizer.step()
        for param in self.params:
            param.grad = None
        self._publish()
        return True

    def _publish(self) -> None:
        """The module gets the master weights (rounded to nearest) and, at world > 1, every
        rank's rows (all-gathered); the module's versions are recorded after these writes."""
        with torch.no_grad():
            if self.master_weights:
                torch._foreach_copy_(self._module_rows, self.params)
            if self._gather is not None:
                for bucket in self._buckets:
                    self._all_gather([(self._module_params[i], offset) for i, offset in bucket])
        self._versions = self._module_versions()

    def _module_versions(self) -> list[int]:
        return [p._version for p in self._module_params]

    def _follow_module(self) -> None:
        """Master weights follow the module where it was written since the optimizer last wrote it
        (``model.load_state_dict`` after the optimizer was built, an in-place init): a parameter
        whose version moved and whose rows differ from the rounded master weights gets its master
        rows from the module. Rows equal to the rounded master (the same checkpoint loaded again)
        keep the master's float32 bits. Writes that bypass the version counter (``p.data.copy_``)
        are not seen: see docs/torch.md."""
        if not self.master_weights:  # the optimizer updates the module's own rows: nothing to follow
            return
        versions = self._module_versions()
        if versions == self._versions:
            return
        with torch.no_grad():
            for i, (was, now) in enumerate(zip(self._versions, versions)):
                rows, master = self._module_rows[i], self.params[i]
                if was != now and not torch.equal(rows, master.to(rows.dtype)):
                    master.copy_(rows)
        self._versions = versions

    # ---- checkpoint ---------------------------------------------------------------------
    def _row_start(self, p: torch.Tensor) -> int:
        return self.rank * (p.shape[0] // self.world)

    def _pending(self) -> bool:
        """Whether a completed step's gradients wait for :meth:`step` (they are in no checkpoint)."""
        return self.attached.gm.step != (self._first_step if self._stepped is None else self._stepped)

    def _fresh_state(self) -> list[dict[str, tuple[torch.Size, torch.dtype, torch.device]]]:
        """Shape, dtype and device of each state tensor the optimizer's first step creates, per
        parameter (the template of a state dict before that step). Found by the optimizer's own
        lazy init: one step with zero gradients at lr 0 (as torch.distributed.checkpoint.state_dict
        does), after which everything it touched is put back (the parameters' bits, the lr objects)
        and the state it made is removed, so the optimizer is as if it never ran: its real first
        step initializes its state as its class does (NAdam's ``mu_product`` 1, Rprop's
        ``step_size`` lr, SGD's first momentum without dampening), not from a template."""
        if self._fresh is not None:
            return self._fresh
        saved = [p.detach().clone() for p in self.params]
        lrs = [g.get("lr") for g in self.optimizer.param_groups]
        for g in self.optimizer.param_groups:
            if "lr" in g:
                g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
        for p in self.params:
            p.grad = torch.zeros_like(p)
        try:
            self.optimizer.step()
            self._fresh = [{k: (v.shape, v.dtype, v.device) for k, v in self.optimizer.state[p].items()
                            if isinstance(v, torch.Tensor)} for p in self.params]
        finally:
            for g, lr in zip(self.optimizer.param_groups, lrs):
                if lr is not None:
                    g["lr"] = lr
            with torch.no_grad():
                for p, was in zip(self.params, saved):
                    p.grad = None
                    p.copy_(was)
                    self.optimizer.state.pop(p, None)
        return self._fresh

    def _has_state(self) -> bool:
        """Whether the optimizer holds state (each step updates every parameter: all or none;
        some classes, Adagrad, make theirs at construction)."""
        return all(p in self.optimizer.state for p in self.params)

    def state_dict(self) -> dict[str, Any]:
        """Everything lowgrad holds for this rank, between steps (after :meth:`step`): the
        manager's state (``"manager"``: strategy, rounding, base seed, step), the optimizer's
        (``"optimizer"``: class, ``master_weights``, ``skipped_steps``, ``has_state``, its param
        groups' hyper-parameters as JSON), and tensors: ``"master.<parameter name>"`` (this rank's
        rows of the master weights, or of the module where ``master_weights=False``) and
        ``"state.<parameter name>.<key>"`` (the optimizer's state: ``exp_avg``, ``exp_avg_sq``,
        ``step`` for AdamW). Row-sharded tensors are :class:`ShardRows` (this rank's rows and where
        they sit in the whole parameter), which ``torch.distributed.checkpoint`` saves and reshards
        like DTensor shards; the others are the same on every rank.

        The tensors are copies on the CPU, never the live ones: ``dcp.load`` fills them and
        :meth:`load_state_dict` checks them before it copies them in, so a refused load changes
        nothing. Before the optimizer's first step (``has_state`` False) the state tensors are
        zeros of the shapes that step makes (a template to load into; loading such a state leaves
        the optimizer without state, as a fresh one). The master weights first follow module writes
        made since the optimizer last wrote it (as :meth:`step` does: weights loaded into the
        model after the optimizer was built are the ones saved). ProtocolError inside a step, or
        when a completed step waits for :meth:`step`."""
        self._check_between_steps("state_dict")
        self._follow_module()
        return self._state(copy=True)

    def _check_between_steps(self, what: str) -> None:
        if self._pending():
            raise ProtocolError(f"ShardOptimizer.{what}: step {self.attached.gm.step - 1} completed but step() has "
                                "not applied it: call step() first (a checkpoint holds no gradients), or load "
                                "between steps")

    def _state(self, copy: bool) -> dict[str, Any]:
        """The state dict: tensors copied to the CPU (``copy``), else the live master weights and
        state (templates on the state's device where the optimizer has no state yet)."""
        manager = ManagerState.parse(self.attached.gm.state_dict()).portable()
        has_state = self._has_state()
        fresh = None if has_state else self._fresh_state()
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        out: dict[str, Any] = {"manager": manager, "optimizer": {
            "class": type(self.optimizer).__qualname__, "master_weights": self.master_weights,
            "skipped_steps": self.skipped_steps, "has_state": has_state,
            "param_groups": json.dumps(groups, default=_json_scalar)}}

        def entry(v: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
            v = v.detach().to("cpu", copy=True) if copy else v.detach()
            # a 0-d parameter is not split in rows: every rank holds it whole
            return ShardRows(v, p.shape, self._row_start(p)) if v.shape == self._rows(p).shape and v.dim() else v

        for i, (name, p, master) in enumerate(zip(self.names, self._module_params, self.params)):
            out[f"master.{name}"] = entry(master, p)
            if fresh is None:
                items = list(self.optimizer.state[master].items())
            else:
                items = [(k, torch.zeros(shape, dtype=dtype, device="cpu" if copy else device))
                         for k, (shape, dtype, device) in fresh[i].items()]
            for key, v in items:
                out[f"state.{name}.{key}"] = entry(v, p) if isinstance(v, torch.Tensor) else v
        return out

    def load_state_dict(self, state: Any) -> None:
        """Restore a :meth:`state_dict` saved at this rank and world (``torch.save``), or one that
        ``dcp.load`` filled in (any world: DCP reshards), or one :func:`load_checkpoint` read.
        Everything is checked first, on every rank, and the verdict agreed (CheckpointError on
        every rank naming the rank and the entry: not a dict, a key missing or unknown, another
        optimizer class, a shape, dtype or row range that is not this rank's, a param-group value
        of another kind than this optimizer's, a manager of another strategy), with nothing
        changed; then the manager's state, the master weights, the optimizer's state and
        hyper-parameters are set, and the module gets the master weights (rounded; every rank's
        rows all-gathered: a collective). Between steps."""
        self._check_between_steps("load_state_dict")
        gm = self.attached.gm
        live = self._state(copy=False)  # the keys, and the live tensors to fill
        # every rank's verdict before anything changes: a state refused on one rank is refused on all
        saved, opt, groups, masters, states = checkpoint.agree(
            gm.comm, partial(self._check_state, state, live), "ShardOptimizer.load_state_dict")
        # checked: from here on nothing fails but the collective
        gm.load_state_dict(saved.as_dict())
        with torch.no_grad():
            for want, got in masters:
                want.copy_(got)
            for master, loaded in zip(self.params, states):
                if not opt["has_state"]:  # saved before its first step: fresh, as the saving run was
                    self.optimizer.state.pop(master, None)
                elif master in self.optimizer.state:
                    for want, got in loaded.values():
                        want.copy_(got)
                else:  # no state here yet: the templates (on the state's device) become it
                    self.optimizer.state[master] = {k: want.copy_(got) for k, (want, got) in loaded.items()}
            for g, new in zip(self.optimizer.param_groups, groups):
                for k, v in new.items():
                    if isinstance(g[k], torch.Tensor):  # a tensor lr stays that tensor (capturable, compiled steps)
                        g[k].copy_(v)
                    else:
                        g[k] = v
        self.skipped_steps, self.last_norm, self._stepped = opt["skipped_steps"], math.nan, gm.step
        self._publish()

    def _check_state(self, state: Any, live: dict[str, Any]) -> tuple[
            ManagerState, dict[str, Any], list[dict[str, Any]], list[tuple[torch.Tensor, torch.Tensor]],
            list[dict[str, tuple[torch.Tensor, torch.Tensor]]]]:
        """``state`` checked against this rank's ``live`` state dict: the manager's state placed here,
        the optimizer entry, the new param groups' values, the (live, loaded) master-weight pairs
        and each parameter's optimizer-state pairs by key."""
        where = "ShardOptimizer.load_state_dict"
        if not isinstance(state, dict):
            raise TypeError(f"{where}: state must be a dict from state_dict(), got {type(state).__name__}")
        gm = self.attached.gm
        missing, unknown = live.keys() - state.keys(), state.keys() - live.keys()
        if missing or unknown:
            raise CheckpointError(f"{where}: keys missing {sorted(missing)[:4]}, unknown "
                                  f"{sorted(unknown)[:4]} (another model or optimizer?)")
        try:
            saved = resume_state(state["manager"], gm)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{where}: 'manager': {e}") from None
        opt, groups = self._check_optimizer(state["optimizer"])
        pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for key, want in live.items():
            if key in ("manager", "optimizer"):
                continue
            got = state[key]
            if isinstance(want, ShardRows):
                if not isinstance(got, ShardRows):
                    raise CheckpointError(f"{where}: {key!r} is a {type(got).__name__}, not the ShardRows of "
                                          "state_dict(): which rows it holds is unknown (keep the ShardRows: "
                                          "its clone() is one; load another world's state through dcp.load or "
                                          "load_checkpoint, which reshard)")
                if (got.global_shape, got.start) != (want.global_shape, want.start):
                    raise CheckpointError(f"{where}: {key!r} holds rows from {got.start} of "
                                          f"{tuple(got.global_shape)}; this rank's are from {want.start} of "
                                          f"{tuple(want.global_shape)} (load another world's state through "
                                          "dcp.load or load_checkpoint, which reshard)")
                got, want = got.local, want.local
            if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
                what = f"{got.dtype} {tuple(got.shape)}" if isinstance(got, torch.Tensor) else type(got).__name__
                raise CheckpointError(f"{where}: {key!r} is {what}, this rank's is {want.dtype} {tuple(want.shape)}")
            pairs[key] = (want, got)
        masters = [pairs[f"master.{name}"] for name in self.names]
        has_state = self._has_state()  # the state keys of each parameter, as _state wrote them
        states = [{k: pairs[f"state.{name}.{k}"]
                   for k in (self.optimizer.state[master] if has_state else self._fresh_state()[i])}
                  for i, (name, master) in enumerate(zip(self.names, self.params))]
        return saved, opt, groups, masters, states

    def _check_optimizer(self, opt: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The ``"optimizer"`` entry checked against this optimizer, and the values its param
        groups are to get (each of the kind of this optimizer's: CheckpointError naming it)."""
        where = "ShardOptimizer.load_state_dict: 'optimizer'"
        keys = {"class", "master_weights", "skipped_steps", "has_state", "param_groups"}
        if not isinstance(opt, dict) or set(opt) != keys:
            got = sorted(opt) if isinstance(opt, dict) else type(opt).__name__
            raise CheckpointError(f"{where} is not a ShardOptimizer's ({got}; expected {sorted(keys)})")
        if opt["class"] != type(self.optimizer).__qualname__:
            raise CheckpointError(f"{where}: saved from {opt['class']}, this optimizer is "
                                  f"{type(self.optimizer).__qualname__}")
        if opt["master_weights"] is not self.master_weights:
            raise CheckpointError(f"{where}: saved with master_weights={opt['master_weights']}, this optimizer has "
                                  f"master_weights={self.master_weights}")
        if not isinstance(opt["has_state"], bool):
            raise CheckpointError(f"{where}: has_state {opt['has_state']!r} is not a bool")
        skipped = opt["skipped_steps"]
        if isinstance(skipped, bool) or not isinstance(skipped, int) or skipped < 0:
            raise CheckpointError(f"{where}: skipped_steps {skipped!r} is not a non-negative int")
        try:
            groups = json.loads(opt["param_groups"])
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{where}: param_groups is not JSON ({e})") from None
        mine = self.optimizer.param_groups
        if not isinstance(groups, list) or len(groups) != len(mine) or not all(isinstance(g, dict) for g in groups):
            raise CheckpointError(f"{where}: param_groups are not {len(mine)} group(s) of hyper-parameters")
        new = []
        for i, (g, m) in enumerate(zip(groups, mine)):
            extra = set(g) - (set(m) - {"params"})
            if extra:
                raise CheckpointError(f"{where}: param group {i} has {sorted(extra)}, which this "
                                      f"{type(self.optimizer).__qualname__} does not know (another optimizer or "
                                      "torch version?)")
            # a key this optimizer has and the saved group lacks (a newer torch's option) keeps its value
            new.append({k: _group_value(f"{where}: param group {i} {k!r}", m[k], v) for k, v in g.items()})
        return opt, new

    def _all_gather(self, bucket: list[tuple[torch.Tensor, int]]) -> None:
        """Every rank's updated rows of the bucket's parameters into every rank's parameters:
        each packed at its offset of the gather buffer, all gathered in place in one group."""
        att, gather = self.attached, self._gather
        assert gather is not None
        bufs, fulls = [], []
        for p, offset in bucket:
            buf = gather.view(offset, p.numel())
            full = att.view(buf).view(p.shape)
            self._rows(full).copy_(self._rows(p))
            bufs.append(buf)
            fulls.append(full)
        comm, stream = att.gm.comm, att.current_stream()
        with comm.group(stream, event=self._gather_event):
            for buf in bufs:
                comm.all_gather(buf, stream=stream)
        for (p, _), full in zip(bucket, fulls):
            p.detach().copy_(full)

    def close(self) -> None:
        if self._gather is not None:
            self._gather.close()
            self._gather = None


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
