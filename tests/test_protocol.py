"""Gradient-manager protocol on the host backend: every rank issues the same collectives whatever
non-block parameters it produced, shards and the norm are read only after a completed step, the
32-bit step counter never wraps, arguments and saved states are type- and range-checked before
anything changes, and a closed manager refuses every call without changing state."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from test_managers import STRATS, small_layout
from test_replay import FakeGraph

import lowgrad as lg
from lowgrad.managers import ProtocolError
from lowgrad.sr.seedcounter import COUNTER_DTYPE, LAST_STEP

NB = [lg.ParamSpec("a", (8, 4)), lg.ParamSpec("b", (8, 4)), lg.ParamSpec("c", (4, 2), zero_init=True)]
NAMES = [s.name for s in NB]
Fetch = Callable[[int, int, int], set[str]]  # (rank, step, micro_step) -> the non-block names it produces


@pytest.fixture
def fake_capture(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Managers see ``holder[0]`` (a test_replay.FakeGraph) as the capture of their stream while set."""
    holder: list[Any] = [None]
    monkeypatch.setattr(lg.HostDevice, "capture_of", lambda device, stream: holder[0])
    return holder


def nb_layout() -> lg.Layout:
    return lg.Layout(block=[lg.ParamSpec("w", (8, 2))], non_block=NB, num_layers=2)


def int_grad(rank: int, step: int, m: int, key: str, shape: tuple[int, ...]) -> np.ndarray:
    """Small integers: every sum, mean over <= 4 ranks and SR rounding below is exact in bf16."""
    rng = np.random.default_rng([rank, step, m, sum(map(ord, key))])
    return rng.integers(-4, 5, shape).astype(np.float32)


def disjoint(rank: int, step: int, m: int) -> set[str]:
    """Rank r produces only NAMES[(r + step) % 3]: at world 2, rank 0's 'a' meets rank 1's 'b'."""
    return {NAMES[(rank + step) % 3]}


def scattered(rank: int, step: int, m: int) -> set[str]:
    """Each name in some micro-steps of some ranks; rank 1 produces 'a' only in micro-step 1."""
    if rank == 1:
        return {"a"} if m == 1 else set()
    rng = np.random.default_rng([rank, step, m, 7])
    return {n for n in NAMES if rng.random() < 0.5}


def run_engine(comm: Any, layout: lg.Layout, strategy: str, offload: bool, M: int, steps: int,
               fetch: Fetch) -> list[dict[str, np.ndarray]]:
    """Drive ``steps`` steps of ``M`` micro-steps, producing the non-block gradients ``fetch``
    names; the shards after each step as float64."""
    dev, s = comm.device, comm.device.stream()
    gm = lg.create_gradient_manager(layout, comm, strategy=strategy, offload=offload, seed=5)
    src: dict[tuple[int, ...], lg.Tensor] = {}

    def write(t: lg.Tensor, acc: bool, g: np.ndarray) -> None:
        if t.shape not in src:  # pinned: host-visible on both backends and readable by device kernels
            src[t.shape] = dev.alloc(t.shape, lg.fp32, kind="pinned", name="engine_scratch")
        buf = src[t.shape]
        s.synchronize()
        buf.numpy()[...] = g
        if acc:
            lg.ops.add_sr(t, t, buf, 1.0, seed=1, stream=s)
        else:
            lg.ops.add_sr(t, buf, buf, 0.5, seed=2, stream=s)

    out = []
    for step in range(steps):
        for m in range(M):
            gm.start_micro_step(s, m, M)
            for spec in layout.non_block:
                if spec.name in fetch(comm.rank, step, m):
                    t, acc = gm.non_block_full(spec.name, s)
                    write(t, acc, int_grad(comm.rank, step, m, spec.name, spec.shape))
                    gm.notify_non_block(spec.name, s)
            for layer in reversed(range(layout.num_layers)):
                dw, acc = gm.block_full(layer, s)
                for spec in layout.block:
                    write(dw[spec.name], acc, int_grad(comm.rank, step, m, f"{layer}.{spec.name}", spec.shape))
                gm.notify_block(layer, s)
            gm.end_micro_step(s)
        got = {f"nb.{n}": gm.non_block_shard(n, s) for n in NAMES}
        got.update({f"{layer}.w": gm.block_shard(layer, s)["w"] for layer in range(layout.num_layers)})
        s.synchronize()
        out.append({k: t.numpy().astype(np.float64) for k, t in got.items()})
    gm.close()
    return out


def expected(layout: lg.Layout, world: int, rank: int, M: int, step: int, fetch: Fetch) -> dict[str, np.ndarray]:
    """sum over micro-steps of the mean over ranks; a gradient a rank did not produce is zero."""
    items = [(f"nb.{spec.name}", spec.name, spec.shape) for spec in layout.non_block]
    items += [(f"{layer}.w", None, (8, 2)) for layer in range(layout.num_layers)]
    out = {}
    for key, name, shape in items:
        total = np.zeros(shape)
        for m in range(M):
            for r in range(world):
                if name is None or name in fetch(r, step, m):
                    total += int_grad(r, step, m, name or key, shape)
        rows = shape[0] // world
        out[key] = (total / world)[rank * rows:(rank + 1) * rows]
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("strategy,offload", STRATS)
@pytest.mark.parametrize("fetch", [disjoint, scattered], ids=["disjoint", "scattered"])
def test_every_rank_reduces_every_non_block_gradient(world: int, strategy: str, offload: bool, fetch: Fetch) -> None:
    """Ranks producing different non-block gradients (in different micro-steps, none at all, a
    different set in the next step) get the exact mean: every rank reduces every non-block
    gradient in layout order, and an unproduced one counts as zeros (not last step's values)."""
    layout, M, steps = nb_layout(), 3, 2
    results = lg.run_threads(world, lambda c: run_engine(c, layout, strategy, offload, M, steps, fetch), timeout=30)
    for rank, per_step in enumerate(results):
        for step, got in enumerate(per_step):
            for key, want in expected(layout, world, rank, M, step, fetch).items():
                np.testing.assert_array_equal(got[key], want, err_msg=f"rank {rank} step {step} {key}")


def one_step(gm: Any, M: int = 1, s: Any = None) -> None:
    for m in range(M):
        gm.start_micro_step(s, m, M)
        for spec in gm.layout.non_block:
            gm.non_block_full(spec.name, s)
            gm.notify_non_block(spec.name, s)
        for layer in reversed(range(gm.layout.num_layers)):
            gm.block_full(layer, s)
            gm.notify_block(layer, s)
        gm.end_micro_step(s)


def reads(gm: Any) -> dict[str, Callable[[], Any]]:
    return {"block_shard": lambda: gm.block_shard(0, None), "non_block_shard": lambda: gm.non_block_shard("emb", None),
            "grad_norm_squared": lambda: gm.grad_norm_squared(None)}


def counter(gm: Any) -> tuple[int, ...]:
    return tuple(int(x) for x in gm._counter.tensor.numpy().view(COUNTER_DTYPE)[0].tolist()[:3])  # base, step, micro


def host_comm() -> Any:
    return lg.run_threads(1, lambda c: c)[0]


@pytest.mark.parametrize("strategy,offload", STRATS)
def test_shards_and_norm_raise_until_a_step_completes(strategy: str, offload: bool) -> None:
    """New manager, after load_state_dict, and while a step is in progress (its micro-step 0
    overwrites the previous step's shards): ProtocolError; after the last micro-step: readable
    (the engine writes nothing here: the values are whatever the buffers hold)."""

    def job(comm: Any) -> None:
        np.seterr(all="ignore")  # this thread's numpy: the norm of uninitialised buffers may overflow
        gm = lg.create_gradient_manager(small_layout(), comm, strategy=strategy, offload=offload)
        for read in reads(gm).values():
            with pytest.raises(ProtocolError, match="before any step completed"):
                read()
        state = gm.state_dict()  # the seed state is readable at any time between steps
        one_step(gm, 2)
        for read in reads(gm).values():
            read()
        gm.start_micro_step(None, 0, 2)
        for read in reads(gm).values():
            with pytest.raises(ProtocolError, match="during step 1"):
                read()
        gm2 = lg.create_gradient_manager(small_layout(), comm, strategy=strategy, offload=offload)
        one_step(gm2)
        gm2.load_state_dict(state)
        for read in reads(gm2).values():
            with pytest.raises(ProtocolError, match="before any step completed"):
                read()
        one_step(gm2)
        for read in reads(gm2).values():
            read()

    lg.run_threads(1, job)


def test_capture_leaves_shards_unreadable_and_a_replayed_step_makes_them_readable(fake_capture: Any) -> None:
    gm = lg.create_gradient_manager(small_layout(), host_comm(), strategy="scatter_reduce")
    g = fake_capture[0] = FakeGraph()
    one_step(gm, 2)
    fake_capture[0] = None
    tpl = gm._graph_hooks.capture_ended(g, False)
    with pytest.raises(ProtocolError, match="before any step completed"):
        gm.block_shard(0, None)  # capturing ran nothing
    gm._graph_hooks.replay_done(gm._graph_hooks.replay_check(tpl), 0)
    gm.block_shard(0, None)


def test_step_counter_never_wraps() -> None:
    """The last step that may run is 2**32 - 2: afterwards gm.step == 2**32 - 1 can be saved and
    reloaded, and starting another step (eagerly or by a replay) raises OverflowError with no
    state change; the device counter never wraps to step 0."""
    layout = small_layout()
    gm = lg.create_gradient_manager(layout, host_comm(), strategy="all_to_all", seed=3, step=LAST_STEP - 1)
    one_step(gm, 2)
    assert gm.step == LAST_STEP and counter(gm) == (3, LAST_STEP, 0)
    state = gm.state_dict()
    with pytest.raises(OverflowError, match="past the 32-bit step counter"):
        gm.start_micro_step(None, 0, 2)
    assert ((gm._protocol.in_micro, gm._protocol.micro, gm.step, counter(gm))
            == (False, -1, LAST_STEP, (3, LAST_STEP, 0)))
    gm.block_shard(0, None)  # the completed step is still readable
    fresh = lg.create_gradient_manager(layout, host_comm(), strategy="all_to_all")
    fresh.load_state_dict(state)
    assert fresh.step == LAST_STEP
    with pytest.raises(OverflowError):
        fresh.start_micro_step(None, 0, 1)
    with pytest.raises(ValueError, match=r"\[0, 2\*\*32\)"):
        lg.create_gradient_manager(layout, host_comm(), step=LAST_STEP + 1)


def test_replay_refuses_to_pass_the_last_step(fake_capture: Any) -> None:
    layout = small_layout()
    gm = lg.create_gradient_manager(layout, host_comm(), strategy="scatter_reduce", seed=1)
    templates = {}
    for m in (0, 1):  # micro-step 0 of 2 (starts a step), micro-step 1 of 2 (ends it)
        g = fake_capture[0] = FakeGraph()
        gm.start_micro_step(None, m, 2)
        for layer in reversed(range(layout.num_layers)):
            gm.block_full(layer, None)
            gm.notify_block(layer, None)
        gm.end_micro_step(None)
        fake_capture[0] = None
        templates[m] = gm._graph_hooks.capture_ended(g, False)
    gm.load_state_dict({**gm.state_dict(), "step": LAST_STEP})
    with pytest.raises(OverflowError):
        gm._graph_hooks.replay_check(templates[0])
    gm.load_state_dict({**gm.state_dict(), "step": LAST_STEP - 1})
    gm._graph_hooks.replay_done(gm._graph_hooks.replay_check(templates[0]), 0)  # step 2**32 - 2 runs ...
    gm._graph_hooks.replay_done(gm._graph_hooks.replay_check(templates[1]), 0)  # ... and ends
    assert gm.step == LAST_STEP
    with pytest.raises(OverflowError):
        gm._graph_hooks.replay_check(templates[0])


def test_non_integer_arguments_raise_type_error_before_any_change() -> None:
    comm = host_comm()
    layout = small_layout()
    for kw in ({"step": 1.0}, {"step": True}, {"offload": 1}, {"offload": 1.0}, {"offload": "yes"},
               {"seed": 2.0}, {"seed": True}):
        with pytest.raises(TypeError):
            lg.create_gradient_manager(layout, comm, strategy="scatter_reduce", **kw)
    gm = lg.create_gradient_manager(layout, comm, strategy="scatter_reduce", step=np.int64(4))
    assert gm.step == 4 and type(gm.step) is int
    for args in ((0.0, 2), (False, 2), (0, 2.0), (0, True), ("0", 2)):
        with pytest.raises(TypeError, match=r"micro_step|total_micro_steps"):
            gm.start_micro_step(None, *args)
        assert (gm._protocol.in_micro, gm._protocol.micro, counter(gm)) == (False, -1, (0, 4, 0))
    gm.start_micro_step(None, np.int32(0), np.int64(1))
    with pytest.raises(TypeError, match="layer"):
        gm.block_full(True, None)
    with pytest.raises(TypeError, match="layer"):
        gm.block_full(2.0, None)
    gm.block_full(2, None)
    gm.notify_block(2, None)


def test_load_state_dict_validates_everything_before_changing_anything() -> None:
    comm = host_comm()
    gm = lg.create_gradient_manager(small_layout(), comm, strategy="all_to_all", seed=9, step=3)
    one_step(gm)
    good = gm.state_dict()
    assert good == {"version": 1, "strategy": "all_to_all", "base_seed": 9, "step": 4, "rank": 0, "world": 1,
                    "rounding": lg.DEFAULT_ROUNDING}
    bad: list[tuple[Any, type[Exception], str]] = [
        (None, TypeError, "mapping"), ([("step", 1)], TypeError, "mapping"),
        ({k: v for k, v in good.items() if k != "step"}, ValueError, "missing.*step"),
        ({**good, "momentum": 0.9}, ValueError, "unknown.*momentum"),
        ({**good, "version": 2}, ValueError, "version 2"), ({**good, "version": "1"}, ValueError, "version"),
        ({**good, "version": True}, ValueError, "version"), ({**good, "version": 1.0}, ValueError, "version"),
        ({**good, "strategy": 5}, TypeError, "strategy"), ({**good, "strategy": "unsharded"}, ValueError, "strategy"),
        ({**good, "world": 1.0}, TypeError, "world"), ({**good, "world": 2}, ValueError, "world"),
        ({**good, "rank": True}, TypeError, "rank"), ({**good, "rank": 1}, ValueError, "rank"),
        ({**good, "base_seed": 1.5}, TypeError, "base_seed"), ({**good, "base_seed": -1}, ValueError, "seed"),
        ({**good, "base_seed": 1 << 64}, ValueError, "seed"),
        ({**good, "step": True}, TypeError, "step"), ({**good, "step": 5.0}, TypeError, "step"),
        ({**good, "step": -1}, ValueError, "step"), ({**good, "step": 1 << 32}, ValueError, "step"),
    ]
    for state, exc, match in bad:
        with pytest.raises(exc, match=match):
            gm.load_state_dict(state)
        assert gm.state_dict() == good and counter(gm) == (9, 4, 0)
        gm.block_shard(0, None)  # still the completed step's shards
    legacy = {k: v for k, v in good.items() if k != "version"}  # states written before versions existed
    gm.load_state_dict({**legacy, "step": 7, "base_seed": np.uint64(2)})
    assert (gm.step, gm.base_seed, counter(gm)) == (7, 2, (2, 7, 0)) and type(gm.base_seed) is int


@pytest.mark.parametrize("strategy,offload", STRATS)
def test_closed_manager_raises_closed_error_first_and_changes_nothing(strategy: str, offload: bool,
                                                                       fake_capture: Any) -> None:
    layout = small_layout()
    gm = lg.create_gradient_manager(layout, host_comm(), strategy=strategy, offload=offload)
    g = fake_capture[0] = FakeGraph()
    one_step(gm)
    fake_capture[0] = None
    tpl = gm._graph_hooks.capture_ended(g, False)
    one_step(gm)
    state = gm.state_dict()
    gm.close()
    gm.close()  # idempotent
    calls = {"start_micro_step": lambda: gm.start_micro_step(None, 0, 1),
             "start_micro_step(bad)": lambda: gm.start_micro_step(None, 5.0, 1),
             "block_full": lambda: gm.block_full(2, None), "notify_block": lambda: gm.notify_block(2, None),
             "non_block_full": lambda: gm.non_block_full("emb", None),
             "notify_non_block": lambda: gm.notify_non_block("emb", None),
             "end_micro_step": lambda: gm.end_micro_step(None),
             "shards": gm.shards, "state_dict": gm.state_dict, "load_state_dict": lambda: gm.load_state_dict(state),
             "replay": lambda: gm._graph_hooks.replay_check(tpl), **reads(gm)}
    for name, call in calls.items():
        with pytest.raises(lg.ClosedError, match="after close"):
            call()
        assert (gm._protocol.in_micro, gm._protocol.micro, gm.step, gm._protocol.complete) == (False, -1, 1, True), name


def test_closed_mid_step_refuses_the_rest_of_the_step() -> None:
    gm = lg.create_gradient_manager(small_layout(), host_comm(), strategy="scatter_reduce")
    gm.start_micro_step(None, 0, 1)
    gm.block_full(2, None)
    gm.close()
    for call in (lambda: gm.notify_block(2, None), lambda: gm.end_micro_step(None)):
        with pytest.raises(lg.ClosedError):
            call()
    assert (gm._protocol.in_micro, gm._protocol.fetched, gm.step) == (True, 2, 0)
