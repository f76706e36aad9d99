"""The written backend contract (lowgrad.contracts.backend, lowgrad.contracts.communicator) on the host:
both backends implement every abstract method, streams and events satisfy one protocol, stream
priorities and capture lookup exist on both, DLPack/CAI follow the allocation's reported access
(not the backend's name), and the manager's state modules (protocol, replay, state) on their own.
The CUDA half is tests/test_contract_gpu.py."""
from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import pytest
from test_managers import drive, small_layout

import lowgrad as lg
from lowgrad.buffers import dlpack
from lowgrad.buffers.memory import KIND_ACCESS, KINDS, RawBlock, aligned_host_buffer
from lowgrad.contracts.backend import DeviceBase, Event, Stream
from lowgrad.contracts.communicator import CommBase
from lowgrad.cuda.communicator import Communicator
from lowgrad.cuda.device import Device
from lowgrad.cuda.stream import Event as CudaEvent
from lowgrad.cuda.stream import Stream as CudaStream
from lowgrad.host.communicator import HostCommunicator
from lowgrad.managers import ProtocolError
from lowgrad.managers.protocol import MicroStepState
from lowgrad.managers.state import ManagerState

DEVICE_CONTRACT = {"activate", "synchronize", "stream", "event", "stream_priority_range", "capture_of", "kernels",
                   "memory_limit", "_raw_alloc", "_wrap_stream", "_copy", "copy_to_host", "copy_from_host"}
COMM_CONTRACT = {"reduce_scatter", "all_gather", "all_reduce", "send", "recv", "all_to_all_many", "barrier", "wait",
                 "host_allgather", "abort", "close", "_group_begin", "_group_close"}


def _members(proto: type) -> set[str]:
    return {n for n in (*vars(proto), *getattr(proto, "__annotations__", {})) if not n.startswith("_")}


@pytest.mark.parametrize("cls", [Device, lg.HostDevice])
def test_both_devices_implement_the_whole_device_contract(cls: type) -> None:
    assert DEVICE_CONTRACT <= DeviceBase.__abstractmethods__
    assert not inspect.isabstract(cls)
    for name in DeviceBase.__abstractmethods__:  # written by the backend, not inherited
        assert any(name in vars(c) for c in cls.__mro__[:cls.__mro__.index(DeviceBase)]), (cls, name)


@pytest.mark.parametrize("cls", [Communicator, HostCommunicator])
def test_both_communicators_implement_the_whole_comm_contract(cls: type) -> None:
    assert COMM_CONTRACT <= CommBase.__abstractmethods__
    assert not inspect.isabstract(cls)
    assert cls.group is CommBase.group and cls.all_to_all is CommBase.all_to_all  # written once


def test_the_cuda_communicators_share_one_half() -> None:
    """NCCL's and the loopback's wait, host_allgather, stream choice and end of group are written
    once (lowgrad.cuda.gpu_comm, lowgrad.contracts.communicator); each backend fills only the hooks."""
    from lowgrad.cuda.gpu_comm import GpuCommBase
    from lowgrad.cuda.loopback import LoopbackCommunicator
    for cls in (Communicator, LoopbackCommunicator):
        assert not inspect.isabstract(cls)
        for name in ("wait", "host_allgather", "_stream", "_poll", "_group_end"):
            assert all(name not in vars(c) for c in cls.__mro__[:cls.__mro__.index(GpuCommBase)]), (cls, name)
        for name in ("_watch", "_failure", "_host_buffer", "_host_gather", "_group_close"):
            assert name in vars(cls), (cls, name)


def test_communicators_say_whether_they_meet_their_peers_on_the_host() -> None:
    """The PyTorch adapter decides from this capability (never from a class name) whether a rank
    may issue collectives from autograd's shared thread."""
    from lowgrad.cuda.loopback import LoopbackCommunicator
    assert Communicator.meets_peers_on_host is False  # NCCL queues and returns
    assert HostCommunicator.meets_peers_on_host is True and LoopbackCommunicator.meets_peers_on_host is True
    assert lg.run_threads(2, lambda c: c.meets_peers_on_host) == [True, True]


def test_streams_and_events_of_both_backends_satisfy_one_protocol() -> None:
    h = lg.HostDevice()
    for s in (h.stream(), h.default_stream, h.resolve_stream(1234)):
        assert isinstance(s, Stream)
    assert isinstance(h.event(), Event)
    for proto, cls in ((Stream, CudaStream), (Event, CudaEvent)):  # no GPU needed to read the class
        for name in _members(proto):
            assert hasattr(cls, name) or name in cls.__slots__, (cls, name)
    assert {"record", "wait", "query", "synchronize", "elapsed_ms", "close", "name", "timing"} <= _members(Event)
    assert {"synchronize", "query", "wait", "close", "handle", "priority"} <= _members(Stream)


def test_host_stream_priorities_and_capture_lookup_follow_the_contract() -> None:
    h = lg.HostDevice()
    assert h.stream_priority_range == (0, 0)
    assert h.stream(priority=0).priority == 0
    with pytest.raises(ValueError, match="priority -1 outside the device's range"):
        h.stream(priority=-1)
    with pytest.raises(TypeError, match="priority must be an int"):
        h.stream(priority=0.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="priority must be an int"):
        h.stream(priority=True)
    assert h.capture_of(h.stream()) is None and h.capture_of(None) is None


class MappedHost(lg.HostDevice):
    """A host device whose raw blocks report GPU-like access per kind (KIND_ACCESS) as GPU
    ``ordinal`` 3: what a tensor exports must follow the report, not the backend's name."""

    ordinal = 3

    def _raw_alloc(self, kind: str, nbytes: int) -> RawBlock:
        ptr, view = aligned_host_buffer(nbytes)
        on_device, on_host = KIND_ACCESS[kind]
        return RawBlock(ptr, lambda: view.size and None, view if on_host else None, on_device)


def test_dlpack_and_cuda_array_interface_follow_the_reported_access() -> None:
    want = {"device": (dlpack.KDL_CUDA, 3), "pinned": (dlpack.KDL_CUDA_HOST, 0),
            "write_combined": (dlpack.KDL_CUDA_HOST, 0), "host": (dlpack.KDL_CPU, 0)}
    fake, host = MappedHost(), lg.HostDevice()
    for kind in KINDS:
        t = fake.alloc((2, 3), lg.fp32, kind=kind, name=kind)
        assert (t.allocation.device_accessible, t.allocation.host_accessible) == KIND_ACCESS[kind]
        assert t.__dlpack_device__() == want[kind], kind
        if KIND_ACCESS[kind][0]:
            cai = t.__cuda_array_interface__
            assert cai["data"] == (t.ptr, False) and cai["shape"] == (2, 3) and cai["version"] == 3
        else:
            with pytest.raises(AttributeError, match="__cuda_array_interface__"):
                t.__cuda_array_interface__
        u = host.alloc(4, lg.fp32, kind=kind, name=kind)  # the host backend: CPU memory whatever the kind
        assert (u.allocation.device_accessible, u.allocation.host_accessible) == (False, True)
        assert u.__dlpack_device__() == (dlpack.KDL_CPU, 0)
        assert not hasattr(u, "__cuda_array_interface__")
        u.numpy()[:] = 2.5
        assert np.from_dlpack(u).tolist() == [2.5] * 4


def test_dlpack_device_of_an_uncommitted_lazy_tensor_raises() -> None:
    lazy = lg.HostDevice().lazy_allocator()
    t = lazy.alloc(4, lg.fp32, name="pending")
    with pytest.raises(lg.ClosedError, match="before its lazy allocator was committed"):
        t.__dlpack_device__()
    with pytest.raises(lg.ClosedError, match="before its lazy allocator was committed"):
        t.__cuda_array_interface__
    lazy.commit()
    assert t.__dlpack_device__() == (dlpack.KDL_CPU, 0)


def test_float_of_the_grad_norm_and_of_one_element_tensors() -> None:
    layout = small_layout()

    def job(c: Any) -> tuple[float, float]:
        gm = lg.create_gradient_manager(layout, c, strategy="unsharded")
        drive(c, layout, "unsharded", False, 2, gm=gm)
        norm = gm.grad_norm_squared()
        assert norm.shape == (1,) and norm.dtype is lg.fp32
        return float(norm), float(norm.numpy()[0])

    for got, want in lg.run_threads(2, job):
        assert isinstance(got, float) and got == want > 0
    h = lg.HostDevice()
    with pytest.raises(TypeError, match="one-element"):
        float(h.alloc(2, lg.fp32, name="two"))
    one = h.alloc((1, 1), lg.bf16, name="one")
    one.numpy()[:] = 1.5
    assert float(one) == 1.5


def test_micro_step_state_machine_on_its_own() -> None:
    st = MicroStepState(num_layers=2)
    with pytest.raises(ProtocolError, match="expected 0"):
        st.check_start(1, 2, step=0)
    st.check_start(0, 2, step=0)
    st.start(0, 2)
    saved = st.copy()
    with pytest.raises(ProtocolError, match="out of order"):
        st.fetch(0)
    st.fetch(1)
    assert st.fetch_non_block("emb", assume_touched=False)
    with pytest.raises(ProtocolError, match="layer 1 not notified"):
        st.check_end()
    st.notify(1)
    st.fetch(0)
    st.notify(0)
    with pytest.raises(ProtocolError, match="non-block gradients not notified"):
        st.check_end()
    st.notify_non_block("emb")
    st.check_end()
    assert not st.end() and (st.micro, st.in_micro, st.complete) == (0, False, False)
    assert saved.nb_touched == set() and saved.fetched is None  # the copy is independent
    with pytest.raises(ProtocolError, match="during step 0"):
        st.check_readable("read", step=0)
    st.check_start(1, 2, step=0)
    st.start(1, 2)
    assert not st.fetch_non_block("emb", assume_touched=False)  # fetched before in this step
    st.notify_non_block("emb")
    st.fetch(1), st.notify(1), st.fetch(0), st.notify(0)
    st.check_end()
    assert st.end() and (st.micro, st.complete) == (-1, True)
    st.check_readable("read", step=1)
    with pytest.raises(ValueError, match="outside"):
        st.check_layer(2)
    with pytest.raises(TypeError, match="layer must be an int"):
        st.check_layer(1.0)


def test_manager_state_round_trip_and_checks() -> None:
    s = ManagerState("all_to_all", base_seed=7, step=3, rank=1, world=2, rounding="ldsr")
    d = s.as_dict()
    assert d == {"version": 1, "strategy": "all_to_all", "base_seed": 7, "step": 3, "rank": 1, "world": 2,
                 "rounding": "ldsr"}
    assert ManagerState.parse(d) == s
    old = {k: v for k, v in d.items() if k != "rounding"}  # saved before rounding modes: SR
    assert ManagerState.parse(old).rounding == "sr"
    with pytest.raises(ValueError, match="rounding"):
        ManagerState.parse({**d, "rounding": "stochastic"})
    assert ManagerState.parse({k: v for k, v in d.items() if k != "version"}) == s
    s.check_fits("all_to_all", 1, 2, "ldsr")
    with pytest.raises(ValueError, match="state world 2 does not match this manager's 4"):
        s.check_fits("all_to_all", 1, 4, "ldsr")
    with pytest.raises(ValueError, match="state rounding 'ldsr' does not match this manager's 'sr'"):
        s.check_fits("all_to_all", 1, 2, "sr")
    with pytest.raises(ValueError, match="unknown"):
        ManagerState.parse({**d, "extra": 1})
    with pytest.raises(TypeError, match="state step must be an int"):
        ManagerState.parse({**d, "step": 3.0})
