"""Faults in the engine on the host backend: ``discard_step`` from every point of a step, on every
strategy, at world 1 and 2 (one rank faults, its peer runs the step normally), leaves every shard
of the faulting rank NaN and the norm NaN on every rank, keeps the ranks' collectives matched, and
the next step's shards equal those of a run that never faulted, bit for bit. And every manager
call checks its arguments before it changes anything: after each bad call the state is as before
and the corrected call succeeds."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from test_managers import STRATS, bf16_grad, small_layout

import lowgrad as lg
from lowgrad.managers import ProtocolError


class Fault(Exception):
    """The engine's own exception (an OOM in backward, say)."""


def write(dev: Any, stream: Any, t: lg.Tensor, acc: bool, g: np.ndarray) -> None:
    """What an engine does with a gradient, on ``stream``, on either backend: overwrite (an exact
    copy for these bf16 values), or add when ``acc``; through pinned memory the kernels read."""
    src = dev.alloc(t.shape, lg.fp32, kind="pinned", name="engine_scratch")
    src.numpy()[...] = g
    if acc:
        lg.ops.add_sr(t, t, src, 1.0, seed=99, stream=stream)
    else:
        lg.ops.add_sr(t, src, src, 0.5, seed=98, stream=stream)
    stream.synchronize()  # the kernel has read the scratch before it is freed
    src.close()


def run_step(gm: Any, comm: Any, stream: Any, step: int, M: int, fault_at: tuple[int, str, int] | None = None) -> None:
    """One step of ``M`` micro-steps; ``fault_at = (micro, where, layer)`` raises Fault there:
    ``where`` is "before" (before start_micro_step), "fetched" (after block_full(layer)),
    "notified" (after notify_block(layer)), "non_block" (after non_block_full, not notified) or
    "end" (before end_micro_step)."""
    layout = gm.layout
    for m in range(M):
        def at(where: str, layer: int = -1) -> None:
            if fault_at == (m, where, layer):
                raise Fault(f"micro-step {m} {where} {layer}")
        at("before")
        gm.start_micro_step(stream, m, M)
        for i, s in enumerate(layout.non_block):
            t, acc = gm.non_block_full(s.name, stream)
            write(comm.device, stream, t, acc, bf16_grad(comm.rank, m, -1, i, s.shape, step))
            at("non_block", i)
            gm.notify_non_block(s.name, stream)
        for layer in reversed(range(layout.num_layers)):
            dw, acc = gm.block_full(layer, stream)
            at("fetched", layer)
            for i, s in enumerate(layout.block):
                write(comm.device, stream, dw[s.name], acc or s.zero_init,
                      bf16_grad(comm.rank, m, layer, i, s.shape, step))
            gm.notify_block(layer, stream)
            at("notified", layer)
        at("end")
        gm.end_micro_step(stream)


def shards(gm: Any, stream: Any) -> dict[str, np.ndarray]:
    out = {f"nb.{s.name}": gm.non_block_shard(s.name, stream) for s in gm.layout.non_block}
    for layer in range(gm.layout.num_layers):
        c = gm.block_shard(layer, stream)
        out.update({f"{layer}.{s.name}": c[s.name] for s in gm.layout.block})
    stream.synchronize()
    return {k: t.numpy().astype(np.float32) for k, t in out.items()}


FAULTS = [(0, "before", -1), (0, "fetched", 2), (0, "notified", 1), (1, "non_block", 0), (1, "fetched", 0),
          (1, "end", -1), (2, "before", -1), (2, "non_block", 1), (2, "fetched", 1), (2, "end", -1)]


def faulted_and_clean(world: int, strategy: str, offload: bool, fault: tuple[int, str, int], M: int = 3,
                      rounding: str | None = None, **threads: Any) -> tuple[list[Any], list[Any]]:
    """Per rank of a faulted run (rank 0 faults at ``fault`` in step 0 and discards; its peers
    run the step normally) and of a clean run: the shards after step 0, after step 1, and the
    norm after step 0."""
    layout = small_layout()

    def job(comm: Any, faulty: bool) -> tuple[dict[str, np.ndarray], ...]:
        gm = lg.create_gradient_manager(layout, comm, strategy=strategy, offload=offload, seed=5, rounding=rounding)
        s = comm.device.stream()
        if faulty and comm.rank == 0:
            with pytest.raises(Fault):
                run_step(gm, comm, s, 0, M, fault)
            assert gm.discard_step(s, M) is True
        else:
            run_step(gm, comm, s, 0, M)
        assert gm.step == 1
        first = shards(gm, s)
        norm = gm.grad_norm_squared(s)
        s.synchronize()
        norm_value = norm.numpy().astype(np.float64).copy()
        run_step(gm, comm, s, 1, M)
        out = first, shards(gm, s), norm_value
        gm.close()
        return out

    return (lg.run_threads(world, lambda c: job(c, True), **threads),
            lg.run_threads(world, lambda c: job(c, False), **threads))


def check_faulted(faulted: list[Any], clean: list[Any], fault: tuple[int, str, int], M: int = 3) -> None:
    for rank, ((poisoned, after, norm), (_, want, _)) in enumerate(zip(faulted, clean)):
        assert np.isnan(norm[0]), rank  # every rank sees a non-finite step
        if rank == 0 or fault[0] < M - 1:  # the peers' shards too, unless the last micro-step faulted
            assert all(np.isnan(v).all() for v in poisoned.values()), rank
        for key in want:  # the next step: as if nothing had happened
            assert np.array_equal(after[key].view(np.uint32), want[key].view(np.uint32)), (rank, key)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("strategy,offload", STRATS)
@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f"m{f[0]}-{f[1]}{f[2]}")
def test_discard_step_poisons_every_rank_and_leaves_no_trace(world: int, strategy: str, offload: bool,
                                                             fault: tuple[int, str, int]) -> None:
    check_faulted(*faulted_and_clean(world, strategy, offload, fault), fault)


def test_discard_between_steps_does_nothing() -> None:
    layout = small_layout()

    def job(comm: Any) -> None:
        gm = lg.create_gradient_manager(layout, comm, strategy="scatter_reduce")
        s = comm.device.stream()
        assert gm.discard_step(s) is False  # a new manager: no step in progress
        run_step(gm, comm, s, 0, 2)
        before = shards(gm, s)
        assert gm.discard_step(s) is False  # a completed step stays readable and unchanged
        assert gm.step == 1
        for key, v in shards(gm, s).items():
            assert np.array_equal(v.view(np.uint32), before[key].view(np.uint32))
        with pytest.raises(TypeError):
            gm.discard_step("not a stream")
        with pytest.raises(ValueError, match="positive"):
            gm.discard_step(s, 0)
        last = lg.create_gradient_manager(layout, comm, strategy="scatter_reduce", step=2 ** 32 - 1)
        with pytest.raises(OverflowError):  # no step left to discard into: nothing changes
            last.discard_step(s, 2)
        assert last.discard_step(s) is False and not last.in_micro_step
        last.close()
        gm.close()
        with pytest.raises(lg.ClosedError):
            gm.discard_step(s)

    lg.run_threads(1, job)


def test_discard_twice_and_in_every_world_one_strategy_with_all_faulting() -> None:
    """Both ranks fault, at different points: each discards; the collectives still match."""
    layout = small_layout()

    def job(comm: Any) -> dict[str, np.ndarray]:
        gm = lg.create_gradient_manager(layout, comm, strategy="all_to_all")
        s = comm.device.stream()
        with pytest.raises(Fault):
            run_step(gm, comm, s, 0, 3, (comm.rank, "fetched", comm.rank))
        assert gm.discard_step(s) is True
        assert gm.discard_step(s) is False
        return shards(gm, s)

    for got in lg.run_threads(2, job):
        assert all(np.isnan(v).all() for v in got.values())


def test_discard_that_fails_leaves_the_manager_between_steps() -> None:
    """The rest of the step cannot run (here: the fill raises): the manager is left between
    steps with nothing readable, the error propagates, and the next step works."""
    layout = small_layout()

    def job(comm: Any) -> None:
        gm = lg.create_gradient_manager(layout, comm, strategy="scatter_reduce")
        s = comm.device.stream()
        with pytest.raises(Fault):
            run_step(gm, comm, s, 0, 2, (0, "fetched", 1))
        real = gm._poison

        def broken(tensors: Any, stream: Any) -> None:
            raise RuntimeError("device lost")
        gm._poison = broken  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="device lost"):
            gm.discard_step(s)
        gm._poison = real  # type: ignore[method-assign]
        with pytest.raises(ProtocolError, match="before any step completed"):
            gm.block_shard(0, s)
        assert gm.discard_step(s) is False
        run_step(gm, comm, s, gm.step, 2)
        shards(gm, s)

    lg.run_threads(1, job)


# ---- validate, then mutate: every call x bad arguments, state unchanged after each -------------
def snapshot(gm: Any) -> tuple[Any, ...]:
    p = gm._protocol
    counter = gm._counter.tensor.numpy().tobytes()
    return (p.micro, p.total, p.in_micro, p.next_layer, p.fetched, frozenset(p.nb_open), frozenset(p.nb_touched),
            p.complete, gm.step, counter)


BAD_STREAMS = ["default", 1.5, -1, 2 ** 64, object()]


def bad_calls(gm: Any, s: Any) -> list[tuple[str, Callable[[], Any]]]:
    """Every public call with a stream, each with every kind of bad argument."""
    calls: list[tuple[str, Callable[[], Any]]] = []
    for bs in BAD_STREAMS:
        calls += [
            ("start_micro_step stream", lambda bs=bs: gm.start_micro_step(bs, gm._protocol.next_micro, 2)),
            ("non_block_full stream", lambda bs=bs: gm.non_block_full("emb", bs)),
            ("notify_non_block stream", lambda bs=bs: gm.notify_non_block("emb", bs)),
            ("block_full stream", lambda bs=bs: gm.block_full(max(gm._protocol.next_layer, 0), bs)),
            ("notify_block stream", lambda bs=bs: gm.notify_block(max(gm._protocol.next_layer, 0), bs)),
            ("end_micro_step stream", lambda bs=bs: gm.end_micro_step(bs)),
            ("block_shard stream", lambda bs=bs: gm.block_shard(0, bs)),
            ("non_block_shard stream", lambda bs=bs: gm.non_block_shard("emb", bs)),
            ("grad_norm_squared stream", lambda bs=bs: gm.grad_norm_squared(bs)),
            ("discard_step stream", lambda bs=bs: gm.discard_step(bs)),
        ]
    for bad in (True, 1.0, "0", None, np.float32(0)):
        calls += [("start_micro_step micro", lambda bad=bad: gm.start_micro_step(s, bad, 2)),
                  ("start_micro_step total", lambda bad=bad: gm.start_micro_step(s, 0, bad)),
                  ("block_full layer", lambda bad=bad: gm.block_full(bad, s)),
                  ("notify_block layer", lambda bad=bad: gm.notify_block(bad, s)),
                  ("block_shard layer", lambda bad=bad: gm.block_shard(bad, s))]
    for layer in (-1, 3, 99):
        calls += [("block_full range", lambda layer=layer: gm.block_full(layer, s)),
                  ("notify_block range", lambda layer=layer: gm.notify_block(layer, s)),
                  ("block_shard range", lambda layer=layer: gm.block_shard(layer, s))]
    for name in ("nope", 3, None):
        calls += [("non_block_full name", lambda name=name: gm.non_block_full(name, s)),
                  ("notify_non_block name", lambda name=name: gm.notify_non_block(name, s)),
                  ("non_block_shard name", lambda name=name: gm.non_block_shard(name, s))]
    calls += [("start_micro_step range", lambda: gm.start_micro_step(s, 5, 2)),
              ("start_micro_step total 0", lambda: gm.start_micro_step(s, 0, 0))]
    return calls


@pytest.mark.parametrize("strategy,offload", STRATS)
def test_every_bad_call_leaves_the_state_unchanged(strategy: str, offload: bool) -> None:
    """At each point of two steps, every bad call raises TypeError/ValueError/KeyError (or
    ProtocolError) and leaves protocol state, step and seed counter unchanged; the run then
    goes on and its shards equal a run that made no bad calls, bit for bit."""
    layout = small_layout()

    def job(comm: Any, bad: bool) -> dict[str, np.ndarray]:
        gm = lg.create_gradient_manager(layout, comm, strategy=strategy, offload=offload, seed=3)
        s = comm.device.stream()
        errors = 0

        def probe() -> None:
            nonlocal errors
            if not bad:
                return
            for what, call in bad_calls(gm, s):
                before = snapshot(gm)
                try:
                    call()
                except (TypeError, ValueError, KeyError, ProtocolError):
                    errors += 1
                else:
                    continue  # a call that was valid here (e.g. a bad stream never reached): undo nothing
                assert snapshot(gm) == before, what

        for step in range(2):
            for m in range(2):
                probe()
                gm.start_micro_step(s, m, 2)
                for i, sp in enumerate(layout.non_block):
                    probe()
                    t, acc = gm.non_block_full(sp.name, s)
                    write(comm.device, s, t, acc, bf16_grad(comm.rank, m, -1, i, sp.shape, step))
                    probe()
                    gm.notify_non_block(sp.name, s)
                for layer in reversed(range(layout.num_layers)):
                    probe()
                    dw, acc = gm.block_full(layer, s)
                    probe()
                    for i, sp in enumerate(layout.block):
                        write(comm.device, s, dw[sp.name], acc or sp.zero_init,
                              bf16_grad(comm.rank, m, layer, i, sp.shape, step))
                    gm.notify_block(layer, s)
                probe()
                gm.end_micro_step(s)
            probe()
        assert not bad or errors > 0
        return shards(gm, s)

    for rank, (got, want) in enumerate(zip(lg.run_threads(2, lambda c: job(c, True)),
                                           lg.run_threads(2, lambda c: job(c, False)))):
        for key in want:
            assert np.array_equal(got[key].view(np.uint32), want[key].view(np.uint32)), (rank, key)


@pytest.mark.parametrize("fails", ["statistics", "grad_norm"])
def test_a_manager_that_fails_after_its_strategy_closes_it_on_every_rank(
        monkeypatch: pytest.MonkeyPatch, fails: str) -> None:
    """A construction that fails after the strategy is built (the statistics, the norm's memory)
    leaves nothing behind: hierarchical's split communicators are closed on every rank, and a
    corrected retry works."""
    import threading

    from lowgrad.host.communicator import HostCommunicator
    from lowgrad.host.device import HostDevice
    from lowgrad.managers import manager

    made: list[Any] = []
    lock = threading.Lock()
    real_split, real_alloc = HostCommunicator._split, HostDevice.alloc

    def split(self: Any, color: int, key: int) -> Any:
        sub = real_split(self, color, key)
        with lock:
            made.append(sub)
        return sub

    def alloc(self: Any, shape: Any, dtype: Any, kind: str = "device", name: str = "tensor") -> Any:
        if fails == "grad_norm" and name == "grad_norm":
            raise MemoryError("out of device memory (injected)")
        return real_alloc(self, shape, dtype, kind, name)

    def statistics(*args: Any, **kwargs: Any) -> Any:
        raise MemoryError("statistics (injected)")

    monkeypatch.setattr(HostCommunicator, "_split", split)
    monkeypatch.setattr(HostDevice, "alloc", alloc)
    if fails == "statistics":
        monkeypatch.setattr(manager, "Statistics", statistics)

    def fn(comm: Any) -> str:
        with pytest.raises(MemoryError, match="injected"):
            lg.create_gradient_manager(small_layout(), comm, strategy="hierarchical", group_size=2,
                                       stats=fails == "statistics")
        return type(comm).__name__

    assert lg.run_threads(4, fn) == ["HostCommunicator"] * 4
    assert len(made) == 8 and all(c.closed for c in made)  # two splits per rank
    monkeypatch.undo()

    def retry(comm: Any) -> bool:
        gm = lg.create_gradient_manager(small_layout(), comm, strategy="hierarchical", group_size=2)
        gm.close()
        return True
    assert lg.run_threads(4, retry) == [True] * 4
