"""lowgrad.torch on the GPU: a CUDA torch model attached to a CUDA manager (world 1, and world 2
on one GPU through the loopback communicator); the shards equal the host backend's manager
driven by hand with the same (GPU-computed) gradients, bit for bit."""
from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
from test_torch_adapter import Gated, Tiny, by_hand, grads, loss, shards

import lowgrad as lg

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
from lowgrad.torch import ShardOptimizer, attach, module_layout  # noqa: E402


def on_gpu(comm: Any, strategy: str, M: int) -> tuple[dict[str, Any], list[dict[str, np.ndarray]]]:
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    with torch.cuda.stream(torch.cuda.Stream()):  # each rank its own stream, as on its own GPU
        return on_stream(comm, strategy, M)


def on_stream(comm: Any, strategy: str, M: int) -> tuple[dict[str, Any], list[dict[str, np.ndarray]]]:
    model = Tiny().cuda()
    ref = Tiny().cuda()
    att = attach(model, comm, strategy=strategy, seed=7)
    for m in range(M):
        with att.micro_step(m, M):
            loss(model, comm.rank, m).backward()
    stream = torch.cuda.current_stream().cuda_stream
    got = shards(att.gm, att.layout, stream)
    per_micro = [grads(ref, comm.rank, m) for m in range(M)]
    att.close()
    return got, per_micro


@pytest.mark.parametrize("world,strategy", [(1, "scatter_reduce"), (1, "unsharded"), (2, "all_to_all"),
                                            (2, "scatter_reduce")])
def test_cuda_shards_equal_the_host_manager_with_the_same_gradients(world: int, strategy: str) -> None:
    M = 3
    cuda = lg.run_threads(world, lambda c: on_gpu(c, strategy, M), backend="cuda", share_gpu=world > 1, timeout=60)
    layout = module_layout(Tiny())[0]
    host = lg.run_threads(world, lambda c: by_hand(c, layout, cuda[c.rank][1], strategy), backend="host")
    for (got, _), want in zip(cuda, host):
        for k in want:
            assert np.array_equal(got[k], want[k]), k


@pytest.mark.parametrize("world,strategy,options", [(2, "scatter_reduce", {}),
                                                    (4, "hierarchical", {"group_size": 2, "rounding": "sr"})], ids=str)
def test_shard_optimizer_on_the_gpu_keeps_ranks_equal(world: int, strategy: str, options: dict[str, Any]) -> None:
    """hierarchical at 2 x 2: the parameters gathered across the nodes, then within them.

    PyTorch's allocations and host copies wait for the whole device (CUDA's implicit
    synchronisation) without passing lowgrad's device gate: made in one rank's thread while a
    loopback collective is part-way queued, they can hang the GPU (docs/loopback.md). So the ranks
    build their models and warm PyTorch's caching allocator (a step without lowgrad) before any
    collective, and read their parameters once every rank has closed its manager."""
    here = threading.Barrier(world, timeout=60)

    def job(c: Any) -> dict[str, Any]:
        if not torch.cuda.is_available():
            pytest.skip("torch has no CUDA")
        torch.cuda.set_stream(torch.cuda.Stream())  # this rank's thread: its own stream
        model = Tiny().cuda()
        for m in range(2):
            loss(model, c.rank, m).backward()
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        here.wait()
        att = attach(model, c, strategy=strategy, seed=3, **options)
        opt = ShardOptimizer(att, lr=1e-2, weight_decay=0.1)
        for m in range(2):
            with att.micro_step(m, 2):
                loss(model, c.rank, m).backward()
        finite = opt.step(max_norm=0.5)
        opt.close()
        att.close()
        here.wait()
        torch.cuda.synchronize()
        out = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
        assert bool(finite)
        return out
    out = lg.run_threads(world, job, backend="cuda", share_gpu=True, timeout=60)
    a = out[0]
    assert all(torch.equal(a[n], b[n]) for b in out[1:] for n in a)
    assert any(not torch.equal(a[n], p.detach()) for n, p in Tiny().named_parameters())  # it moved


@pytest.mark.parametrize("world", [1, 2])
def test_zero_d_and_zero_size_parameters_on_the_gpu(world: int) -> None:
    """A CUDA model with 0-d gates (world 1) and zero-size parameters attaches and trains on
    the GPU; every rank ends with the same model, and it moved."""
    def job(c: Any) -> dict[str, Any]:
        if not torch.cuda.is_available():
            pytest.skip("torch has no CUDA")
        torch.cuda.set_stream(torch.cuda.Stream())
        model = Gated(gates=world == 1).cuda()
        att = attach(model, c, strategy="all_to_all", seed=3)
        opt = ShardOptimizer(att, lr=1e-2)
        for m in range(2):
            with att.micro_step(m, 2):
                loss(model, c.rank, m).backward()
        assert opt.step(max_norm=0.5) is True
        torch.cuda.synchronize()
        out = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
        opt.close()
        att.close()
        return out
    results = lg.run_threads(world, job, backend="cuda", share_gpu=world > 1, timeout=60)
    assert all(torch.equal(results[0][n], r[n]) for r in results for n in r)
    start = dict(Gated(gates=world == 1).named_parameters())
    assert any(not torch.equal(results[0][n], p.detach()) for n, p in start.items() if p.numel())
    if world == 1:
        assert not torch.equal(results[0]["layers.0.gate"], start["layers.0.gate"].detach())
