"""``Device.copy_from_host`` on the CPU, against a recording stand-in of the driver: a copy from
pageable host memory (``cuMemcpyHtoD``) returns before its DMA has landed (CUDA's documented
synchronisation behaviour), so the copy is followed by a context synchronise before it returns;
a kernel queued next on a non-blocking stream reads the new bytes. ``copy_to_host``
(``cuMemcpyDtoH``, which returns only once the bytes are in pageable memory) needs none after."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from lowgrad.cuda import device as cuda_device


class Driver:
    """The driver calls a host copy makes, recorded in order (each answers CUDA_SUCCESS)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any) -> tuple[int]:
            self.calls.append(name)
            return (0,)
        return call


@pytest.fixture
def drv(monkeypatch: pytest.MonkeyPatch) -> Driver:
    d = Driver()
    monkeypatch.setattr(cuda_device._cuda, "driver", lambda: d)
    return d


def _device() -> Any:
    dev = object.__new__(cuda_device.Device)  # no GPU (and no Device.__new__): only what the copies touch
    dev.activate = lambda: None  # type: ignore[method-assign]
    return dev


def test_a_copy_from_host_waits_for_its_dma(drv: Driver) -> None:
    dst = SimpleNamespace(name="t", nbytes=16, ptr=0x1000)
    _device().copy_from_host(dst, np.ones(4, np.float32))  # type: ignore[arg-type]
    assert drv.calls == ["cuCtxSynchronize", "cuMemcpyHtoD", "cuCtxSynchronize"]


def test_an_empty_copy_makes_no_copy(drv: Driver) -> None:
    _device().copy_from_host(SimpleNamespace(name="t", nbytes=0, ptr=0), np.ones(0, np.float32))  # type: ignore[arg-type]
    assert drv.calls == ["cuCtxSynchronize"]


def test_a_copy_to_host_needs_no_wait_after(drv: Driver) -> None:
    out = np.empty(4, np.float32)
    _device().copy_to_host(out, SimpleNamespace(name="t", nbytes=16, ptr=0x1000))  # type: ignore[arg-type]
    assert drv.calls == ["cuCtxSynchronize", "cuMemcpyDtoH"]
