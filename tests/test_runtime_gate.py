"""``lowgrad.runtime.gate.DeviceGate``: windows (ranks part-way through queuing a loopback
collective) and device-wide calls exclude each other; windows share; device-wide calls share
and nest in one thread."""
from __future__ import annotations

import threading
from collections.abc import Callable

from lowgrad.runtime.gate import DeviceGate


def started(fn: Callable[[], None]) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def test_a_device_wide_call_waits_until_every_window_has_closed() -> None:
    g, ran = DeviceGate(), threading.Event()
    g.open()
    g.open()

    def device_wide() -> None:
        with g.device_wide:
            ran.set()
    t = started(device_wide)
    g.close()
    assert not ran.wait(0.1)  # one window still open
    g.close()
    assert ran.wait(5)
    t.join(5)


def test_no_window_opens_while_a_device_wide_call_runs() -> None:
    g, opened = DeviceGate(), threading.Event()
    with g.device_wide:
        def window() -> None:
            g.open()
            opened.set()
        t = started(window)
        assert not opened.wait(0.1)
    assert opened.wait(5) and g.windows == 1
    t.join(5)
    g.close()
    assert g.windows == 0


def test_device_wide_calls_nest_and_share() -> None:
    g, other = DeviceGate(), threading.Event()
    with g.device_wide, g.device_wide:  # a synchronize whose drain frees
        def second() -> None:
            with g.device_wide:
                other.set()
        t = started(second)
        assert other.wait(5)  # device-wide calls do not exclude each other
        t.join(5)
    g.open()  # all of them done: a window opens at once
    g.close()


def test_a_failed_device_wide_call_leaves_the_gate_open() -> None:
    g = DeviceGate()
    try:
        with g.device_wide:
            raise RuntimeError("cuMemFree failed")
    except RuntimeError:
        pass
    g.open()
    assert g.windows == 1
    g.close()
