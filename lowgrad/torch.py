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

Misuse raises: a block that produced no gradient, or only part of its gradients, in a micro-step
(at the end of the ``with``), gradients of blocks out of backward order, a parameter shared
between blocks or between a block and the rest, a model whose parameters changed after
``attach`` (checked at each micro-step), a gradient whose dtype or shape is not the buffer's, and
a backward outside ``micro_step``.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from time import perf_counter_ns
from typing import Any

import torch

from lowgrad.core.errors import ProtocolError
from lowgrad.managers import create_gradient_manager
from lowgrad.managers.layout import Layout, ParamSpec

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
    raise ValueError(f"attach: no transformer blocks found in {type(model).__name__} (tried {', '.join(_BLOCK_PATHS)}); "
                     "pass blocks='dotted.path.to.the.ModuleList'")


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


class Attached:
    """A gradient manager fed by a module's backward (see :func:`attach`). ``gm`` is the
    manager; shards and the norm are read through it or through the torch views below."""

    def __init__(self, model: torch.nn.Module, comm: Any, blocks: str | None = None, overlap: bool = True,
                 **manager_args: Any) -> None:
        if not isinstance(overlap, bool):
            raise TypeError(f"attach: overlap must be a bool, got {overlap!r}")
        self.model = model
        self.overlap = overlap
        self._meets = bool(getattr(comm, "meets_peers_on_host", False))
        self._thread = 0  # the thread that entered the micro-step
        self._defer: bool | None = None  # this micro-step delivers at the end (decided at its first gradient)
        self._host_ns = 0
        self.layout, self._blocks, self._non_block = module_layout(model, blocks)
        self.gm = create_gradient_manager(self.layout, comm, **manager_args)
        self.device = comm.device
        self._snapshot = self._params()
        self._views: dict[tuple[int, int, str], torch.Tensor] = {}
        self._active = False
        self._stream: Any = None
        self._fetched: int | None = None
        self._next = self.layout.num_layers - 1
        self._missing: set[str] = set()
        self._buffers: dict[str, torch.Tensor] = {}
        self._accumulate = False
        self._handles: list[Any] = []
        for layer, params in enumerate(self._blocks):
            for n, p in params:
                self._handles.append(p.register_post_accumulate_grad_hook(
                    self._hook(n, partial(self._block_arrived, layer, n))))
        for n, p in self._non_block:
            self._handles.append(p.register_post_accumulate_grad_hook(self._hook(n, partial(self._non_block_arrived, n))))

    # ---- the micro-step ----------------------------------------------------------------
    @contextmanager
    def micro_step(self, micro_step: int, total_micro_steps: int) -> Iterator[Attached]:
        """Run the forward and backward of micro-batch ``micro_step`` of ``total_micro_steps``
        inside this block; on exit every block must have delivered all its gradients (then the
        manager's micro-step ends on PyTorch's current stream)."""
        if self._active:
            raise ProtocolError("attached.micro_step: micro-steps do not nest")
        t0 = perf_counter_ns()
        if self._params() != self._snapshot:
            raise ValueError("attached.micro_step: the model's parameters changed after attach (added, removed, "
                             "replaced, reshaped or retyped): attach again")
        self._stream = self._current_stream()
        self.gm.start_micro_step(self._stream, micro_step, total_micro_steps)
        self._active, self._fetched, self._next = True, None, self.layout.num_layers - 1
        self._thread, self._defer = threading.get_ident(), None
        self._host_ns += perf_counter_ns() - t0
        try:
            yield self
            t0 = perf_counter_ns()
            if self._defer:
                self._deliver_deferred()
            if self._fetched is not None:
                raise ProtocolError(f"attached.micro_step: block {self._fetched} produced only part of its gradients "
                                    f"(missing {sorted(self._missing)})")
            if self._next != -1:
                raise ProtocolError(f"attached.micro_step: blocks {self._next}..0 produced no gradient in micro-step "
                                    f"{micro_step} (every block's parameters must take part in each backward)")
            self.gm.end_micro_step(self._stream)
            self._host_ns += perf_counter_ns() - t0
        finally:
            self._active, self._defer = False, None

    def _deferring(self, name: str) -> bool:
        """Whether this micro-step leaves the gradients in ``p.grad`` until its end: always with
        ``overlap=False``; and where the communicator meets its peers on the host while the hooks
        run on another thread than the micro-step's (PyTorch runs a CUDA backward's hooks on one
        autograd thread per GPU, shared by every rank that uses the GPU: a rank waiting there for
        its peers would wait forever)."""
        self._check_active(name)
        if self._defer is None:
            self._defer = not self.overlap or (self._meets and threading.get_ident() != self._thread)
        return self._defer

    def _deliver_deferred(self) -> None:
        """Deliver the gradients the hooks left in ``p.grad``: the non-block ones, then the
        blocks from the last to the first, as an overlapped backward would have."""
        for name, p in self._non_block:
            if p.grad is not None:
                self._non_block_arrived(name, p)
        for layer in reversed(range(self.layout.num_layers)):
            for name, p in self._blocks[layer]:
                if p.grad is not None:
                    self._block_arrived(layer, name, p)

    def _hook(self, name: str, arrived: Callable[[torch.Tensor], None]) -> Any:
        """The post-accumulate-grad hook of parameter ``name``: ``arrived(p)`` now, unless this
        micro-step delivers at its end; its host time counted in :attr:`host_seconds`."""
        def hook(p: torch.Tensor) -> None:
            t0 = perf_counter_ns()
            if self._defer is False or not self._deferring(name):  # False only inside a micro-step
                arrived(p)
            self._host_ns += perf_counter_ns() - t0
        return hook

    def _block_arrived(self, layer: int, name: str, p: torch.Tensor) -> None:
        if self._fetched != layer:
            if self._fetched is not None:
                raise ProtocolError(f"lowgrad.torch: a gradient of block {layer} ({name}) arrived while block "
                                    f"{self._fetched} still misses {sorted(self._missing)}: blocks must finish "
                                    "their backward one after another, from the last to the first")
            if layer != self._next:
                raise ProtocolError(f"lowgrad.torch: a gradient of block {layer} ({name}) arrived, expected block "
                                    f"{self._next} (backward goes from the last block to the first)")
            dw, self._accumulate = self.gm.block_full(layer, self._stream)
            self._buffers = {n: self._torch(dw[n]) for n, _ in self._blocks[layer]}
            self._missing = set(self._buffers)
            self._fetched = layer
        if name not in self._missing:
            raise ProtocolError(f"lowgrad.torch: block {layer}'s {name} delivered a gradient twice in one backward")
        self._deliver(p, self._buffers[name], self._accumulate, layer, name)
        self._missing.discard(name)
        if not self._missing:
            self.gm.notify_block(layer, self._stream)
            self._fetched, self._next = None, layer - 1

    def _non_block_arrived(self, name: str, p: torch.Tensor) -> None:
        buf, accumulate = self.gm.non_block_full(name, self._stream)
        self._deliver(p, self._torch(buf), accumulate, None, name)
        self.gm.notify_non_block(name, self._stream)

    def _deliver(self, p: torch.Tensor, buf: torch.Tensor, accumulate: bool, layer: int | None, name: str) -> None:
        """``p.grad`` into (or, with ``accumulate``, added to) ``buf`` on the current stream; ``p.grad``
        released. ``layer``/``name`` say whose gradient it is (block ``layer``, or None: non-block)."""
        g = p.grad
        p.grad = None
        if g is None or g.layout != torch.strided:
            raise TypeError(f"lowgrad.torch: {_whose(layer, name)}: expected a dense gradient, got {g if g is None else g.layout}")
        if g.dtype != buf.dtype or g.shape != buf.shape:
            raise TypeError(f"lowgrad.torch: {_whose(layer, name)}: gradient {g.dtype} {tuple(g.shape)}, the manager's buffer is "
                            f"{buf.dtype} {tuple(buf.shape)} (make the model's parameters {buf.dtype}, or create "
                            "the manager with their dtype)")
        if accumulate:
            buf.add_(g)
        else:
            buf.copy_(g)

    def _check_active(self, name: str) -> None:
        if not self._active:
            raise ProtocolError(f"lowgrad.torch: a gradient of {name} outside `with attached.micro_step(m, M)`: the "
                                "attached model's backward runs inside a micro-step")

    @property
    def host_seconds(self) -> float:
        """Host time spent so far in this adapter's hooks and micro-step bookkeeping (including the
        manager calls they make), in seconds: what lowgrad adds to the threads that run backward."""
        return self._host_ns * 1e-9

    # ---- reading the step's result -----------------------------------------------------
    def block_shards(self, layer: int) -> dict[str, torch.Tensor]:
        """This rank's shards of block ``layer`` (views; after a completed step, until the next
        micro-step), ready on PyTorch's current stream."""
        c = self.gm.block_shard(layer, self._current_stream())
        return {n: self._torch(c[n]) for n, _ in self._blocks[layer]}

    def non_block_shard(self, name: str) -> torch.Tensor:
        """This rank's shard of the non-block gradient ``name`` (a view)."""
        return self._torch(self.gm.non_block_shard(name, self._current_stream()))

    def clip_coefficient(self, max_norm: float, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
        """``(coefficient, finite)`` as 0-d device tensors, no host sync: ``min(1, max_norm /
        (norm + eps))`` of the global gradient norm over every rank's shards, computed in
        float64. A non-finite norm gives coefficient 0 (an update scaled by it changes nothing)
        and ``finite`` False: check it before trusting the step (``finite.item()`` syncs)."""
        if not isinstance(max_norm, (int, float)) or isinstance(max_norm, bool) or not max_norm > 0:
            raise ValueError(f"clip_coefficient: max_norm must be a positive number, got {max_norm!r}")
        norm = self._torch(self.gm.grad_norm_squared(self._current_stream())).to(torch.float64).reshape(()).sqrt()
        finite = torch.isfinite(norm)
        coef = torch.clamp(max_norm / (norm + eps), max=1.0)
        return torch.where(finite, coef, torch.zeros_like(coef)), finite

    def close(self) -> None:
        """Remove the hooks and close the manager."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._views.clear()
        self.gm.close()

    # ---- helpers -----------------------------------------------------------------------
    def _torch(self, t: Any) -> torch.Tensor:
        """A cached torch view of the lowgrad tensor ``t`` (its memory lives as long as the manager)."""
        key = (t.ptr, t.numel, t.dtype.name)
        v = self._views.get(key)
        if v is None:
            v = self._views[key] = torch.from_dlpack(t).reshape(t.shape)
        return v

    def _current_stream(self) -> Any:
        if getattr(self.device, "backend", None) == "cuda":
            return torch.cuda.current_stream(self.device.ordinal).cuda_stream
        return None

    def _params(self) -> list[tuple[int, tuple[int, ...], torch.dtype, bool]]:
        return [(id(p), tuple(p.shape), p.dtype, p.requires_grad) for p in self.model.parameters()]


class ShardOptimizer:
    """A PyTorch optimizer over this rank's gradient shards (ZeRO-2): after each completed step,
    :meth:`step` hands the shards to ``optimizer_cls`` as the gradients of this rank's slices of
    the parameters (rows ``[rank * d0 / world, (rank + 1) * d0 / world)`` of each), updates them,
    writes them back into the module and, at world > 1, all-gathers every updated parameter so
    each rank's module holds the whole model again. Runs on PyTorch's current stream.

    ``master_weights=True`` keeps float32 copies of the slices (the optimizer updates those;
    the module gets them rounded to nearest); False updates the module's bf16 rows in place.
    ``optimizer_kwargs`` go to ``optimizer_cls`` (e.g. ``lr``, ``weight_decay``, ``foreach``)."""

    def __init__(self, attached: Attached, optimizer_cls: Any = None, master_weights: bool = True,
                 **optimizer_kwargs: Any) -> None:
        self.attached = attached
        comm = attached.gm.comm
        self.rank, self.world = comm.rank, comm.world
        # the module's parameters in the order of the shards step() reads: blocks, then non-block
        self._module_params = [p for params in attached._blocks for _, p in params] + [p for _, p in attached._non_block]
        self._module_rows = [self._rows(p) for p in self._module_params]
        self.master_weights = master_weights
        self.params: list[torch.Tensor] = [
            torch.nn.Parameter(rows.detach().float().clone() if master_weights else rows.detach())
            for rows in self._module_rows]
        self.optimizer = (optimizer_cls or torch.optim.AdamW)(self.params, **optimizer_kwargs)
        biggest = max(p.numel() for p in self._module_params)
        self._gather = attached.device.alloc((biggest,), attached.gm.dtype, name="lowgrad_torch_gather") \
            if self.world > 1 else None

    def _rows(self, p: torch.Tensor) -> torch.Tensor:
        per = p.shape[0] // self.world
        return p.detach()[self.rank * per:(self.rank + 1) * per]

    def step(self, max_norm: float | None = None) -> torch.Tensor | None:
        """One optimizer step from the completed step's shards; with ``max_norm``, the gradients
        are first scaled by :meth:`Attached.clip_coefficient` (a non-finite norm scales them by
        0) and the ``finite`` flag is returned (a 0-d bool tensor; no host sync)."""
        att = self.attached
        finite = coef = None
        if max_norm is not None:
            coef, finite = att.clip_coefficient(max_norm)
        shards: list[torch.Tensor] = []
        for layer in range(att.layout.num_layers):
            shards.extend(att.block_shards(layer).values())
        shards.extend(att.non_block_shard(n) for n, _ in att._non_block)
        dtype = torch.float32 if self.master_weights else shards[0].dtype
        grads = [s.to(dtype, copy=True) for s in shards]  # the optimizer may change its gradients
        if coef is not None:
            torch._foreach_mul_(grads, coef.float())
        for param, grad in zip(self.params, grads):
            param.grad = grad
        self.optimizer.step()
        for param in self.params:
            param.grad = None
        with torch.no_grad():
            if self.master_weights:
                torch._foreach_copy_(self._module_rows, self.params)
            if self._gather is not None:
                for module_param in self._module_params:
                    self._all_gather(module_param)
        return finite

    def _all_gather(self, p: torch.Tensor) -> None:
        """Every rank's updated rows of ``p`` into every rank's ``p`` (through one lowgrad buffer)."""
        n = p.numel()
        buf = self._gather.view(0, n)  # type: ignore[union-attr]
        full = self.attached._torch(buf).view(p.shape)
        own = self._rows(full)
        own.copy_(self._rows(p))
        self.attached.gm.comm.all_gather(buf, stream=self.attached._current_stream())
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
    the same GPU; the host backend: the CPU) and have the manager's gradient dtype (bf16 by default).

    ``overlap=False`` leaves each gradient in ``p.grad`` until the end of the micro-step and
    delivers them all there (no overlap with backward, one full set of gradients at a time, as
    plain PyTorch). It is chosen by itself where ranks share one GPU through the loopback
    communicator: PyTorch runs their backward hooks on one shared autograd thread."""
    return Attached(model, comm, blocks, overlap, **manager_args)
