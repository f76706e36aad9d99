"""Shared fixtures: GPU tests skip with the reason when there is no driver or GPU."""
from __future__ import annotations

import pytest

from lowgrad.cuda import driver as _cuda


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


@pytest.fixture(scope="session")
def gpu():
    """Device(0) (the test is skipped where CUDA is unavailable)."""
    import lowgrad

    return lowgrad.Device(0)
