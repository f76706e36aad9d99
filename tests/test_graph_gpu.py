"""CUDA-graph capture of whole micro-steps (engine kernels + manager calls, NCCL at world 1):
replays are bit-identical to eager runs, fresh noise every replay (device seed counter), the
manager's host state follows replays, and captures refuse host syncs, allocations and misuse."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from test_managers import STRATS, small_layout

import lowgrad as lg
from lowgrad.managers import ProtocolError

pytestmark = pytest.mark.gpu


def engine_inputs(dev: Any, layout: lg.Layout) -> dict[Any, lg.Tensor]:
    """A fixed fp32 input per gradient tensor (the engine's 'activations')."""
    rng = np.random.default_rng(11)
    srcs = {("nb", s.name): s for s in layout.non_block}
    srcs.update({(layer, s.name): s for layer in range(layout.num_layers) for s in layout.block})
    return {k: lg.from_numpy((rng.standard_normal(s.shape) * 0.1).astype(np.float32), dev, name="engine_in")
            for k, s in srcs.items()}


def write(t: lg.Tensor, acc: bool, src: lg.Tensor, stream: Any) -> None:
    if acc:
        lg.ops.add_sr(t, t, src, 1.0, seed=5, stream=stream)
    else:
        lg.ops.add_sr(t, src, src, 0.5, seed=4, stream=stream)


def micro_step(gm: Any, layout: lg.Layout, srcs: dict[Any, lg.Tensor], stream: Any, m: int, M: int,
               started: bool = False) -> None:
    """One engine micro-step, every call on ``stream`` (capturable)."""
    if not started:
        gm.start_micro_step(stream, m, M)
    for s in layout.non_block:
        t, acc = gm.non_block_full(s.name, stream)
        write(t, acc, srcs[("nb", s.name)], stream)
        gm.notify_non_block(s.name, stream)
    for layer in reversed(range(layout.num_layers)):
        dw, acc = gm.block_full(layer, stream)
        for s in layout.block:
            write(dw[s.name], acc or s.zero_init, srcs[(layer, s.name)], stream)
        gm.notify_block(layer, stream)
    gm.end_micro_step(stream)


def shards(gm: Any, layout: lg.Layout, stream: Any) -> dict[str, np.ndarray]:
    out = {f"nb.{s.name}": gm.non_block_shard(s.name, stream) for s in layout.non_block}
    for layer in range(layout.num_layers):
        c = gm.block_shard(layer, stream)
        out.update({f"{layer}.{s.name}": c[s.name] for s in layout.block})
    stream.synchronize()
    return {k: t.numpy().view(np.uint16 if t.dtype is lg.bf16 else np.uint32).copy() for k, t in out.items()}


def kind_of(m: int, M: int) -> int:
    return 0 if m == 0 else (M - 1 if m == M - 1 else 1)


def capture_micro_steps(gm: Any, layout: lg.Layout, srcs: dict, stream: Any, M: int) -> dict[int, lg.Graph]:
    graphs = {}
    for m in sorted({0, min(1, M - 1), M - 1}):
        g = lg.Graph(stream.device)
        with g.capture(stream):
            micro_step(gm, layout, srcs, stream, m, M)
        graphs[m] = g
    return graphs


@pytest.mark.parametrize("strategy,offload", STRATS)
@pytest.mark.parametrize("M", [1, 2, 4])
def test_replayed_micro_steps_are_bit_identical_to_eager(strategy: str, offload: bool, M: int) -> None:
    layout = small_layout(zero_init=True)

    def job(comm: Any) -> None:
        dev = comm.device
        s = dev.stream()
        srcs = engine_inputs(dev, layout)
        eager, graphed = (lg.create_gradient_manager(layout, comm, strategy=strategy, offload=offload, seed=3)
                          for _ in range(2))
        for m in range(M):  # step 0 eagerly on both: compiles kernels, warms every lazy resource
            micro_step(eager, layout, srcs, s, m, M)
            micro_step(graphed, layout, srcs, s, m, M)
        graphs = capture_micro_steps(graphed, layout, srcs, s, M)
        assert graphed.step == 1 and graphed.state_dict()["step"] == 1  # capturing ran nothing
        assert all(g.kernel_nodes > 0 for g in graphs.values())
        results = []
        for _ in range(2):
            for m in range(M):
                micro_step(eager, layout, srcs, s, m, M)
                graphs[kind_of(m, M)].replay(s)
            assert graphed.step == eager.step
            a, b = shards(eager, layout, s), shards(graphed, layout, s)
            for key in a:
                assert np.array_equal(a[key], b[key]), (strategy, offload, M, key)
            results.append(b)
        if M > 2 and strategy != "unsharded":  # the same inputs, fresh noise each step: SR results differ
            assert any(not np.array_equal(results[0][k], results[1][k]) for k in results[0])
        for g in graphs.values():
            g.close()
        eager.close()
        graphed.close()

    lg.run_threads(1, job, backend="cuda")


def test_whole_step_in_one_graph_and_grad_norm_with_nccl_in_a_graph() -> None:
    """Both micro-steps of a step in one capture, then a captured grad_norm_squared (norm
    kernels + NCCL all-reduce at world 1): replays equal the eager manager's results."""
    layout = small_layout()
    M = 2

    def job(comm: Any) -> None:
        dev = comm.device
        s = dev.stream()
        srcs = engine_inputs(dev, layout)
        eager, graphed = (lg.create_gradient_manager(layout, comm, strategy="scatter_reduce", seed=8) for _ in range(2))
        for gm in (eager, graphed):
            for m in range(M):
                micro_step(gm, layout, srcs, s, m, M)
            gm.grad_norm_squared(s)
        step_graph, norm_graph = lg.Graph(dev), lg.Graph(dev)
        with step_graph.capture(s):
            for m in range(M):
                micro_step(graphed, layout, srcs, s, m, M)
        with norm_graph.capture(s):
            norm = graphed.grad_norm_squared(s)
        for _ in range(3):
            for m in range(M):
                micro_step(eager, layout, srcs, s, m, M)
            want = float(eager.grad_norm_squared(s).numpy()[0])
            step_graph.replay(s)
            norm_graph.replay(s)
            s.synchronize()
            assert float(norm.numpy()[0]) == want
            a, b = shards(eager, layout, s), shards(graphed, layout, s)
            assert all(np.array_equal(a[k], b[k]) for k in a)
        assert graphed.step == eager.step == 4

    lg.run_threads(1, job, backend="cuda")


def test_capture_refuses_host_syncs_allocations_and_restores_the_manager() -> None:
    layout = small_layout()

    def job(comm: Any) -> None:
        dev = comm.device
        s = dev.stream()
        srcs = engine_inputs(dev, layout)
        gm = lg.create_gradient_manager(layout, comm, strategy="all_to_all", seed=1)
        micro_step(gm, layout, srcs, s, 0, 2)  # mid-step: micro-step 1 comes next
        t, ev, other = srcs[("nb", "emb")], dev.event(), dev.stream()
        pageable = dev.alloc(4, lg.fp32, kind="host", name="pageable")
        refused = {"Stream.synchronize": s.synchronize, "Event.synchronize": ev.synchronize,
                   "Device.synchronize": dev.synchronize, "to the host": t.numpy,
                   "allocating": lambda: dev.alloc(4, lg.fp32, name="late"),
                   "pageable": lambda: lg.ops.copy(t.flat().view(0, 4), pageable, stream=s)}
        for match, call in refused.items():
            g = lg.Graph(dev)
            with pytest.raises(lg.CaptureError, match=match):
                with g.capture(s):
                    gm.start_micro_step(s, 1, 2)
                    dw, _ = gm.block_full(layout.num_layers - 1, s)
                    call()
            assert not g.captured
            assert (gm.step, gm._protocol.micro, gm._protocol.in_micro) == (0, 0, False)
        g = lg.Graph(dev)
        with pytest.raises(ProtocolError, match="inside a micro-step"):
            with g.capture(s):
                gm.start_micro_step(s, 1, 2)
        with pytest.raises(lg.CaptureError, match="not the stream"):
            with lg.Graph(dev).capture(s):
                gm.start_micro_step(other, 1, 2)
        with pytest.raises(ValueError, match="legacy default stream"):
            with lg.Graph(dev).capture(None):
                pass
        micro_step(gm, layout, srcs, s, 1, 2)  # eager work after refused captures is fine
        assert gm.step == 1
        graphs = capture_micro_steps(gm, layout, srcs, s, 2)
        with pytest.raises(ProtocolError, match="cannot replay as micro-step 0"):
            graphs[1].replay(s)
        graphs[0].replay(s)
        with pytest.raises(ProtocolError, match="cannot replay as micro-step 1"):
            graphs[0].replay(s)
        gm.start_micro_step(s, 1, 2)
        with pytest.raises(ProtocolError, match="in progress"):
            graphs[1].replay(s)
        micro_step(gm, layout, srcs, s, 1, 2, started=True)
        graphs[0].replay(s)
        graphs[1].replay(s)
        assert gm.step == 3
        gm.close()
        with pytest.raises(lg.ClosedError, match="closed"):
            graphs[0].replay(s)
        with pytest.raises(lg.CaptureError, match="already captured"):
            with graphs[0].capture(s):
                pass

    lg.run_threads(1, job, backend="cuda")


def test_manager_refuses_a_foreign_capture() -> None:
    from lowgrad.cuda import driver as _cuda

    def job(comm: Any) -> None:
        dev = comm.device
        gm = lg.create_gradient_manager(small_layout(), comm, strategy="scatter_reduce")
        s = dev.stream()
        drv = _cuda.driver()
        _cuda.check("cuStreamBeginCapture", drv.cuStreamBeginCapture(drv.CUstream(s.handle), 1))
        try:
            with pytest.raises(lg.CaptureError, match="not by lowgrad.Graph"):
                gm.start_micro_step(s, 0, 1)
        finally:
            err, graph = drv.cuStreamEndCapture(drv.CUstream(s.handle))
            drv.cuGraphDestroy(graph)

    lg.run_threads(1, job, backend="cuda")


def test_nccl_collectives_replay_in_a_graph_at_world_1() -> None:
    """A kernel and NCCL all-reduce, reduce-scatter and a grouped all-gather captured together:
    every replay runs all of them (x grows by one per replay, as the eager loop)."""

    def job(comm: Any) -> None:
        dev = comm.device
        s = dev.stream()
        x0 = np.arange(64, dtype=np.float32)
        x, eager = lg.from_numpy(x0, dev, name="x"), lg.from_numpy(x0, dev, name="x_eager")
        one = lg.from_numpy(np.ones(64, np.float32), dev, name="one")
        out = dev.alloc(64, lg.fp32, name="gathered")

        def work(t: lg.Tensor) -> None:
            lg.ops.add_sr(t, t, one, 1.0, seed=0, stream=s)
            comm.all_reduce(t, op="sum", stream=s)
            comm.reduce_scatter(t, op="avg", stream=s)
            with comm.group(s):
                comm.all_gather(t, out, stream=s)

        work(eager)  # warm-up: NCCL's first use of the stream
        s.synchronize()
        g = lg.Graph(dev)
        with g.capture(s):
            work(x)
        for _ in range(3):
            g.replay(s)
            work(eager)
        s.synchronize()
        assert np.array_equal(x.numpy(), x0 + 3) and np.array_equal(eager.numpy(), x0 + 4)
        assert np.array_equal(out.numpy(), x0 + 4)  # the last all-gather ran eagerly, after the replays
        assert g.kernel_nodes >= 1

    lg.run_threads(1, job, backend="cuda")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["unsharded", "all_to_all"])
def test_replayed_step_with_unproduced_non_block_gradients(strategy: str) -> None:
    """A captured step that produces 'emb' in micro-step 1 only and never 'norm': every replay
    equals the eager step, 'norm' reads as zeros (zeroed and reduced like the others), and the
    shards are unreadable until the first step completes."""
    layout = small_layout()
    M = 2

    def run(gm: Any, srcs: dict, s: Any) -> None:
        for m in range(M):
            gm.start_micro_step(s, m, M)
            if m == 1:
                t, acc = gm.non_block_full("emb", s)
                write(t, acc, srcs[("nb", "emb")], s)
                gm.notify_non_block("emb", s)
            for layer in reversed(range(layout.num_layers)):
                dw, acc = gm.block_full(layer, s)
                for spec in layout.block:
                    write(dw[spec.name], acc, srcs[(layer, spec.name)], s)
                gm.notify_block(layer, s)
            gm.end_micro_step(s)

    def job(comm: Any) -> None:
        dev = comm.device
        s = dev.stream()
        srcs = engine_inputs(dev, layout)
        eager, graphed = (lg.create_gradient_manager(layout, comm, strategy=strategy, seed=6) for _ in range(2))
        for gm in (eager, graphed):  # a step producing everything ('norm' holds data now); warms kernels
            for m in range(M):
                micro_step(gm, layout, srcs, s, m, M)
        g = lg.Graph(dev)
        with g.capture(s):
            run(graphed, srcs, s)
        for _ in range(2):
            run(eager, srcs, s)
            g.replay(s)
            a, b = shards(eager, layout, s), shards(graphed, layout, s)
            assert all(np.array_equal(a[k], b[k]) for k in a)
            assert not b["nb.norm"].any() and b["nb.emb"].any()
        fresh = lg.create_gradient_manager(layout, comm, strategy=strategy, seed=6)
        with pytest.raises(ProtocolError, match="before any step completed"):
            fresh.non_block_shard("emb", s)
        for gm in (eager, graphed, fresh):
            gm.close()
        g.close()

    lg.run_threads(1, job, backend="cuda")
