"""Element types: names that cannot be parsed are refused.
"""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from props import BAD, FEW, host


@FEW
@given(st.sampled_from([",", "01", "1)", "0(", "(2", "f4,"]))
def test_as_dtype_rejects_unparsable_strings(s) -> None:
    with pytest.raises(BAD):
        host().alloc((2,), s, kind="host", name="x")
