"""Gradient managers on the GPU at world 1: every strategy's shards equal the host backend's bit
for bit (noise is launch-independent), offload works against pinned memory, and the memory report
matches DESIGN.md's formula."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import lowgrad as lg
from test_managers import STRATS, drive, small_layout

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("strategy,offload", STRATS)
@pytest.mark.parametrize("micro", [1, 3])
def test_cuda_shards_equal_host_bit_for_bit(strategy: str, offload: bool, micro: int) -> None:
    layout = small_layout(zero_init=True)
    (dev,) = lg.run_threads(1, lambda c: drive(c, layout, strategy, offload, micro, steps=2), backend="cuda")
    (host,) = lg.run_threads(1, lambda c: drive(c, layout, strategy, offload, micro, steps=2), backend="host")
    assert dev.keys() == host.keys()
    for key in dev:
        assert np.array_equal(dev[key], host[key]), (strategy, offload, key)


@pytest.mark.parametrize("offload", [False, True])
def test_cuda_memory_report_matches_formula(offload: bool) -> None:
    layout = lg.llama_layout("tiny")

    def job(c: Any) -> tuple[dict, bool]:
        gm = lg.create_gradient_manager(layout, c, strategy="scatter_reduce", offload=offload)
        shard_kind = gm.block_shard(0, None)[layout.block[0].name].kind
        rep = gm.memory_report().as_dict()
        gm.close()
        return rep, shard_kind == ("pinned" if offload else "device")

    ((rep, kind_ok),) = lg.run_threads(1, job, backend="cuda")
    block, nb, L = 2 * layout.block_numel, 2 * layout.non_block_numel, layout.num_layers
    dev = rep["device"]
    assert kind_ok
    assert dev["block_grad"] == 2 * block and dev["non_block_grad"] == nb
    assert rep["pinned" if offload else "device"]["block_grad_shards"] == L * block
    assert dev["grad_norm"] == 4 and dev["seed_counter"] == 16


def test_cuda_grad_norm_matches_host() -> None:
    layout = small_layout()

    def job(c: Any) -> float:
        gm = lg.create_gradient_manager(layout, c, strategy="scatter_reduce")
        drive(c, layout, "scatter_reduce", False, 2, gm=gm)
        v = float(gm.grad_norm_squared().numpy()[0])
        gm.close()
        return v

    (d,) = lg.run_threads(1, job, backend="cuda")
    (h,) = lg.run_threads(1, job, backend="host")
    assert d == pytest.approx(h, rel=1e-5)
