"""The sharded managers' rounding modes on the host backend, against an independent numpy model of
the definition: "sr" draws the noise of the per-use seed of (step, micro-step, layer, tensor),
"ldsr" the noise of micro-step 0's seed plus micro-step * 40503 (mod 2**16), "rn" rounds to
nearest even (as ml_dtypes does). Also: the reference's shift and nearest arguments, and misuse."""
from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest
from test_managers import bf16_grad, drive, small_layout

import lowgrad as lg
from lowgrad.sr import reference
from lowgrad.sr.philox import sr_noise
from lowgrad.sr.seedcounter import LD_STEP, ld_shift

BF16 = ml_dtypes.bfloat16


def test_reference_shift_and_nearest() -> None:
    rng = np.random.default_rng(5)
    x = (rng.standard_normal(4099) * 3).astype(np.float32)
    x[:4] = [1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -(1.0 + 2 ** -8), 3.0e38]  # two ties (to even: down, up), overflow
    u = x.view(np.uint32)
    for shift in (0, 1, 40503, 65535):
        want = ((u + ((sr_noise(9, 5, x.size).astype(np.uint32) + shift) & 0xFFFF)) >> 16).astype(np.uint16)
        assert np.array_equal(reference.round_sr(x, 9, 5, lg.bf16, shift).view(np.uint16), want), shift
    assert np.array_equal(reference.round_sr(x, 9, 5, lg.bf16, nearest=True).view(np.uint16),
                          x.astype(BF16).view(np.uint16))
    assert ld_shift(3) == 3 * LD_STEP % 65536 and ld_shift(0) == 0
    with pytest.raises(ValueError, match="shift"):
        reference.round_sr(x, 9, 5, lg.bf16, 1 << 16)


def model(layout: lg.Layout, rounding: str, micro: int, steps: int, seed: int = 0) -> dict[str, np.ndarray]:
    """The shards of a scatter_reduce manager at world 1 fed bf16_grad, from the definition."""
    out = {}
    for layer in range(layout.num_layers):
        for i, s in enumerate(layout.block):
            for step in range(steps):
                acc = bf16_grad(0, 0, layer, i, s.shape, step).astype(BF16).reshape(-1)  # micro-step 0: a copy
                for m in range(1, micro):
                    total = acc.astype(np.float32) + bf16_grad(0, m, layer, i, s.shape, step).reshape(-1)
                    if rounding == "rn":
                        acc = total.astype(BF16)
                        continue
                    use = lg.use_seed(seed, step, 0 if rounding == "ldsr" else m, layer, i, 0)
                    noise = sr_noise(use, 0, total.size).astype(np.uint32)
                    if rounding == "ldsr":
                        noise = (noise + m * LD_STEP) & 0xFFFF
                    acc = ((total.view(np.uint32) + noise) >> 16).astype(np.uint16).view(BF16)
            out[f"{layer}.{s.name}"] = acc.astype(np.float64).reshape(s.shape)
    return out


@pytest.mark.parametrize("rounding", ["sr", "ldsr", "rn"])
def test_scatter_reduce_rounds_as_defined(rounding: str) -> None:
    layout, micro, steps = small_layout(), 5, 2

    def job(c: Any) -> dict[str, np.ndarray]:
        gm = lg.create_gradient_manager(layout, c, strategy="scatter_reduce", rounding=rounding)
        return drive(c, layout, "scatter_reduce", False, micro, steps=steps, gm=gm, gfun=bf16_grad)
    (got,) = lg.run_threads(1, job)
    want = model(layout, rounding, micro, steps)
    for k, v in want.items():
        assert np.array_equal(got[k], v), (rounding, k)


def test_roundings_differ_and_the_default_is_documented() -> None:
    layout = small_layout()
    results = {}
    for rounding in lg.ROUNDINGS:
        def job(c: Any, rounding: str = rounding) -> dict[str, np.ndarray]:
            gm = lg.create_gradient_manager(layout, c, strategy="all_to_all", rounding=rounding)
            assert gm.rounding == rounding and gm.state_dict()["rounding"] == rounding
            return drive(c, layout, "all_to_all", False, 4, gm=gm)
        results[rounding] = lg.run_threads(2, job)[0]
    assert not np.array_equal(results["sr"]["0.w1"], results["ldsr"]["0.w1"])
    assert not np.array_equal(results["sr"]["0.w1"], results["rn"]["0.w1"])

    def default(c: Any) -> str | None:
        gm = lg.create_gradient_manager(layout, c, strategy="scatter_reduce")
        unsharded = lg.create_gradient_manager(layout, c, strategy="unsharded")
        gm.close(), unsharded.close()
        return gm.rounding, unsharded.rounding
    assert lg.run_threads(1, default) == [(lg.DEFAULT_ROUNDING, None)]


def test_rounding_misuse() -> None:
    layout = small_layout()

    def job(c: Any) -> None:
        with pytest.raises(ValueError, match="rounding must be one of"):
            lg.create_gradient_manager(layout, c, strategy="scatter_reduce", rounding="stochastic")
        with pytest.raises(TypeError, match="rounding must be a str"):
            lg.create_gradient_manager(layout, c, strategy="scatter_reduce", rounding=["sr"])
        with pytest.raises(ValueError, match="unsharded manager rounds nothing"):
            lg.create_gradient_manager(layout, c, strategy="unsharded", rounding="sr")
        gm = lg.create_gradient_manager(layout, c, strategy="scatter_reduce", rounding="ldsr")
        drive(c, layout, "scatter_reduce", False, 1, gm=gm)
        state = gm.state_dict()
        other = lg.create_gradient_manager(layout, c, strategy="scatter_reduce", rounding="sr")
        with pytest.raises(ValueError, match="rounding 'ldsr' does not match this manager's 'sr'"):
            other.load_state_dict(state)
        with pytest.raises(TypeError, match="rounding must be a str"):
            other.load_state_dict({**state, "rounding": ["sr"]})
        gm.close(), other.close()
    lg.run_threads(1, job)
