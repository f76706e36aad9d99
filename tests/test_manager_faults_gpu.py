"""discard_step on the CUDA path: every strategy at world 1 (inline and offload included) and at
world 2 and 4 through the loopback gives the host backend's results (the norm NaN on every rank,
the faulting rank's shards NaN, the next step bit for bit); a manager whose micro-steps are graph
replays discards eagerly between replays and replays the next step as if nothing happened."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from test_graph_gpu import (
    capture_micro_steps,
    engine_inputs,
    kind_of,
    micro_step,
    shards,
)
from test_manager_faults import FAULTS, check_faulted, faulted_and_clean
from test_managers import STRATS, small_layout

import lowgrad as lg

pytestmark = pytest.mark.gpu


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("strategy,offload", STRATS)
def test_cuda_discard_step_equals_host(world: int, strategy: str, offload: bool) -> None:
    for fault in (FAULTS[2], FAULTS[5], FAULTS[8]) if world > 1 else FAULTS:
        cuda = faulted_and_clean(world, strategy, offload, fault, backend="cuda", share_gpu=world > 1, timeout=60)
        check_faulted(*cuda, fault)
        host = faulted_and_clean(world, strategy, offload, fault)
        for rank in range(world):
            for key, want in host[0][rank][1].items():
                assert np.array_equal(cuda[0][rank][1][key].view(np.uint32), want.view(np.uint32)), (fault, rank, key)


@pytest.mark.parametrize("strategy,offload", STRATS)
def test_discard_between_graph_replays(strategy: str, offload: bool) -> None:
    """Step 1 replays micro-step 0 from a graph, then the engine faults: the rest of the step is
    discarded eagerly; step 2 replays and equals an eager manager's step 2 bit for bit."""
    layout, M = small_layout(zero_init=True), 3

    def job(comm: Any) -> None:
        dev = comm.device
        s = dev.stream()
        srcs = engine_inputs(dev, layout)
        eager, graphed = (lg.create_gradient_manager(layout, comm, strategy=strategy, offload=offload, seed=3)
                          for _ in range(2))
        for m in range(M):
            micro_step(eager, layout, srcs, s, m, M)
            micro_step(graphed, layout, srcs, s, m, M)
        graphs = capture_micro_steps(graphed, layout, srcs, s, M)
        for m in range(M):
            micro_step(eager, layout, srcs, s, m, M)
        graphs[0].replay(s)  # step 1, micro-step 0 ... and then the engine fails
        assert graphed.discard_step(s) is True
        norm = graphed.grad_norm_squared(s)
        s.synchronize()
        assert np.isnan(norm.numpy()[0]) and graphed.step == eager.step == 2
        for m in range(M):
            micro_step(eager, layout, srcs, s, m, M)
            graphs[kind_of(m, M)].replay(s)
        a, b = shards(eager, layout, s), shards(graphed, layout, s)
        for key in a:
            assert np.array_equal(a[key], b[key]), key
        for g in graphs.values():
            g.close()
        eager.close()
        graphed.close()

    lg.run_threads(1, job, backend="cuda")


def test_discard_is_refused_inside_a_capture() -> None:
    layout = small_layout()

    def job(comm: Any) -> None:
        s = comm.device.stream()
        gm = lg.create_gradient_manager(layout, comm, strategy="scatter_reduce")
        srcs = engine_inputs(comm.device, layout)
        micro_step(gm, layout, srcs, s, 0, 1)
        g = lg.Graph(comm.device)
        with pytest.raises(lg.CaptureError):
            with g.capture(s):
                gm.discard_step(s, 1)
        g.close()
        gm.close()

    lg.run_threads(1, job, backend="cuda")
