"""CPU tests of lowgrad.buffers.streams (the stream-argument rule) and the host backend's streams and events."""
from __future__ import annotations

import pytest

import lowgrad as lg
import lowgrad.cuda.driver


def test_stream_arguments() -> None:
    class TorchLike:
        cuda_stream = 1234

    class CupyLike:
        def __cuda_stream__(self) -> tuple[int, int]:
            return (0, 99)

    assert lg.stream_handle(None) == 0 and lg.stream_handle(77) == 77
    assert lg.stream_handle(TorchLike()) == 1234 and lg.stream_handle(CupyLike()) == 99
    for bad in ("stream", 1.5, object(), [1]):
        with pytest.raises(TypeError, match="stream"):
            lg.stream_handle(bad)
    with pytest.raises(ValueError):
        lg.stream_handle(-3)
    h = lg.HostDevice()
    with pytest.raises(TypeError):
        lg.ops.fill_zero(h.alloc(4, lg.fp32, name="z"), stream="default")


def test_host_events_and_streams() -> None:
    h = lg.HostDevice()
    s = h.stream(priority=0)
    e0, e1 = h.event(timing=True), h.event(timing=True)
    e0.record(s)
    e1.record(s)
    assert e0.query() and s.query() and e0.elapsed_ms(e1) >= 0
    with pytest.raises(ValueError):
        h.event().elapsed_ms(h.event())
