"""The hierarchical strategy on one GPU through the loopback at 2 nodes x 2 ranks: captured
micro-steps replay bit for bit as the eager ones (the split communicators' collectives in the
graphs), with and without offload, under "sr" too (its all-to-alls, and all_to_all's non-block
all-to-all at world 4). (Its collectives against the host: test_loopback_split_gpu.py.)"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from test_graph_gpu import capture_micro_steps, engine_inputs, kind_of, micro_step, shards
from test_hierarchical import small_layout

import lowgrad as lg

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("rounding,strategy,options", [
    (None, "hierarchical", {"group_size": 2}),
    ("sr", "hierarchical", {"group_size": 2}),  # the all-to-alls of both levels, blocks and non-block, in the graphs
    ("sr", "all_to_all", {})])  # the non-block gradients' all-to-all over every rank in the graph
def test_replayed_micro_steps_are_bit_identical_to_eager_at_two_nodes(offload: bool, rounding: str | None,
                                                                      strategy: str, options: dict[str, Any]) -> None:
    layout, M = small_layout(), 3

    def job(comm: Any) -> bool:
        dev = comm.device
        s = dev.stream()
        srcs = engine_inputs(dev, layout)
        eager, graphed = (lg.create_gradient_manager(layout, comm, strategy=strategy, offload=offload, seed=3,
                                                     rounding=rounding, **options) for _ in range(2))
        for m in range(M):  # step 0 eagerly on both: compiles kernels, warms every lazy resource
            micro_step(eager, layout, srcs, s, m, M)
            micro_step(graphed, layout, srcs, s, m, M)
        graphs = capture_micro_steps(graphed, layout, srcs, s, M)
        for _ in range(2):
            for m in range(M):
                micro_step(eager, layout, srcs, s, m, M)
                graphs[kind_of(m, M)].replay(s)
            a, b = shards(eager, layout, s), shards(graphed, layout, s)
            assert all(np.array_equal(a[k], b[k]) for k in a)
        for g in graphs.values():
            g.close()
        eager.close()
        graphed.close()
        return True

    assert lg.run_threads(4, job, backend="cuda", share_gpu=True, timeout=60) == [True] * 4
