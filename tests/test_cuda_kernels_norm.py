"""``CudaKernels.norm_squared`` on the CPU, its launches recorded instead of run: the two stages of
one norm share a per-stream workspace, so on a stream that several threads use (ranks sharing a
GPU as threads, the loopback) no other norm's stage may be queued between them. The GPU test
(tests/test_kernels_gpu.py::test_norms_of_threads_sharing_a_stream_do_not_mix) checks the sums."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

from lowgrad.cuda.kernels import CudaKernels


class Stage:
    """A kernel that records ``(stage, thread, stream)`` per launch and yields the GIL meanwhile
    (as ``cuLaunchKernel``, a C call, lets other threads run)."""

    def __init__(self, n: int, queue: list[tuple[int, str, int]]) -> None:
        self.n, self.queue, self.block = n, queue, 256

    def launch(self, grid: int, stream: int, *args: Any) -> None:
        self.queue.append((self.n, threading.current_thread().name, stream))
        time.sleep(0.001)


def test_a_norms_two_stages_are_adjacent_on_a_shared_stream() -> None:
    queue: list[tuple[int, str, int]] = []
    k = CudaKernels.__new__(CudaKernels)  # no GPU: only what norm_squared touches
    k.group_elems = 8
    k._workspaces = {}
    k._norm_lock = threading.Lock()
    k.device = SimpleNamespace(alloc=lambda *a, **kw: SimpleNamespace(ptr=0x1000))
    stages = (Stage(1, queue), Stage(2, queue))
    k._norm_stages = lambda x_dt, out_dt: stages  # type: ignore[method-assign]
    x = SimpleNamespace(dtype="fp32", numel=10_000, ptr=0x2000)
    out = SimpleNamespace(dtype="fp32", ptr=0x3000)

    def rank() -> None:
        for _ in range(20):
            k.norm_squared(x, out, False, 0)  # type: ignore[arg-type]
    threads = [threading.Thread(target=rank, name=f"rank{r}") for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(queue) == 4 * 20 * 2
    pairs = list(zip(queue[::2], queue[1::2]))
    assert all(a[0] == 1 and b[0] == 2 and a[1] == b[1] for a, b in pairs), "another norm's stage came between"
