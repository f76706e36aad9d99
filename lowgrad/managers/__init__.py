"""Gradient managers: one per rank, driven by the engine through the micro-step protocol."""
from __future__ import annotations

from typing import Any

from lowgrad.base.dtypes import DType, bf16
from lowgrad.base.errors import ProtocolError
from lowgrad.managers.layout import Layout
from lowgrad.managers.manager import GradientManager
from lowgrad.managers.strategies import STRATEGIES


def create_gradient_manager(layout: Layout, comm: Any, strategy: str = "unsharded", offload: bool = False,
                            dtype: DType | str = bf16, seed: int = 0, step: int = 0,
                            rounding: str | None = None, inline: bool | None = None,
                            stats: bool = False, **options: Any) -> GradientManager:
    """A gradient manager for this rank (``comm.rank`` of ``comm.world`` on ``comm.device``).

    ``strategy``: a name in :data:`STRATEGIES` (the registry; docs/design.md describes each), whose
    class says what it does: ``offload`` (block shards in pinned host memory) where its
    ``offloads``, ``rounding`` where it ``rounds()``; ``dtype``: bf16 or fp32 gradients; ``seed``:
    the base seed of the SR noise; ``step``: the optimizer step to run first; ``rounding`` (bf16
    shards): how each add into a shard rounds, "ldsr" (low-discrepancy SR, the default), "sr"
    (stochastic rounding, fresh noise each micro-step; where the strategy's ``unbiased_exchange()``,
    every exchange is summed in float32 and rounded with SR too, so the step's sum is unbiased:
    docs/accuracy.md) or "rn" (round to nearest even). A strategy
    that rounds nothing itself (the engine adds into the full gradients) takes no ``rounding``.

    ``inline`` (where the strategy's ``inline_refusal`` allows it: world 1 with device shards for
    the strategies that accumulate): where there is nothing to
    exchange, accumulate on the engine's stream (micro-step 0 written straight into the shards,
    later SR adds queued at ``notify_block`` on the engine's stream) rather than on the
    communication stream beside the engine's work. None (the default) means True where possible;
    True elsewhere is a ValueError. Same bits either way; inline won when the engine's work is
    compute-bound (a transformer's backward), the communication stream when it is a stream of
    memory-bound kernels (docs/protocol.md).

    ``stats``: measure per-tensor gradient statistics (sum of squares, non-finite count, largest
    finite |x|) of every micro-step's gradient inside the kernels that consume it, and of each
    rank's own gradient before the exchange at world > 1; read them with ``gm.stats()`` /
    ``gm.step_stats()`` (docs/diagnostics.md).

    ``options``: the strategy's own (``STRATEGIES[strategy].option_names()``, e.g. hierarchical's
    ``group_size`` and ``cross_node_bits``; a strategy without options refuses every one with
    TypeError).
    """
    return GradientManager(layout, comm, strategy, offload=offload, dtype=dtype, seed=seed, step=step,
                           rounding=rounding, inline=inline, stats=stats, **options)


__all__ = ["create_gradient_manager", "GradientManager", "ProtocolError", "STRATEGIES"]
