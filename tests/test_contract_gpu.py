"""The backend contract on a GPU: what the CUDA backend reports per memory kind (and so what
DLPack and the CUDA array interface say), its streams and events against the shared protocols,
its stream priorities and capture lookup. The host half is tests/test_contract.py."""
from __future__ import annotations

import numpy as np
import pytest

import lowgrad as lg
from lowgrad.buffers import dlpack
from lowgrad.buffers.memory import KIND_ACCESS, KINDS
from lowgrad.contracts.backend import Event, Stream

pytestmark = pytest.mark.gpu


def test_cuda_allocations_report_the_access_of_their_kind(gpu: lg.Device) -> None:
    want = {"device": (dlpack.KDL_CUDA, gpu.ordinal), "pinned": (dlpack.KDL_CUDA_HOST, 0),
            "write_combined": (dlpack.KDL_CUDA_HOST, 0), "host": (dlpack.KDL_CPU, 0)}
    for kind in KINDS:
        with gpu.alloc((4, 2), lg.fp32, kind=kind, name=f"contract_{kind}") as t:
            a = t.allocation
            assert (a.device_accessible, a.host_accessible) == KIND_ACCESS[kind], kind
            assert t.__dlpack_device__() == want[kind], kind
            if a.device_accessible:
                assert t.__cuda_array_interface__["data"] == (t.ptr, False)
            else:
                assert not hasattr(t, "__cuda_array_interface__")
            if a.host_accessible:  # a view, no copy: writes through numpy() are the memory
                t.numpy()[:] = 3.0
                assert np.array_equal(t.numpy(), np.full((4, 2), 3.0, np.float32))


def test_cuda_streams_and_events_satisfy_the_protocols(gpu: lg.Device) -> None:
    lo, hi = gpu.stream_priority_range
    with gpu.stream(priority=hi) as s:
        assert isinstance(s, Stream) and isinstance(gpu.default_stream, Stream)
        assert isinstance(gpu.resolve_stream(s.handle), Stream)
        e = gpu.event(name="contract")
        assert isinstance(e, Event)
        e.record(s)
        e.wait(gpu.default_stream)
        e.synchronize()
        assert e.query() and s.query()
        assert gpu.capture_of(s) is None
        e.close()
    with pytest.raises(TypeError, match="priority must be an int"):
        gpu.stream(priority=float(lo))  # type: ignore[arg-type]
