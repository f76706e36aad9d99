"""lowgrad.torch's statistics reads on the CPU (host backend): ``read_stats`` carries the module's
parameter names and equals ``step_stats``. Skipped without torch."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import lowgrad as lg

torch = pytest.importorskip("torch")
from test_torch_adapter import Tiny, loss  # noqa: E402

from lowgrad.torch import attach  # noqa: E402


def test_read_stats_carries_the_module_names() -> None:
    def job(comm: Any) -> None:
        model = Tiny()
        att = attach(model, comm, strategy="scatter_reduce", seed=7, stats=True)
        for m in range(2):
            with att.micro_step(m, 2):
                loss(model, comm.rank, m).backward()
        reading = att.read_stats()
        got = reading.result()
        want = att.step_stats()
        assert got.names == want.names and "layers.2.down_proj.weight" in got.names and "norm" in got.names
        assert np.array_equal(got.accumulated.sumsq, want.accumulated.sumsq)
        assert reading.result() is got
        att.close()
    lg.run_threads(2, job, backend="host")
