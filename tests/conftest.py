"""Shared fixtures: GPU tests skip with the reason when there is no driver or GPU."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers import mark_threads

from lowgrad.cuda import compiler
from lowgrad.cuda import driver as _cuda

# CUDA reads this when the process creates its context: the loopback tests run up to 8 ranks,
# each waiting on the device in its own hardware queue (docs/loopback.md)
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [it for it in items if it.get_closest_marker("gpu")]
    if not gpu_items:
        return
    reason = _cuda.unavailable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"GPU test: {reason}")
    for it in gpu_items:
        it.add_marker(skip)


@pytest.fixture(autouse=True)
def _mark_threads() -> None:
    """The threads alive before each test (helpers.watchdog_threads lists only later ones)."""
    mark_threads()


@pytest.fixture(scope="session")
def gpu():
    """Device(0) (the test is skipped where CUDA is unavailable)."""
    import lowgrad

    return lowgrad.Device(0)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh LOWGRAD_CACHE_DIR (not created yet) and an empty in-process kernel cache."""
    d = tmp_path / "kernel-cache"
    monkeypatch.setenv("LOWGRAD_CACHE_DIR", str(d))
    compiler.clear_memory_cache()
    return d
