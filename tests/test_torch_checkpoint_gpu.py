"""Checkpoint and resume through lowgrad.torch on the GPU: a CUDA run (world 1, and world 2 on one
GPU through the loopback) resumed from save_checkpoint is the uninterrupted CUDA run bit for bit;
the same checkpoint loads on the host backend (its rows are the CUDA run's, whatever device)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_torch_checkpoint import Run, same

import lowgrad as lg

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
import lowgrad.torch as lt  # noqa: E402


def cuda_threads(world: int, job: Any) -> list[Any]:
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")

    def on_stream(c: Any) -> Any:
        torch.cuda.set_stream(torch.cuda.Stream())  # each rank its own stream, as on its own GPU
        return job(c)
    return lg.run_threads(world, on_stream, backend="cuda", share_gpu=world > 1, timeout=120)


@pytest.mark.parametrize(("world", "strategy", "offload"), [(1, "scatter_reduce", False), (2, "all_to_all", True),
                                                            (2, "scatter_reduce", False)])
def test_a_cuda_resume_is_bit_for_bit_and_loads_on_the_host(tmp_path: Path, world: int, strategy: str,
                                                            offload: bool) -> None:
    def run(c: Any, steps: range, load: bool, save: bool) -> dict[str, Any]:
        r = Run(c, strategy, offload, seed=1 if load else 0, device="cuda")
        if load:
            lt.load_checkpoint(tmp_path / "ck", r.opt)
        r.train(steps)
        if save:
            lt.save_checkpoint(tmp_path / "ck", r.opt)
        out = r.snapshot()
        r.close()
        return out

    straight = cuda_threads(world, lambda c: run(c, range(4), False, False))
    saved = cuda_threads(world, lambda c: run(c, range(2), False, True))
    resumed = cuda_threads(world, lambda c: run(c, range(2, 4), True, False))
    for a, b in zip(straight, resumed):
        same(a, b)

    def on_host(c: Any) -> dict[str, Any]:
        r = Run(c, strategy, offload, seed=1)
        lt.load_checkpoint(tmp_path / "ck", r.opt)
        out = r.snapshot()
        r.close()
        return out
    for a, b in zip(saved, lg.run_threads(world, on_host, backend="host", timeout=60)):
        same({k: v for k, v in a.items() if k != "shards"}, {k: v for k, v in b.items() if k != "shards"})
