"""lowgrad.torch under faults on the GPU: CUDA world 1 and world 2 through the loopback (whose
hooks deliver at the end of the micro-step): a NaN step and exceptions in forward, part-way
through backward and between micro-steps are skipped on every rank and the run equals one that
skipped the step, bit for bit; a second backward is refused there exactly as with overlap=True on
any other communicator."""
from __future__ import annotations

from typing import Any

import pytest

import lowgrad as lg
from lowgrad.base.errors import ProtocolError

torch = pytest.importorskip("torch")
from test_torch_adapter import Tiny, loss  # noqa: E402
from test_torch_faults import check_skipped, on_device, run  # noqa: E402

from lowgrad.torch import attach  # noqa: E402

pytestmark = pytest.mark.gpu


def cuda_threads(world: int) -> dict[str, Any]:
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    return {"backend": "cuda", "share_gpu": world > 1, "timeout": 60}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("fault", ["nan", "forward", "backward", "data"])
def test_cuda_faulted_step_is_skipped_and_leaves_no_trace(world: int, fault: str) -> None:
    threads = cuda_threads(world)
    check_skipped(world, run(world, fault, fault_rank=world - 1, **threads), run(world, "skip", **threads))


def test_loopback_refuses_a_second_backward_like_every_communicator() -> None:
    def job(c: Any) -> str:
        model = Tiny().to(on_device(c))
        att = attach(model, c, strategy="scatter_reduce")
        with pytest.raises(ProtocolError, match="second backward"):
            with att.micro_step(0, 1):
                loss(model, c.rank, 0).backward()
                loss(model, c.rank, 1).backward()
        assert all(p.grad is None for p in model.parameters()) and not att.gm.in_micro_step
        with att.micro_step(0, 1):
            loss(model, c.rank, 2).backward()
        att.close()
        return "ok"
    assert lg.run_threads(2, job, **cuda_threads(2)) == ["ok", "ok"]
