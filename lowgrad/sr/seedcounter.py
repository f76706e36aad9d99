"""A gradient manager's seed state in the memory of its device: base seed, step and micro-step.

The SR kernels a manager binds read it when they run and derive DESIGN.md's per-use seed of
``(step, micro_step, layer, lane = 2 * tensor + phase)`` from it (``kernels/sr.cuh``), instead of
taking a seed from the host at launch. A captured CUDA graph therefore draws fresh noise on every
replay; the counter advances by kernels queued on the manager's stream (``kernels/seed_counter.cu``),
in the same order in eager runs and in replays. The host backend keeps it in numpy memory.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from lowgrad.core.dtypes import byte
from lowgrad.core.limits import U32, U64
from lowgrad.core.streams import StreamLike, stream_handle
from lowgrad.sr.seeds import use_seeds

#: the layout of ``struct SeedCounter`` (kernels/sr.cuh)
COUNTER_DTYPE = np.dtype([("base", "<u8"), ("step", "<u4"), ("micro", "<u4")])
SET, NEXT_MICRO, NEXT_STEP = 0, 1, 2  # the ops of kernels/seed_counter.cu
#: the largest step the counter holds; ``next_step`` from it would wrap to 0 (repeating step 0's
#: noise), so a manager never starts step ``LAST_STEP`` (the step after it would not fit)
LAST_STEP = U32 - 1


class SeedCounter:
    """16 bytes named ``seed_counter`` on ``device``, updated asynchronously on a stream."""

    def __init__(self, device: Any, base_seed: int, step: int, stream: StreamLike = None) -> None:
        self.device = device
        self.tensor = device.alloc(COUNTER_DTYPE.itemsize, byte, name="seed_counter")
        self._update = device.kernels.seed_counter
        self.set(base_seed, step, stream)

    def set(self, base_seed: int, step: int, stream: StreamLike = None) -> None:
        """Base seed ``base_seed``, step ``step``, micro-step 0 (queued on ``stream``)."""
        if not 0 <= base_seed < U64 or not 0 <= step < U32:
            raise ValueError(f"seed counter: base seed {base_seed} must be in [0, 2**64), step {step} in [0, 2**32)")
        self._update(self.tensor, SET, base_seed, step, stream_handle(stream))

    def next_micro(self, stream: int) -> None:
        """Micro-step += 1 (queued on the raw stream ``stream``)."""
        self._update(self.tensor, NEXT_MICRO, 0, 0, stream)

    def next_step(self, stream: int) -> None:
        """Step += 1, micro-step 0 (queued on the raw stream ``stream``)."""
        self._update(self.tensor, NEXT_STEP, 0, 0, stream)

    def host_seeds(self, layer: int, lanes: list[int]) -> list[int]:
        """The seeds of ``(layer, lane)`` at the counter's present value (host backend: the
        counter lives in host memory and the host kernels run when queued)."""
        c = self.tensor.numpy().view(COUNTER_DTYPE)[0]
        return [int(x) for x in use_seeds(int(c["base"]), int(c["step"]), int(c["micro"]), layer,
                                          np.asarray(lanes) // 2, np.asarray(lanes) % 2)]

    def close(self) -> None:
        self.tensor.close()


def apply_op(counter: np.ndarray, op: int, base: int, step: int) -> None:
    """What ``seed_counter`` does, on a host ``COUNTER_DTYPE`` record (the host backend)."""
    if op == SET:
        counter["base"], counter["step"], counter["micro"] = base, step, 0
    elif op == NEXT_MICRO:
        counter["micro"] += 1
    else:
        counter["step"], counter["micro"] = counter["step"] + 1, 0
