"""A gradient manager's rounding state in the memory of its device: base seed, step, micro-step
and rounding mode, and how many micro-steps the last completed step had (``done``, which tells the
statistics' finish which rows its step measured).

The kernels a manager binds read it when they run and derive the per-use rounding of ``(step,
micro_step, layer, lane = 2 * tensor + phase)`` from it (``kernels/sr.cuh``), instead of taking a
seed from the host at launch:

- ``"sr"``: the Philox noise of the per-use seed of ``(step, micro_step, layer, lane)``;
- ``"ldsr"`` (low-discrepancy SR): the noise of the per-use seed of micro-step 0 plus
  ``micro_step * 40503``, mod 2**16, in every element (:func:`ld_shift`): the rounding errors of
  one element in successive micro-steps anti-correlate. Each rounding's noise is uniform, so one
  rounding of a given value is unbiased; the accumulated sum is not in general (the value rounded
  at micro-step m depends on earlier roundings made with the same noise): it is while an element's
  sum stays in one binade; measured up to 7.7e-4 of |sum| on constant inputs that cross binades,
  at most 3.4 % of its error on varying ones (docs/accuracy.md, "Bias");
- ``"rn"``: round to nearest even, no noise.

A captured CUDA graph therefore draws fresh noise on every replay; the counter advances by
kernels queued on the manager's stream (``kernels/seed_counter.cu``), in the same order in eager
runs and in replays. The host backend keeps it in numpy memory. The counter's layout, the mode
values and the op codes are read from those sources (:mod:`lowgrad.contracts.kernel_source`).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from lowgrad.base.dtypes import byte
from lowgrad.base.limits import U32, U64
from lowgrad.buffers.streams import StreamLike, stream_handle
from lowgrad.contracts.kernel_source import constants, struct_fields
from lowgrad.sr.seeds import use_seeds

_SOURCE = constants("seed_counter")  # with kernels/sr.cuh, which it includes
_FIELDS = struct_fields("seed_counter", "SeedCounter")  # scalars only (kernels/sr.cuh)
#: the layout of ``struct SeedCounter``: its fields with C's natural alignment
COUNTER_DTYPE = np.dtype({"names": [f.name for f in _FIELDS], "formats": [np.dtype(f.ctype) for f in _FIELDS]},
                         align=True)
#: the rounding modes and their ``mode`` values: ``ROUND_<MODE>`` of kernels/sr.cuh, in its order
ROUNDINGS = {k.removeprefix("ROUND_").lower(): v for k, v in _SOURCE.items() if k.startswith("ROUND_")}
#: the sharded managers' rounding unless told otherwise: less error than SR from 16 micro-steps on, for
#: a bias of the sum on constant gradients (tools/accuracy_bias.py; docs/accuracy.md, "Bias")
DEFAULT_ROUNDING = "ldsr"
LD_STEP = _SOURCE["LD_STEP"]  # round(0.6180339887 * 2**16): the golden-ratio increment of low-discrepancy SR
#: the ops of kernels/seed_counter.cu
SET, NEXT_MICRO, NEXT_STEP = _SOURCE["SET"], _SOURCE["NEXT_MICRO"], _SOURCE["NEXT_STEP"]
#: the largest step the counter holds; ``next_step`` from it would wrap to 0 (repeating step 0's
#: noise), so a manager never starts step ``LAST_STEP`` (the step after it would not fit)
LAST_STEP = U32 - 1


class Rounding(NamedTuple):
    """How one kernel rounds: the Philox noise of ``seed`` plus ``shift`` (mod 2**16), or to
    nearest even (``nearest``); ``struct Rounding`` of kernels/sr.cuh."""
    seed: int
    shift: int = 0
    nearest: bool = False


def ld_shift(micro_step: int) -> int:
    """The noise shift of low-discrepancy SR at ``micro_step``: ``micro_step * 40503 mod 2**16``."""
    return micro_step * LD_STEP & 0xFFFF


def check_rounding(rounding: Any) -> str:
    """``rounding`` if it names a rounding mode; TypeError for a non-str, ValueError otherwise."""
    if not isinstance(rounding, str):
        raise TypeError(f"rounding must be a str, one of {', '.join(map(repr, ROUNDINGS))}, got {rounding!r}")
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {', '.join(map(repr, ROUNDINGS))}, got {rounding!r}")
    return str(rounding)


class SeedCounter:
    """A ``struct SeedCounter`` (:data:`COUNTER_DTYPE`) named ``seed_counter`` on ``device``,
    updated asynchronously on a stream; ``rounding`` one of :data:`ROUNDINGS`."""

    def __init__(self, device: Any, base_seed: int, step: int, stream: StreamLike = None,
                 rounding: str = "sr") -> None:
        self.device = device
        self.mode = ROUNDINGS[check_rounding(rounding)]
        self.tensor = device.alloc(COUNTER_DTYPE.itemsize, byte, name="seed_counter")
        self._update = device.kernels.seed_counter
        self.set(base_seed, step, stream)

    def set(self, base_seed: int, step: int, stream: StreamLike = None) -> None:
        """Base seed ``base_seed``, step ``step``, micro-step 0 (queued on ``stream``)."""
        if not 0 <= base_seed < U64 or not 0 <= step < U32:
            raise ValueError(f"seed counter: base seed {base_seed} must be in [0, 2**64), step {step} in [0, 2**32)")
        self._update(self.tensor, SET, base_seed, step, self.mode, stream_handle(stream))

    def next_micro(self, stream: int) -> None:
        """Micro-step += 1 (queued on the raw stream ``stream``)."""
        self._update(self.tensor, NEXT_MICRO, 0, 0, 0, stream)

    def next_step(self, stream: int) -> None:
        """Step += 1, micro-step 0, and ``done``: the finished step's micro-steps (queued on the
        raw stream ``stream``)."""
        self._update(self.tensor, NEXT_STEP, 0, 0, 0, stream)

    def host_roundings(self, layer: int, lanes: list[int]) -> list[Rounding]:
        """The roundings of ``(layer, lane)`` at the counter's present value (host backend: the
        counter lives in host memory and the host kernels run when queued)."""
        return roundings(self.tensor.numpy().view(COUNTER_DTYPE)[0], layer, lanes)

    def close(self) -> None:
        self.tensor.close()


def roundings(c: Any, layer: int, lanes: list[int]) -> list[Rounding]:
    """The roundings of ``(layer, lane)`` a ``COUNTER_DTYPE`` record ``c`` gives (what
    ``counter_rounding`` in kernels/sr.cuh computes)."""
    mode, micro = int(c["mode"]), int(c["micro"])
    ld = mode == ROUNDINGS["ldsr"]
    seeds = use_seeds(int(c["base"]), int(c["step"]), 0 if ld else micro, layer,
                      np.asarray(lanes) // 2, np.asarray(lanes) % 2)
    shift, nearest = ld_shift(micro) if ld else 0, mode == ROUNDINGS["rn"]
    return [Rounding(int(x), shift, nearest) for x in seeds]


def apply_op(counter: np.ndarray, op: int, base: int, step: int, mode: int) -> None:
    """What ``seed_counter`` does, on a host ``COUNTER_DTYPE`` record (the host backend)."""
    if op == SET:
        counter["base"], counter["step"], counter["micro"], counter["mode"], counter["done"] = base, step, 0, mode, 0
    elif op == NEXT_MICRO:
        counter["micro"] += 1
    else:
        counter["done"], counter["step"], counter["micro"] = counter["micro"] + 1, counter["step"] + 1, 0
