"""Properties of per-use seeds (``lowgrad.sr.seeds``): out-of-range arguments raise, valid ones are Philox.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from props import BAD, MEDIUM, U64

from lowgrad.sr import seeds
from lowgrad.sr.philox import philox4x32_10


@MEDIUM
@given(st.data())
def test_use_seed_rejects_out_of_range(data) -> None:
    args = dict(base_seed=0, step=0, micro_step=0, layer=0, tensor=0, phase=0)
    key = data.draw(st.sampled_from(list(args)))
    limit = U64 if key == "base_seed" else (2 if key == "phase" else 1 << 32)
    if key == "tensor":
        limit = 1 << 31  # 2 * tensor + phase must fit 32 bits
    args[key] = data.draw(st.one_of(st.integers(max_value=-1), st.integers(min_value=limit), st.floats(),
                                    st.booleans(), st.none(), st.text(max_size=2)))
    with pytest.raises(BAD):
        seeds.use_seed(**args)


@MEDIUM
@given(st.integers(0, U64 - 1), st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1),
       st.integers(0, 2**31 - 1), st.integers(0, 1))
def test_use_seed_valid_is_philox(base, step, micro, layer, tensor, phase) -> None:
    s = seeds.use_seed(base, step, micro, layer, tensor, phase)
    w = philox4x32_10(np.array([step, micro, layer, 2 * tensor + phase], np.uint32),
                      np.array([base & 0xFFFFFFFF, base >> 32], np.uint32))
    assert type(s) is int and s == int(w[0]) | int(w[1]) << 32
