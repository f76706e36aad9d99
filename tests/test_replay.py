"""CUDA-graph support without a GPU: the capture guards (lowgrad.buffers.capture), lowgrad.Graph's
argument checks, and the gradient manager's template/replay state machine driven on the host
backend by a stand-in graph (the CUDA run is tests/test_graph_gpu.py)."""
from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from test_managers import small_layout

import lowgrad as lg
from lowgrad.buffers import capture
from lowgrad.managers import ProtocolError
from lowgrad.sr.seedcounter import COUNTER_DTYPE


class FakeGraph:
    """What a manager needs from a Graph while capturing: join, keep, the stream handle."""

    stream_handle = 0x1234

    def __init__(self) -> None:
        self.participants: list[Any] = []
        self.kept: set[Any] = set()

    def join(self, p: Any) -> None:
        if p not in self.participants:
            self.participants.append(p)

    def keep(self, allocations: tuple[Any, ...]) -> None:
        self.kept.update(allocations)


@pytest.fixture
def fake_capture(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Managers see ``holder[0]`` as the capture of their stream while it is set."""
    holder: list[Any] = [None]
    monkeypatch.setattr(lg.HostDevice, "capture_of", lambda device, stream: holder[0])
    return holder


def test_guards_refuse_work_during_capture_and_name_it() -> None:
    h = lg.HostDevice()
    g = FakeGraph()
    capture.begin(g)
    try:
        with pytest.raises(lg.CaptureError, match="allocating 'x'.*0x1234"):
            h.alloc(4, lg.fp32, name="x")
        with pytest.raises(lg.CaptureError, match="already in progress"):
            capture.begin(FakeGraph())
    finally:
        capture.end(g)
    t = h.alloc(4, lg.fp32, name="x")  # fine again after the capture
    capture.begin(g)
    try:
        lg.ops.fill_zero(t)
        assert t.allocation in g.kept  # a kernel's tensors are held by the graph being captured
    finally:
        capture.end(g)
    assert capture.current() is None


def test_graph_needs_a_cuda_device() -> None:
    with pytest.raises(TypeError, match="need a lowgrad.Device"):
        lg.Graph(lg.HostDevice())


def step(gm: Any, layout: lg.Layout, m: int, M: int, produce: tuple[str, ...] = ("emb", "norm")) -> None:
    s = None
    gm.start_micro_step(s, m, M)
    for name in produce:
        gm.non_block_full(name, s)
        gm.notify_non_block(name, s)
    for layer in reversed(range(layout.num_layers)):
        gm.block_full(layer, s)
        gm.notify_block(layer, s)
    gm.end_micro_step(s)


@pytest.mark.parametrize("strategy", ["unsharded", "scatter_reduce", "all_to_all", "hierarchical"])
def test_templates_restore_state_and_replays_follow_the_protocol(strategy: str, fake_capture: Any) -> None:
    layout = small_layout()
    assert lg.run_threads(1, lambda comm: run_templates(comm, layout, strategy, fake_capture)) == [True]


def run_templates(comm: Any, layout: lg.Layout, strategy: str, holder: list[Any]) -> bool:
    gm = lg.create_gradient_manager(layout, comm, strategy=strategy, seed=2)
    M = 4
    tpl = {}
    for m in (0, 1, M - 1):  # templates of any micro-step, captured from between steps
        g = holder[0] = FakeGraph()
        step(gm, layout, m, M)
        holder[0] = None
        assert g.participants == [gm._graph_hooks] and g.kept
        tpl[m] = gm._graph_hooks.capture_ended(g, False)
        assert (gm.step, gm._protocol.micro, gm._protocol.in_micro) == (0, -1, False)  # nothing happened
    with pytest.raises(ProtocolError, match="cannot replay as micro-step 0"):
        gm._graph_hooks.replay_check(tpl[1])
    for m, kind in enumerate((0, 1, 1, M - 1)):
        state = gm._graph_hooks.replay_check(tpl[kind])
        gm._graph_hooks.replay_done(state, 0)
        assert gm._protocol.micro == (m if m < M - 1 else -1)
    assert gm.step == 1
    # a template starting mid-step assumes what the step produced before it
    gm._graph_hooks.replay_done(gm._graph_hooks.replay_check(tpl[0]), 0)
    gm._protocol.nb_touched = {"emb"}  # as if micro-step 0 had produced only emb
    with pytest.raises(ProtocolError, match="assumes non-block gradients"):
        gm._graph_hooks.replay_check(tpl[1])
    gm._protocol.nb_touched = {"emb", "norm"}
    gm._graph_hooks.replay_done(gm._graph_hooks.replay_check(tpl[1]), 0)
    step(gm, layout, 2, 4)  # eager work continues the step
    with pytest.raises(ProtocolError, match="steps of 5 micro-steps, but this step has 4"):
        gm._graph_hooks.replay_check(dataclasses.replace(tpl[1], total=5))
    step(gm, layout, 3, 4)
    assert gm.step == 2
    # partial micro-steps and eager work in progress are refused
    g = holder[0] = FakeGraph()
    gm.start_micro_step(None, 0, 2)
    holder[0] = None
    with pytest.raises(ProtocolError, match="inside a micro-step"):
        gm._graph_hooks.capture_ended(g, False)
    assert (gm._protocol.micro, gm._protocol.in_micro, gm.step) == (-1, False, 2)
    gm.start_micro_step(None, 0, 2)
    with pytest.raises(ProtocolError, match="in progress"):
        gm._graph_hooks.replay_check(tpl[0])
    holder[0] = FakeGraph()
    with pytest.raises(ProtocolError, match="in progress outside"):
        gm.start_micro_step(None, 0, 2)
    holder[0] = None
    gm.close()
    return True


def test_whole_step_template_advances_step(fake_capture: Any) -> None:
    layout = small_layout()

    def job(comm: Any) -> int:
        gm = lg.create_gradient_manager(layout, comm, strategy="scatter_reduce")
        g = fake_capture[0] = FakeGraph()
        for m in range(3):
            step(gm, layout, m, 3)
        fake_capture[0] = None
        tpl = gm._graph_hooks.capture_ended(g, False)
        assert gm.step == 0
        for _ in range(2):
            gm._graph_hooks.replay_done(gm._graph_hooks.replay_check(tpl), 0)
        return gm.step

    assert lg.run_threads(1, job) == [2]


def test_seed_counter_tracks_the_protocol_on_the_host() -> None:
    """The manager's device-side counter holds (base, step, micro-step) of the micro-step in progress."""
    layout = small_layout()

    def job(comm: Any) -> list[tuple[int, int, int]]:
        gm = lg.create_gradient_manager(layout, comm, strategy="all_to_all", seed=9, step=4)
        seen = []

        def read() -> tuple[int, ...]:
            return tuple(int(x) for x in gm._counter.tensor.numpy().view(COUNTER_DTYPE)[0].tolist()[:3])

        for m in range(3):
            gm.start_micro_step(None, m, 3)
            seen.append(read())
            for layer in reversed(range(layout.num_layers)):
                gm.block_full(layer, None)
                gm.notify_block(layer, None)
            gm.end_micro_step(None)
        seen.append(read())
        gm.load_state_dict({**gm.state_dict(), "base_seed": 1, "step": 7})
        seen.append(read())
        return seen

    (seen,) = lg.run_threads(1, job)
    assert seen == [(9, 4, 0), (9, 4, 1), (9, 4, 2), (9, 5, 0), (1, 7, 0)]
