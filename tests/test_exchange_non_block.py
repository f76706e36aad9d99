"""The non-block gradients' exchange (lowgrad/managers/exchange.py, NonBlockExchange) on the
host backend: bit for bit an independent reference at every node shape, every rounding and both
gradient dtypes: one reduce-scatter over every rank on one node (today's bits), within the node then
across the nodes where there are several nodes of several ranks, and under ``rounding="sr"`` of
a strategy whose sums are unbiased, all-to-alls summed in float32 and rounded once with SR; its
scratch memory; zero-size tensors."""
from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest
from test_hierarchical import fold

import lowgrad as lg
from lowgrad.sr.seeds import NON_BLOCK_LAYER

SHAPES = [(2, 1), (4, 1), (4, 2), (4, 4), (8, 2), (8, 4), (6, 2), (6, 3)]  # (world, GPUs per node)
M = 2  # the engine writes the non-block gradients at micro-step 0 only; they are exchanged at the last


def layout() -> lg.Layout:
    return lg.Layout(block=[lg.ParamSpec("w", (24, 2))],
                     non_block=[lg.ParamSpec("emb", (48, 5)), lg.ParamSpec("norm", (24,)), lg.ParamSpec("z", (0, 3))],
                     num_layers=1)


def value(rank: int, j: int, numel: int, dtype: Any) -> np.ndarray:
    return np.random.default_rng([rank, j, 7]).standard_normal(numel).astype(np.float32).astype(dtype)


def run(world: int, G: int, strategy: str, rounding: str, dtype: lg.DType = lg.bf16) -> list[dict[str, np.ndarray]]:
    lay = layout()
    opts = {"group_size": G} if strategy == "hierarchical" else {}

    def fn(c: Any) -> dict[str, np.ndarray]:
        with lg.create_gradient_manager(lay, c, strategy=strategy, rounding=rounding, seed=5, dtype=dtype,
                                        **opts) as gm:
            s = c.device.stream()
            for m in range(M):
                gm.start_micro_step(s, m, M)
                if m == 0:
                    for j, spec in enumerate(lay.non_block):
                        t, _ = gm.non_block_full(spec.name, s)
                        t.numpy().reshape(-1)[:] = value(c.rank, j, spec.numel, dtype.np)
                        gm.notify_non_block(spec.name, s)
                gm.block_full(0, s)[0]["w"].numpy()[...] = 0.0
                gm.notify_block(0, s)
                gm.end_micro_step(s)
            return {spec.name: gm.non_block_shard(spec.name, s).numpy().reshape(-1).copy() for spec in lay.non_block}
    return lg.run_threads(world, fn)


def mean(parts: list[np.ndarray], dtype: Any) -> np.ndarray:
    """The host's average: float32 sum in rank order, times float32(1/n), rounded to ``dtype``."""
    acc = np.zeros(parts[0].shape, np.float32)
    for p in parts:
        acc = acc + p.astype(np.float32)
    return (acc * np.float32(1.0 / len(parts))).astype(dtype)


def expected(world: int, G: int, unbiased: bool, dtype: Any) -> list[dict[str, np.ndarray]]:
    """Chunk ``rank`` of each tensor. One level (one node, or one rank per node): the host's mean
    over every rank, or under ``unbiased`` the own chunk and the peers' summed in float32, scaled
    by 1/world and rounded once with SR (phase 0, the index of the chunk). Two levels: the node's
    mean of each of this rank's chunks ``k*G + g``, then the mean over the nodes of chunk ``rank``;
    under ``unbiased`` the node's sums (phase 0, node n's index shift) then the sum over the
    nodes, scaled by 1/world (phase 1)."""
    if G in (1, world):
        G = world
    N = world // G
    out: list[dict[str, np.ndarray]] = [{} for _ in range(world)]
    for j, spec in enumerate(layout().non_block):
        c = spec.numel // world
        vals = [value(r, j, spec.numel, dtype) for r in range(world)]
        seeds = [lg.use_seed(5, 0, M - 1, NON_BLOCK_LAYER, j, phase) for phase in (0, 1)]

        def chunk(r: int, index: int, vals: list[np.ndarray] = vals, c: int = c) -> np.ndarray:
            return vals[r][index * c:(index + 1) * c]
        for r in range(world):
            n, g = divmod(r, G)
            if not unbiased:
                node = [mean([chunk(nn * G + h, r) for h in range(G)], dtype) for nn in range(N)]
                out[r][spec.name] = node[0] if N == 1 else mean(node, dtype)
                continue
            sums = {}
            for nn in range(N):  # node nn's sum of chunk n*G + g, as its rank of index g holds it
                own = chunk(nn * G + g, n * G + g)
                peers = {h: chunk(nn * G + h, n * G + g) for h in range(G) if h != g}
                sums[nn] = fold(own, peers, g, G, 1.0 / world if N == 1 else 1.0, seeds[0],
                                nn * spec.numel + (n * G + g) * c) if G > 1 else own
            mine = sums.pop(n)
            out[r][spec.name] = mine if N == 1 else fold(mine, sums, n, N, 1.0 / world, seeds[1], r * c)
    return out


@pytest.mark.parametrize("world,G", SHAPES)
@pytest.mark.parametrize("rounding", ["ldsr", "sr"])
@pytest.mark.parametrize("dtype", [lg.bf16, lg.fp32], ids=lambda d: d.name)
def test_hierarchical_bit_identical_to_the_reference(world: int, G: int, rounding: str, dtype: lg.DType) -> None:
    got = run(world, G, "hierarchical", rounding, dtype)
    want = expected(world, G, rounding == "sr", dtype.np)
    for r in range(world):
        for name, w in want[r].items():
            assert np.array_equal(got[r][name], w), (r, name)


@pytest.mark.parametrize("strategy,unbiased", [("scatter_reduce", False), ("all_to_all", True)])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_one_node_strategies(strategy: str, unbiased: bool, world: int) -> None:
    """scatter_reduce: one reduce-scatter (the bits of every release before); all_to_all under "sr":
    the unbiased exchange, and under "ldsr" the reduce-scatter."""
    got = run(world, world, strategy, "sr")
    want = expected(world, world, unbiased, ml_dtypes.bfloat16)
    assert all(np.array_equal(got[r][k], w) for r in range(world) for k, w in want[r].items())
    got = run(world, world, "all_to_all", "ldsr")
    want = expected(world, world, False, ml_dtypes.bfloat16)
    assert all(np.array_equal(got[r][k], w) for r in range(world) for k, w in want[r].items())


@pytest.mark.parametrize("world,G,rounding,scratch", [
    (8, 2, "ldsr", 48 * 5 // 2), (8, 2, "sr", 48 * 5 // 2), (8, 4, "sr", 48 * 5 // 4), (8, 8, "sr", 48 * 5 // 8),
    (8, 1, "sr", 48 * 5 // 8), (8, 8, "ldsr", 0), (8, 1, "ldsr", 0)])
def test_scratch_is_the_largest_tensor_over_g_or_world(world: int, G: int, rounding: str, scratch: int) -> None:
    """Two levels: 1/G of the largest non-block tensor; one level: 1/world of it under "sr", none
    for one reduce-scatter."""
    def fn(c: Any) -> int:
        with lg.create_gradient_manager(layout(), c, strategy="hierarchical", group_size=G, rounding=rounding) as gm:
            return int(gm.memory_report().as_dict()["device"].get("non_block_exchange", 0))
    assert lg.run_threads(world, fn) == [2 * scratch] * world
