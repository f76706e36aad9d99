"""``create_gradient_manager``'s ``strategy``: a value that is not a str is a TypeError naming the
argument and the strategies, raised before anything is allocated; the corrected call works."""
from __future__ import annotations

from typing import Any

import pytest

import lowgrad as lg
from lowgrad.managers import STRATEGIES


def layout() -> lg.Layout:
    return lg.Layout(block=(lg.ParamSpec("w", (8, 4)),), non_block=(lg.ParamSpec("emb", (6, 4)),), num_layers=2)


@pytest.mark.parametrize("bad", [["unsharded"], {"unsharded": 1}, ("unsharded",), None, 1, b"unsharded"])
def test_a_strategy_that_is_not_a_str_is_a_type_error(bad: Any) -> None:
    def create(comm: Any) -> str:
        before = comm.device.memory_report().as_dict()
        with pytest.raises(TypeError) as info:
            lg.create_gradient_manager(layout(), comm, strategy=bad)
        assert comm.device.memory_report().as_dict() == before
        gm = lg.create_gradient_manager(layout(), comm, strategy="unsharded")
        gm.close()
        return str(info.value)

    (message,) = lg.run_threads(1, create)
    assert message.startswith("strategy must be a str") and all(repr(s) in message for s in STRATEGIES)
    assert "unhashable" not in message


def test_an_unknown_strategy_name_stays_a_value_error() -> None:
    with pytest.raises(ValueError, match="unknown strategy 'zero3'"):
        lg.run_threads(1, lambda c: lg.create_gradient_manager(layout(), c, strategy="zero3"))
