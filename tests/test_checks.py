"""lowgrad.sr.checks: the one set of SR argument rules, applied alike by lowgrad.ops (tensors) and
lowgrad.sr.reference (numpy arrays)."""
from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest

import lowgrad
from lowgrad import ops
from lowgrad.sr import checks, reference

U64 = 1 << 64


def outcome(fn: Any) -> str:
    """What a call did: "ok" or the exception type's name."""
    try:
        fn()
    except (TypeError, ValueError) as e:
        return type(e).__name__
    return "ok"


@pytest.fixture(scope="module")
def dev() -> lowgrad.HostDevice:
    return lowgrad.HostDevice()


@pytest.mark.parametrize("scale", [1.0, 3, np.float32(2.5), -3.4e38, 1e39, -1e39, float("inf"), float("nan"),
                                   True, None, "1", np.float64(4e38)])
def test_ops_and_reference_take_the_same_scales(dev: lowgrad.HostDevice, scale: Any) -> None:
    """A scale beyond float32's range was accepted by the reference (giving inf) and refused by
    ops; now both refuse it with the same exception, and accept the same values."""
    a = np.ones(4, np.float32)
    t = dev.alloc(4, lowgrad.fp32, kind="host", name="t")
    t.numpy()[:] = 1
    ref = outcome(lambda: reference.add_sr(a, a, scale, 1))
    assert ref == outcome(lambda: ops.add_sr(t, t, dev.alloc(4, lowgrad.fp32, kind="host"), scale, 1))
    assert ref == outcome(lambda: reference.reduce_sr(a, np.ones(8, np.float32), 2, -1, scale, False, 1))
    assert ref == outcome(lambda: checks.check_scale(scale))


def test_reference_add_sr_refuses_a_scale_float32_cannot_hold() -> None:
    a = np.ones(4, np.float32)
    with pytest.raises(ValueError, match="float32"):
        reference.add_sr(a, a, 1e39, 1)


@pytest.mark.parametrize("seed, offset, n", [(0, 0, 4), (U64 - 1, U64 - 4, 4), (U64, 0, 4), (-1, 0, 4),
                                             (0, U64 - 3, 4), (0, U64, 0), (0, U64 - 1, 0), (0, -1, 0),
                                             (np.uint64(7), np.int64(3), 4), (1.0, 0, 4), (0, True, 4)])
def test_ops_and_reference_take_the_same_seeds_and_offsets(dev: lowgrad.HostDevice, seed: Any, offset: Any,
                                                           n: int) -> None:
    """Seeds and index offsets: one rule (an int; offset < 2**64 even for no elements)."""
    a = np.ones(n, np.float32)
    t = dev.alloc(n, lowgrad.fp32, kind="host", name="t")
    ref = outcome(lambda: reference.add_sr(a, a, 1.0, seed, offset))
    assert ref == outcome(lambda: ops.add_sr(t, t, dev.alloc(n, lowgrad.fp32, kind="host"), 1.0, seed, offset))
    assert ref == outcome(lambda: reference.round_sr(a, seed, offset, lowgrad.bf16))


@pytest.mark.parametrize("accumulate", [True, False, np.bool_(True), 0, 1, 2, 1.0, np.int64(1), None])
def test_ops_and_reference_take_the_same_accumulate(dev: lowgrad.HostDevice, accumulate: Any) -> None:
    d, s = np.zeros(4, ml_dtypes.bfloat16), np.ones(8, np.float32)
    td, ts = dev.alloc(4, lowgrad.bf16, kind="host", name="d"), dev.alloc(8, lowgrad.fp32, kind="host", name="s")
    ref = outcome(lambda: reference.reduce_sr(d, s, 2, -1, 1.0, accumulate, 3))
    assert ref == outcome(lambda: ops.reduce_sr(td, ts, 2, accumulate=accumulate, seed=3))


def test_check_seed_has_one_signature_everywhere() -> None:
    assert ops.check_seed is checks.check_seed
    assert checks.check_seed(np.uint64(5)) == 5 and type(checks.check_seed(np.uint64(5))) is int
    assert ops.SR_DTYPES is checks.SR_DTYPES
