"""The device-side seed counter (``lowgrad.sr.seedcounter.SeedCounter``): range checks of base seed and step.
"""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from props import FEW, U64, host

from lowgrad.sr.seedcounter import SeedCounter


@FEW
@given(st.one_of(st.integers(max_value=-1), st.integers(min_value=U64)), st.integers(0, 3),
       st.integers(min_value=1 << 32), st.integers(0, 3))
def test_seed_counter_rejects_out_of_range_base_and_step(bad_base, ok_step, bad_step, ok_base) -> None:
    dev = host()
    with pytest.raises(ValueError):
        SeedCounter(dev, bad_base, ok_step)
    with pytest.raises(ValueError):
        SeedCounter(dev, ok_base, bad_step)
