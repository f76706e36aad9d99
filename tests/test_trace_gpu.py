"""The trace on the CUDA backend goes through the ``lowgrad`` logger like the host backend's:
kernel launches (grid, block, stream), copies and NCCL calls as DEBUG records a user handler
receives. Needs a GPU (``gpu`` marker) and skips cleanly without one."""
from __future__ import annotations

import logging

import numpy as np
import pytest
from helpers import Records

import lowgrad as lg
from lowgrad.base import trace
from lowgrad.cuda import nccl

pytestmark = pytest.mark.gpu


@pytest.mark.timeout(180)
def test_cuda_kernels_copies_and_nccl_reach_a_user_handler(gpu: lg.Device) -> None:
    logger, h = logging.getLogger("lowgrad"), Records()
    level = logger.level
    logger.addHandler(h)
    logger.setLevel(logging.DEBUG)
    comm = lg.Communicator(0, 1, nccl.unique_id(), gpu, timeout=60)
    try:
        assert trace.ENABLED
        a = lg.from_numpy(np.ones(256, np.float32), gpu, name="trg_a")
        b = lg.from_numpy(np.ones(256, np.float32), gpu, name="trg_b")
        lg.ops.add_sr(a, a, b, 1.0, 1)
        lg.ops.copy(b, a)
        comm.all_reduce(a)
        comm.wait()
        gpu.synchronize()
    finally:
        comm.close()
        logger.setLevel(level)
        logger.removeHandler(h)
    kinds = {(r.trace_kind, r.trace_name) for r in h.records}  # type: ignore[attr-defined]
    assert ("nccl", "ncclAllReduce") in kinds
    assert any(k == "copy" for k, _ in kinds)
    launches = [r for r in h.records if r.trace_kind == "kernel"]  # type: ignore[attr-defined]
    assert launches and all("grid=" in r.getMessage() and "block=" in r.getMessage() for r in launches)
    assert any("add_sr" in r.trace_name for r in launches)  # type: ignore[attr-defined]
