"""``LoopbackCommunicator.split`` and the hierarchical strategy on one GPU (world 4 and 8 as
threads): the jobs of tests/test_loopback_split.py, the same bits as the host backend."""
from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
from test_loopback_split import SHAPES, busy_neighbours, check_node_sums, hierarchical, node_sums

import lowgrad as lg

pytestmark = pytest.mark.gpu


def loopback(world: int, fn: Any, timeout: float = 60) -> list[Any]:
    return lg.run_threads(world, fn, backend="cuda", share_gpu=True, timeout=timeout)


@pytest.mark.parametrize("world,group", SHAPES)
def test_split_collectives(world: int, group: int) -> None:
    check_node_sums(loopback(world, node_sums(group)), world, group)


@pytest.mark.parametrize("world,group", SHAPES)
@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("rounding", [None, "sr"])  # "sr": the all-to-alls summed in float32 (SumExchange)
def test_hierarchical_equals_the_host_backend(world: int, group: int, offload: bool, rounding: str | None) -> None:
    job = hierarchical(group, offload, rounding)
    for a, b in zip(loopback(world, job), lg.run_threads(world, job)):
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_an_abort_reaches_the_split_communicators() -> None:
    def job(c: Any) -> None:
        sub = c.split(0)
        if c.rank == 1:
            raise RuntimeError("boom in rank 1")
        t = c.device.alloc((4,), lg.fp32, name="t")
        sub.all_reduce(t)  # the device wait for rank 1 stops when the parent group aborts
        sub.wait()

    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="boom"):
        loopback(2, job)
    assert time.monotonic() - t0 < 15


def test_device_wide_calls_beside_collectives_part_way_queued() -> None:
    """Frees, allocations and host copies in two ranks' threads while two others all-reduce:
    before the device gate, a cuMemFree held the driver's lock against a peer's launch and the GPU
    hung until the timeout (most of the loopback split runs on an H100, 2026-12-06)."""
    assert loopback(4, busy_neighbours(300), timeout=30) == [1.5, 1.5, 3.0, 4.0]


@pytest.mark.parametrize("world,group", [(8, 4), (8, 2)])
def test_split_collectives_again_and_again(world: int, group: int) -> None:
    for _ in range(5):
        check_node_sums(loopback(world, node_sums(group), timeout=30), world, group)
