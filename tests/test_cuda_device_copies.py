"""``Device``'s host copies, allocations and frees on the CPU, against a recording stand-in of the
driver: a copy from pageable host memory (``cuMemcpyHtoD``) returns before its DMA has landed
(CUDA's documented synchronisation behaviour), so the copy is followed by a context synchronise
before it returns; a kernel queued next on a non-blocking stream reads the new bytes.
``copy_to_host`` (``cuMemcpyDtoH``, which returns only once the bytes are in pageable memory)
needs none after. Every driver call that waits for the whole device is made inside the device
gate (``lowgrad.runtime.gate``), marked ``+`` in the record."""
from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from lowgrad.cuda import device as cuda_device
from lowgrad.runtime.gate import DeviceGate


class Driver:
    """The driver calls made, recorded in order, ``+`` after those made inside the device gate
    (each answers CUDA_SUCCESS; an allocation answers an address)."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.gate = DeviceGate()

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any) -> tuple[int, ...]:
            self.calls.append(name + "+" * (self.gate._device_wide > 0))
            return (0, 0x1000) if name.startswith("cuMem") and "Alloc" in name or "GetDevicePointer" in name else (0,)
        return call


@pytest.fixture
def drv(monkeypatch: pytest.MonkeyPatch) -> Driver:
    d = Driver()
    monkeypatch.setattr(cuda_device._cuda, "driver", lambda: d)
    return d


@pytest.fixture
def dev(drv: Driver) -> Any:
    d = object.__new__(cuda_device.Device)  # no GPU (and no Device.__new__): only what the calls touch
    d.activate = lambda: None  # type: ignore[method-assign]
    d.sync_gate, d._ctx = drv.gate, None
    return d


def test_a_copy_from_host_waits_for_its_dma(drv: Driver, dev: Any) -> None:
    dst = SimpleNamespace(name="t", nbytes=16, ptr=0x1000)
    dev.copy_from_host(dst, np.ones(4, np.float32))
    assert drv.calls == ["cuCtxSynchronize+", "cuMemcpyHtoD+", "cuCtxSynchronize+"]


def test_an_empty_copy_makes_no_copy(drv: Driver, dev: Any) -> None:
    dev.copy_from_host(SimpleNamespace(name="t", nbytes=0, ptr=0), np.ones(0, np.float32))
    assert drv.calls == ["cuCtxSynchronize+"]


def test_a_copy_to_host_needs_no_wait_after(drv: Driver, dev: Any) -> None:
    out = np.empty(4, np.float32)
    dev.copy_to_host(out, SimpleNamespace(name="t", nbytes=16, ptr=0x1000))
    assert drv.calls == ["cuCtxSynchronize+", "cuMemcpyDtoH+"]


@pytest.mark.parametrize("kind,alloc,free", [("device", ["cuMemAlloc+"], "cuMemFree+"),
                                             ("pinned", ["cuMemHostAlloc+", "cuMemHostGetDevicePointer+"],
                                              "cuMemFreeHost+")])
def test_allocations_and_frees_pass_the_gate(drv: Driver, dev: Any, kind: str, alloc: list[str], free: str) -> None:
    block = dev._raw_alloc(kind, 64)
    assert drv.calls == alloc
    block.free()
    assert drv.calls == [*alloc, "cuCtxPushCurrent", free, "cuCtxPopCurrent"]


def test_a_device_wide_call_waits_for_an_open_window(drv: Driver, dev: Any) -> None:
    """While a rank is part-way through queuing a loopback collective (a window is open), a free
    waits; it runs once the window closes."""
    block = dev._raw_alloc("device", 64)
    dev.sync_gate.open()
    t = threading.Thread(target=block.free)
    t.start()
    t.join(0.2)
    assert t.is_alive() and "cuMemFree+" not in drv.calls
    dev.sync_gate.close()
    t.join(5)
    assert not t.is_alive() and drv.calls[-2] == "cuMemFree+"
