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
format (:mod:`lowgrad.checkpoint`); :func:`dcp_save` / :func:`dcp_load` are DCP's with lowgrad's
checks first and ``CheckpointError`` (an ``Exception``) for any failure. Model weights loaded
after the optimizer exists take effect (the master weights follow them at the next step,
state_dict or save_checkpoint).

Misuse raises: a block that produced no gradient, or only part of its gradients, in a micro-step
(at the end of the ``with``), gradients of blocks out of backward order, a parameter shared
between blocks or between a block and the rest, a model whose parameters changed after
``attach`` (checked at each micro-step), a gradient whose dtype or shape is not the buffer's, and
a backward outside ``micro_step``.
"""
from __future__ import annotations

from lowgrad.torch.attached import Attached, attach
from lowgrad.torch.checkpoints import load_checkpoint as load_checkpoint
from lowgrad.torch.checkpoints import save_checkpoint as save_checkpoint
from lowgrad.torch.dcp import dcp_load as dcp_load
from lowgrad.torch.dcp import dcp_save as dcp_save
from lowgrad.torch.layout import find_blocks, module_layout
from lowgrad.torch.optimizer import NONFINITE_POLICIES, ShardOptimizer
from lowgrad.torch.process_group import init_process_group
from lowgrad.torch.rows import ShardRows as ShardRows
from lowgrad.torch.rows import _local as _local

__all__ = ["attach", "Attached", "ShardOptimizer", "module_layout", "find_blocks", "NONFINITE_POLICIES",
           "init_process_group"]
