"""Jobs the loopback tests run on the GPU (test_loopback_gpu.py) and in the CPU simulation
(test_loopback.py), each compared with the host backend bit for bit."""
from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from typing import Any

import numpy as np

import lowgrad as lg
from lowgrad.contracts.communicator import all_to_all_skip

_spec = importlib.util.spec_from_file_location("race_hunt", Path(__file__).parents[1] / "tools" / "race_hunt.py")
race_hunt = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(race_hunt)  # type: ignore[union-attr]
train = race_hunt.train  # the engine job the race hunter runs, without its pauses


def data(rank: int, n: int, dtype: lg.DType, k: int = 0) -> np.ndarray:
    rng = np.random.default_rng([rank, n, k])
    if dtype is lg.byte:
        return rng.integers(0, 256, n, dtype=np.uint8)
    x = rng.standard_normal(n) * 3
    return x.astype(dtype.np)


def assert_bits(a: list[Any], b: list[Any]) -> None:
    for r, (x, y) in enumerate(zip(a, b)):
        for i, (u, v) in enumerate(zip(x, y)):
            assert u.dtype == v.dtype and u.tobytes() == v.tobytes(), (r, i)


def put(comm: Any, arr: np.ndarray, dtype: lg.DType, name: str) -> lg.Tensor:
    t = comm.device.alloc(arr.shape, dtype, name=name)
    comm.device.copy_from_host(t, arr)
    return t


def late_synchronize_ring(comm: Any) -> np.ndarray:
    """Rank 0 synchronizes the device (a host copy) while the other ranks already wait for it in
    a ring of grouped sends and receives; returns what this rank received (rank - 1's values).
    No rank may have a device-side wait queued then for a rank that still waits on the host."""
    if comm.rank == 0:
        time.sleep(0.5)  # the others are in the group by then
    sent = put(comm, np.full(16, comm.rank, np.float32), lg.fp32, "send")  # a device-wide synchronize
    got = comm.device.alloc((16,), lg.fp32, name="recv")
    s = comm.device.stream()
    with comm.group(s) as grp:
        comm.send(sent, (comm.rank + 1) % comm.world)
        comm.recv(got, (comm.rank - 1) % comm.world)
    s.wait(grp.event)
    comm.wait(s)
    return got.numpy().copy()


def assert_ring(got: list[np.ndarray]) -> None:
    """Each rank of :func:`late_synchronize_ring` received its left neighbour's values."""
    for rank, g in enumerate(got):
        assert (g == (rank - 1) % len(got)).all(), rank


def collectives(comm: Any) -> list[np.ndarray]:
    """Every collective on every reducible dtype and op, an all-gather both ways, a
    three-buffer all-to-all and a ring of grouped sends; the results (unspecified parts zeroed)."""
    n = comm.world * 1000 + comm.world * 3  # several shards, not a multiple of 16 bytes per shard
    dev, out = comm.device, []
    s = dev.stream()
    for dtype in (lg.bf16, lg.fp32, lg.fp16, lg.fp64, lg.byte):
        for op in ("avg", "sum"):
            t = put(comm, data(comm.rank, n, dtype), dtype, "rs")
            comm.reduce_scatter(t, op=op, stream=s)
            comm.wait(s)
            out.append(lg.shard_view(t, comm.rank, comm.world).numpy().copy())
        for op in ("sum", "avg", "max"):
            t = put(comm, data(comm.rank, n + 5, dtype, 1), dtype, "ar")  # n + 5: uneven parts
            comm.all_reduce(t, op=op, stream=s)
            comm.wait(s)
            out.append(t.numpy().copy())
    g = put(comm, data(comm.rank, n, lg.bf16, 2), lg.bf16, "ag")
    comm.all_gather(g, stream=s)  # in place
    shard = put(comm, data(comm.rank, 77, lg.fp32, 3), lg.fp32, "shard")
    full = dev.alloc((77 * comm.world,), lg.fp32, name="full")
    comm.all_gather(shard, full, stream=s)
    bufs = [put(comm, data(comm.rank, comm.world * m, lg.bf16, 4 + m), lg.bf16, "a2a") for m in (5, 64, 1)]
    comm.all_to_all_many(bufs, stream=s)
    with comm.group(s) as grp:  # a ring: send right, receive from the left
        right, left = (comm.rank + 1) % comm.world, (comm.rank - 1) % comm.world
        sent = put(comm, data(comm.rank, 33, lg.fp32, 9), lg.fp32, "send")
        got = dev.alloc((33,), lg.fp32, name="recv")
        comm.send(sent, right)
        comm.recv(got, left)
    s.wait(grp.event)
    comm.wait(s)
    skip = all_to_all_skip(comm.rank, comm.world)
    out += [g.numpy().copy(), full.numpy().copy(), got.numpy().copy()]
    for b in bufs:
        slots = b.numpy().reshape(comm.world, -1).copy()
        slots[skip] = 0  # no peer's data there: unspecified
        out.append(slots)
    return out


def layout8(layers: int = 3) -> lg.Layout:
    """A small layout whose every dim 0 splits over 1, 2, 4 and 8 ranks (zero-init biases)."""
    block = [lg.ParamSpec("w1", (16, 6)), lg.ParamSpec("b1", (16,), zero_init=True), lg.ParamSpec("w2", (40, 3))]
    return lg.Layout(block=block, non_block=[lg.ParamSpec("emb", (24, 4)), lg.ParamSpec("norm", (8,))],
                     num_layers=layers)
