"""Gradient managers on the host backend: results against a float64 reference, noise, zero_init,
state restore, misuse, memory."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from helpers import strategy_configs

import lowgrad as lg
from lowgrad.managers import ProtocolError

#: every registered strategy, with offload where it offloads (a strategy registered at run time joins)
STRATS = strategy_configs()


def small_layout(layers: int = 3, zero_init: bool = False) -> lg.Layout:
    block = [lg.ParamSpec("w1", (8, 6)), lg.ParamSpec("b1", (8,), zero_init=zero_init), lg.ParamSpec("w2", (16, 3))]
    return lg.Layout(block=block, non_block=[lg.ParamSpec("emb", (12, 4)), lg.ParamSpec("norm", (4,))],
                     num_layers=layers)


def grad(rank: int, micro: int, layer: int, i: int, shape: tuple[int, ...], step: int = 0) -> np.ndarray:
    rng = np.random.default_rng([rank, micro, layer + 1, i, step])
    return (rng.standard_normal(shape) * 0.1).astype(np.float32)


def drive(comm: Any, layout: lg.Layout, strategy: str, offload: bool, micro: int, steps: int = 1,
          gm: Any = None, first_step: int = 0, gfun: Callable[..., np.ndarray] = grad) -> dict[str, np.ndarray]:
    """One engine on one rank: writes each gradient (copy or add), returns the shards as float64."""
    dev = comm.device
    gm = gm or lg.create_gradient_manager(layout, comm, strategy=strategy, offload=offload)
    stream = dev.stream()
    scratch: dict[tuple[int, ...], lg.Tensor] = {}

    def write(t: lg.Tensor, acc: bool, g: np.ndarray) -> None:
        src = scratch.get(t.shape)
        if src is None:  # pinned: host-visible on both backends and readable by device kernels
            src = scratch[t.shape] = dev.alloc(t.shape, lg.fp32, kind="pinned", name="engine_scratch")
        stream.synchronize()  # the previous kernel reading this scratch is done
        src.numpy()[...] = g
        if acc:
            lg.ops.add_sr(t, t, src, 1.0, seed=99, stream=stream)
        else:
            lg.ops.add_sr(t, src, src, 0.5, seed=98, stream=stream)  # an exact copy for bf16-representable g

    for step in range(first_step, first_step + steps):
        for m in range(micro):
            gm.start_micro_step(stream, m, micro)
            for i, s in enumerate(layout.non_block):
                t, acc = gm.non_block_full(s.name, stream)
                write(t, acc, gfun(comm.rank, m, -1, i, s.shape, step))
                gm.notify_non_block(s.name, stream)
            for layer in reversed(range(layout.num_layers)):
                dw, acc = gm.block_full(layer, stream)
                for i, s in enumerate(layout.block):
                    write(dw[s.name], acc or s.zero_init, gfun(comm.rank, m, layer, i, s.shape, step))
                gm.notify_block(layer, stream)
            gm.end_micro_step(stream)
    shards = {f"nb.{s.name}": gm.non_block_shard(s.name, stream) for s in layout.non_block}
    for layer in range(layout.num_layers):
        c = gm.block_shard(layer, stream)
        shards.update({f"{layer}.{s.name}": c[s.name] for s in layout.block})
    stream.synchronize()  # `stream` waited for the shards; pinned ones are read directly
    return {k: t.numpy().astype(np.float64) for k, t in shards.items()}


def bf16_grad(*args: Any) -> np.ndarray:
    return grad(*args).astype(lg.bf16.np).astype(np.float32)


def reference(layout: lg.Layout, world: int, micro: int, rank: int, step: int = 0,
              gfun: Callable[..., np.ndarray] = bf16_grad) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(expected shard, largest magnitude seen) per tensor, float64."""
    items = [(f"nb.{s.name}", -1, i, s) for i, s in enumerate(layout.non_block)]
    items += [(f"{l}.{s.name}", l, i, s) for l in range(layout.num_layers) for i, s in enumerate(layout.block)]
    out = {}
    for key, layer, i, s in items:
        acc, mag = np.zeros(s.shape), np.zeros(s.shape)
        for m in range(micro):
            gs = [gfun(r, m, layer, i, s.shape, step).astype(np.float64) for r in range(world)]
            acc += sum(gs) / world
            mag = np.maximum(mag, np.maximum(np.abs(acc), np.max(np.abs(gs), axis=0)))
        if not s.shape:  # 0-d: its own shard (world 1)
            out[key] = (acc, mag)
            continue
        rows = s.shape[0] // world
        out[key] = (acc[rank * rows:(rank + 1) * rows], mag[rank * rows:(rank + 1) * rows])
    return out


def ulp(x: np.ndarray) -> np.ndarray:
    return np.exp2(np.floor(np.log2(np.maximum(np.abs(x), 2.0 ** -126))) - 7)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("strategy,offload", STRATS)
@pytest.mark.parametrize("micro", [1, 2, 5])
def test_shards_match_float64_reference(world: int, strategy: str, offload: bool, micro: int) -> None:
    layout = small_layout()
    results = lg.run_threads(world, lambda c: drive(c, layout, strategy, offload, micro, gfun=bf16_grad))
    # SR roundings per element: engine adds (micro-1) + manager adds (micro) + NCCL-style rounding (world>1)
    bound = 2 * micro + (2 if world > 1 else 0)
    for rank, got in enumerate(results):
        ref = reference(layout, world, micro, rank)
        for key, (want, mag) in ref.items():
            err = np.abs(got[key] - want) / ulp(mag)
            assert err.max() <= bound, (key, err.max())


def odd_layout(world: int) -> lg.Layout:
    """Zero-size parameters in the blocks and outside (dim 0 of 0, a later dim of 0) beside
    ordinary ones, and at world 1 a 0-d gate per block and a 0-d temperature outside."""
    block = [lg.ParamSpec("w1", (8, 6)), lg.ParamSpec("none_rows", (0, 3)), lg.ParamSpec("none_cols", (4, 0)),
             lg.ParamSpec("b1", (8,), zero_init=True)]
    non_block = [lg.ParamSpec("emb", (12, 4)), lg.ParamSpec("none", (0,))]
    if world == 1:
        block.insert(1, lg.ParamSpec("gate", ()))
        non_block.append(lg.ParamSpec("temperature", ()))
    return lg.Layout(block=block, non_block=non_block, num_layers=3)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("strategy,offload", STRATS)
def test_zero_d_and_zero_size_parameters(world: int, strategy: str, offload: bool) -> None:
    """0-d (one element; world 1) and zero-size (no elements) parameters go through every
    strategy, with and without offload: their shards have the right shapes, the others' values
    are within the SR bound of the float64 reference, the norm and the statistics count them."""
    layout, micro = odd_layout(world), 3

    def job(c: Any) -> tuple[dict[str, np.ndarray], float, Any]:
        gm = lg.create_gradient_manager(layout, c, strategy=strategy, offload=offload, stats=True)
        got = drive(c, layout, strategy, offload, micro, gm=gm, gfun=bf16_grad)
        norm, stats = float(gm.grad_norm_squared().numpy()[0]), gm.step_stats()
        gm.close()
        return got, norm, stats

    results = lg.run_threads(world, job)
    total = 0.0
    for rank, (got, norm, stats) in enumerate(results):
        ref = reference(layout, world, micro, rank)
        assert got.keys() == ref.keys()
        for key, (want, mag) in ref.items():
            assert got[key].shape == want.shape, key
            err = np.abs(got[key] - want) / ulp(mag)
            assert err.max(initial=0) <= 2 * micro + (2 if world > 1 else 0), (key, err.max())
        total += sum(float(np.sum(v ** 2)) for v in got.values())
        assert norm == pytest.approx(results[0][1], rel=0)  # one all-reduce: the same norm everywhere
        tensors = stats.tensors()
        for name in ("none", "layers.1.none_rows", "layers.2.none_cols"):
            assert (tensors[name].norm, tensors[name].nonfinite, tensors[name].maxabs) == (0.0, 0, 0.0)
        if world == 1:
            assert tensors["layers.0.gate"].norm == pytest.approx(abs(float(got["0.gate"])), rel=1e-6)
            assert tensors["temperature"].norm == pytest.approx(abs(float(got["nb.temperature"])), rel=1e-6)
    assert results[0][1] == pytest.approx(total, rel=1e-5)


def test_zero_d_parameters_are_refused_at_world_2_before_anything_is_allocated() -> None:
    def job(c: Any) -> None:
        before = c.device.memory_report().as_dict()
        with pytest.raises(ValueError, match="'gate' is 0-d .one element.: sharding splits dim 0 into 2"):
            lg.create_gradient_manager(odd_layout(1), c, strategy="scatter_reduce")
        assert c.device.memory_report().as_dict() == before
    lg.run_threads(2, job)


def test_single_micro_step_world1_is_exact() -> None:
    layout = small_layout()
    for strategy, offload in STRATS:
        (got,) = lg.run_threads(1, lambda c: drive(c, layout, strategy, offload, 1, gfun=bf16_grad))
        for key, (want, _) in reference(layout, 1, 1, 0).items():
            assert np.array_equal(got[key], want), (strategy, key)


def hands_out_shards(comm: Any, strategy: str, offload: bool, inline: bool | None = None) -> list[bool]:
    """Per micro-step of a 2-micro-step step: whether every ``block_full`` handed out this
    rank's shards themselves (rather than the staging buffers)."""
    layout = small_layout()
    gm = lg.create_gradient_manager(layout, comm, strategy=strategy, offload=offload, inline=inline)
    stream = comm.device.stream()
    shard_ptrs = {t.ptr for t in gm.shards()}
    out = []
    for m in range(2):
        gm.start_micro_step(stream, m, 2)
        own = []
        for layer in reversed(range(layout.num_layers)):
            dw, acc = gm.block_full(layer, stream)
            assert acc is False
            own.append(all(t.ptr in shard_ptrs for t in dw.tensors()))
            for t in dw.tensors():  # the engine's write: the exchange reads it
                lg.ops.fill_zero(t, stream)
            gm.notify_block(layer, stream)
        gm.end_micro_step(stream)
        assert len(set(own)) == 1, own
        out.append(own[0])
    gm.close()
    return out


@pytest.mark.parametrize("strategy", ["scatter_reduce", "all_to_all"])
def test_world1_micro_step_zero_writes_straight_into_the_shards(strategy: str) -> None:
    """At world 1 with device shards the engine's micro-step-0 gradients go straight into the
    shards (no copy); later micro-steps, offloaded shards and world > 1 use the staging buffers."""
    assert lg.run_threads(1, lambda c: hands_out_shards(c, strategy, False)) == [[True, False]]
    assert lg.run_threads(1, lambda c: hands_out_shards(c, strategy, False, True)) == [[True, False]]
    assert lg.run_threads(1, lambda c: hands_out_shards(c, strategy, False, False)) == [[False, False]]
    assert lg.run_threads(1, lambda c: hands_out_shards(c, strategy, True)) == [[False, False]]
    assert lg.run_threads(2, lambda c: hands_out_shards(c, strategy, False)) == [[False, False]] * 2


def test_inline_is_checked_before_anything_is_allocated() -> None:
    layout = small_layout()

    def create(comm: Any, **kw: Any) -> None:
        before = comm.device.memory_report().as_dict()
        with pytest.raises((TypeError, ValueError)) as exc:
            lg.create_gradient_manager(layout, comm, **kw)
        assert comm.device.memory_report().as_dict() == before
        raise exc.value
    cases = [(1, dict(strategy="scatter_reduce", inline="yes"), TypeError, "bool or None"),
             (1, dict(strategy="all_to_all", inline=1), TypeError, "bool or None"),
             (1, dict(strategy="unsharded", inline=True), ValueError, "accumulates nothing"),
             (1, dict(strategy="scatter_reduce", offload=True, inline=True), ValueError, "offloaded"),
             (2, dict(strategy="scatter_reduce", inline=True), ValueError, "world is 2")]
    for world, kw, err, words in cases:
        with pytest.raises(err, match=words):
            lg.run_threads(world, lambda c: create(c, **kw))
    for kw in (dict(strategy="unsharded", inline=False), dict(strategy="scatter_reduce", offload=True, inline=False)):
        lg.run_threads(1, lambda c: lg.create_gradient_manager(layout, c, **kw).close())


@pytest.mark.parametrize("strategy", ["scatter_reduce", "all_to_all"])
@pytest.mark.parametrize("rounding", ["sr", "ldsr", "rn"])
def test_world1_inline_accumulation_equals_the_communication_stream_path(strategy: str, rounding: str) -> None:
    """World 1, device shards: the manager works inline (on the engine's stream) unless told not
    to; offloaded shards go through the communication stream. All give the same bits, over
    several steps."""
    layout = small_layout(zero_init=True)

    def run(comm: Any, offload: bool, inline: bool | None) -> dict[str, np.ndarray]:
        gm = lg.create_gradient_manager(layout, comm, strategy=strategy, offload=offload, rounding=rounding, seed=5,
                                        inline=inline)
        return drive(comm, layout, strategy, offload, 3, steps=2, gm=gm)
    (inline,) = lg.run_threads(1, lambda c: run(c, False, None))
    for offload, flag in ((True, None), (False, False)):
        (other,) = lg.run_threads(1, lambda c: run(c, offload, flag))
        assert inline.keys() == other.keys()
        for key in inline:
            assert np.array_equal(inline[key], other[key]), (offload, flag, key)


@pytest.mark.parametrize("rounding", ["sr", "ldsr"])
def test_sr_accumulation_is_unbiased_and_fresh_every_micro_step(rounding: str) -> None:
    """1.0 on micro-step 0, then a constant of 0.164 ulp for 63 micro-steps (the sum stays in
    [1, 2), one ulp = 2**-7). With fresh noise each micro-step ("sr") the error is a random walk
    (std about sqrt(63 * 0.164 * 0.836) = 2.9 ulps); with noise repeated across micro-steps each
    element would round the same way every time and drift linearly (std over 20 ulps). With
    low-discrepancy noise ("ldsr") successive rounding errors cancel: the error stays under two ulps
    (std under 1), and unbiased, because the sum stays in one binade (docs/accuracy.md, "Bias")."""
    layout = lg.Layout(block=[lg.ParamSpec("w", (8192,))], non_block=[], num_layers=1)
    c = 1.3125 * 2.0 ** -10  # exact in bf16

    def const(rank: int, micro: int, layer: int, i: int, shape: tuple[int, ...], step: int) -> np.ndarray:
        return np.full(shape, 1.0 if micro == 0 else c, np.float32)

    M = 64
    for strategy in ("scatter_reduce", "all_to_all"):
        def job(comm: Any) -> dict[str, np.ndarray]:
            gm = lg.create_gradient_manager(layout, comm, strategy=strategy, rounding=rounding)
            return drive(comm, layout, strategy, False, M, gm=gm, gfun=const)
        (got,) = lg.run_threads(1, job)
        err = (got["0.w"] - (1.0 + (M - 1) * c)) / 2.0 ** -7
        assert abs(err.mean()) < 0.3, (strategy, err.mean())
        if rounding == "sr":
            assert 1.0 < err.std() < 6.0, (strategy, err.std())
        else:
            assert err.std() < 0.8 and np.abs(err).max() < 2.0, (strategy, err.std())


def test_all_to_all_and_scatter_reduce_agree() -> None:
    """Both strategies land within the SR bound of each other (the scale of the rounding is the
    largest magnitude a partial sum reached)."""
    layout = small_layout()
    for world in (2, 4):
        a = lg.run_threads(world, lambda c: drive(c, layout, "all_to_all", False, 3, gfun=bf16_grad))
        b = lg.run_threads(world, lambda c: drive(c, layout, "scatter_reduce", False, 3, gfun=bf16_grad))
        for rank, (ra, rb) in enumerate(zip(a, b)):
            for key, (_, mag) in reference(layout, world, 3, rank).items():
                assert (np.abs(ra[key] - rb[key]) / ulp(mag)).max() <= 2 * (2 * 3 + 2), key


def test_zero_init_is_zeroed_each_step() -> None:
    layout = small_layout(zero_init=True)
    for strategy, offload in STRATS:
        (got,) = lg.run_threads(1, lambda c: drive(c, layout, strategy, offload, 2, steps=2, gfun=bf16_grad))
        ref = reference(layout, 1, 2, 0, step=1)
        for layer in range(layout.num_layers):
            want, mag = ref[f"{layer}.b1"]
            assert (np.abs(got[f"{layer}.b1"] - want) / ulp(mag)).max() <= 4, strategy


def test_state_restore_is_bit_identical() -> None:
    layout = small_layout()
    for strategy, offload in STRATS[1:]:
        def job(comm: Any) -> tuple[dict, dict]:
            gm = lg.create_gradient_manager(layout, comm, strategy=strategy, offload=offload, seed=7)
            drive(comm, layout, strategy, offload, 3, gm=gm)
            state = gm.state_dict()
            after = drive(comm, layout, strategy, offload, 3, gm=gm, first_step=1)
            gm2 = lg.create_gradient_manager(layout, comm, strategy=strategy, offload=offload, seed=0)
            gm2.load_state_dict(state)
            again = drive(comm, layout, strategy, offload, 3, gm=gm2, first_step=1)
            return after, again

        for after, again in lg.run_threads(2, job):
            for key in after:
                assert np.array_equal(after[key], again[key]), (strategy, key)


def test_different_seeds_give_different_noise() -> None:
    layout = small_layout()

    def job(comm: Any, seed: int) -> dict:
        gm = lg.create_gradient_manager(layout, comm, strategy="scatter_reduce", seed=seed)
        return drive(comm, layout, "scatter_reduce", False, 3, gm=gm)

    (a,) = lg.run_threads(1, lambda c: job(c, 1))
    (b,) = lg.run_threads(1, lambda c: job(c, 2))
    assert any(not np.array_equal(a[k], b[k]) for k in a)


def _comm() -> Any:
    return lg.run_threads(1, lambda c: c)[0]


def test_misuse_raises() -> None:
    layout = small_layout()

    def job(comm: Any) -> None:
        gm = lg.create_gradient_manager(layout, comm, strategy="scatter_reduce")
        s = comm.device.default_stream
        with pytest.raises(ProtocolError, match="outside a micro-step"):
            gm.block_full(2, s)
        with pytest.raises(ProtocolError, match="expected 0"):
            gm.start_micro_step(s, 1, 2)
        gm.start_micro_step(s, 0, 2)
        with pytest.raises(ProtocolError, match="in progress"):
            gm.start_micro_step(s, 0, 2)
        with pytest.raises(ProtocolError, match="out of order"):
            gm.block_full(0, s)
        with pytest.raises(ProtocolError, match="not fetched"):
            gm.notify_block(2, s)
        gm.block_full(2, s)
        with pytest.raises(ProtocolError, match="not notified"):
            gm.block_full(1, s)
        with pytest.raises(ValueError):
            gm.block_full(7, s)
        gm.notify_block(2, s)
        with pytest.raises(ProtocolError, match="not notified"):
            gm.end_micro_step(s)
        with pytest.raises(ProtocolError, match="without non_block_full"):
            gm.notify_non_block("emb", s)
        gm.non_block_full("emb", s)
        with pytest.raises(ProtocolError, match="again before"):
            gm.non_block_full("emb", s)
        with pytest.raises(KeyError, match="nope"):
            gm.non_block_full("nope", s)
        for layer in (1, 0):
            gm.block_full(layer, s)
            gm.notify_block(layer, s)
        with pytest.raises(ProtocolError, match="emb"):
            gm.end_micro_step(s)
        gm.notify_non_block("emb", s)
        gm.end_micro_step(s)
        with pytest.raises(ProtocolError, match="during step"):
            gm.block_shard(0, s)
        with pytest.raises(ProtocolError, match="changed"):
            gm.start_micro_step(s, 1, 3)

    lg.run_threads(1, job)


def test_bad_configuration_raises() -> None:
    comm = _comm()
    with pytest.raises(ValueError, match="strategy"):
        lg.create_gradient_manager(small_layout(), comm, strategy="zero3")
    with pytest.raises(ValueError, match="offload"):
        lg.create_gradient_manager(small_layout(), comm, strategy="unsharded", offload=True)
    with pytest.raises(TypeError, match="dtype"):
        lg.create_gradient_manager(small_layout(), comm, dtype=lg.fp16)
    mixed = lg.Layout(block=[lg.ParamSpec("w", (4,), dtype=lg.fp32)], non_block=[], num_layers=1)
    with pytest.raises(TypeError, match="'w'"):
        lg.create_gradient_manager(mixed, comm, dtype=lg.bf16)
    odd = lg.Layout(block=[lg.ParamSpec("w", (6, 2))], non_block=[], num_layers=1)

    def job(c: Any) -> None:
        with pytest.raises(ValueError, match=r"'w'.*world 4"):
            lg.create_gradient_manager(odd, c, strategy="scatter_reduce")

    lg.run_threads(4, job)
    with pytest.raises(TypeError):
        lg.create_gradient_manager({"block": []}, comm)


@pytest.mark.parametrize("offload", [False, True])
def test_sharded_memory_matches_formula(offload: bool) -> None:
    """Device bytes = two block buffers + L * block / world (0 with offload) + full non-block."""
    layout = lg.llama_layout("tiny")
    world = 2

    def job(c: Any) -> dict:
        gm = lg.create_gradient_manager(layout, c, strategy="scatter_reduce", offload=offload)
        return gm.memory_report().as_dict()

    rep = lg.run_threads(world, job)[0]
    block, nb, L = 2 * layout.block_numel, 2 * layout.non_block_numel, layout.num_layers
    dev = rep["device"]
    assert dev["block_grad"] == 2 * block and dev["non_block_grad"] == nb
    assert rep["pinned" if offload else "device"]["block_grad_shards"] == L * block // world
    expected = 2 * block + nb + (0 if offload else L * block // world)
    assert dev["seed_counter"] == 24 and dev["grad_norm"] == 4  # the manager's two scalars
    assert sum(v for k, v in dev.items() if k not in ("grad_norm", "seed_counter")) == expected


def test_grad_norm_squared() -> None:
    layout = small_layout()

    def job(c: Any) -> tuple[float, float]:
        gm = lg.create_gradient_manager(layout, c, strategy="scatter_reduce")
        drive(c, layout, "scatter_reduce", False, 2, gm=gm)
        local = sum(float(np.sum(t.numpy().astype(np.float64) ** 2)) for t in gm.shards())
        return float(gm.grad_norm_squared().numpy()[0]), local

    out = lg.run_threads(2, job)
    total = sum(local for _, local in out)
    for got, _ in out:
        assert got == pytest.approx(total, rel=1e-5)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("strategy,offload", STRATS)
@pytest.mark.parametrize("params", [(), (lg.ParamSpec("none", (0, 4)), lg.ParamSpec("empty", (2, 0)))],
                         ids=["none", "zero-size"])
def test_grad_norm_squared_of_no_parameters_is_zero(world: int, strategy: str, offload: bool,
                                                    params: tuple[lg.ParamSpec, ...]) -> None:
    """A manager with no parameters, or only zero-size ones, sums no squares: its norm is 0.0
    every step, not the bytes its tensor held (here NaN written into it between the steps)."""
    layout = lg.Layout(block=params, non_block=params, num_layers=2)

    def job(c: Any) -> list[float]:
        gm = lg.create_gradient_manager(layout, c, strategy=strategy, offload=offload)
        out = []
        for step in range(2):
            drive(c, layout, strategy, offload, 2, gm=gm, first_step=step)
            norm = gm.grad_norm_squared()
            out.append(float(norm.numpy()[0]))
            lg.ops.fill_nan(norm)  # what a stale read would return next step
        gm.close()
        return out

    assert lg.run_threads(world, job) == [[0.0, 0.0]] * world


def test_bind_add_sr_multi_host_equals_separate_calls_and_checks() -> None:
    h = lg.HostDevice()
    rng = np.random.default_rng(3)
    mk = lambda n, dt: lg.from_numpy(rng.standard_normal(n).astype(dt.np), h, name="m")  # noqa: E731
    items = [(mk(n, lg.bf16), None, mk(n, lg.bf16), 8 * i + 1) for i, n in enumerate((5, 64, 1000))]
    items = [(d, d, b, off) for d, _, b, off in items]
    want = [lg.reference.add_sr(d.numpy(), b.numpy(), 2.0, 11 + i, off) for i, (d, _, b, off) in enumerate(items)]
    lg.ops.bind_add_sr_multi(items, [11, 12, 13], 2.0)(0)
    for (d, *_), w in zip(items, want):
        assert np.array_equal(d.numpy().view(np.uint16), w.view(np.uint16))
    with pytest.raises(ValueError):
        lg.ops.bind_add_sr_multi([], [])
    with pytest.raises(TypeError, match="every item"):
        lg.ops.bind_add_sr_multi([items[0], (mk(4, lg.fp32), mk(4, lg.fp32), mk(4, lg.bf16), 0)], [1, 2])
    with pytest.raises(ValueError, match="size"):
        lg.ops.bind_add_sr_multi([(mk(4, lg.bf16), mk(4, lg.bf16), mk(5, lg.bf16), 0)], [1])
    with pytest.raises(ValueError, match="need 3 seeds"):
        lg.ops.bind_add_sr_multi(items, [1, 2])
    with pytest.raises(ValueError, match="seed"):
        lg.ops.bind_add_sr_multi(items, [1, 2, -3])


def test_seed_counter_seeds_follow_the_counter_on_the_host() -> None:
    """Kernels bound to a SeedCounter use DESIGN's per-use seed of the counter's value when they
    run: set, next_micro and next_step change the noise exactly as use_seed says."""
    from lowgrad.sr.seedcounter import SeedCounter
    h = lg.HostDevice()
    rng = np.random.default_rng(4)
    a = rng.standard_normal(1000).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal(1000).astype(np.float32)
    counter = SeedCounter(h, 77, 5)
    out, src = lg.from_numpy(a, h, name="d"), lg.from_numpy(b, h, name="s")
    dst = out
    run = lg.ops.bind_add_sr_multi([(out, out, src, 3)], (counter, 9, [5]))
    got = []
    for advance in (None, counter.next_micro, counter.next_micro, counter.next_step):
        if advance is not None:
            advance(0)
        out.numpy()[:] = a
        run(0)
        got.append(out.numpy().copy())
    for (step, micro), g in zip(((5, 0), (5, 1), (5, 2), (6, 0)), got):
        want = lg.reference.add_sr(a, b, 1.0, lg.use_seed(77, step, micro, 9, 2, 1), 3)
        assert np.array_equal(g.view(np.uint16), want.view(np.uint16)), (step, micro)
    red = lg.from_numpy(np.zeros(500, np.float32), h, name="r")
    lg.ops.bind_reduce_sr(red, src, 2, -1, 1.0, False, 0, (counter, 1, 4))(0)
    want = lg.reference.reduce_sr(np.zeros(500, np.float32), b, 2, -1, 1.0, False, lg.use_seed(77, 6, 0, 1, 2, 0))
    assert np.array_equal(red.numpy(), want)
    with pytest.raises(ValueError, match="lane"):
        lg.ops.bind_add_sr_multi([(out, dst, src, 3)], (counter, 9, [-1]))
    with pytest.raises(ValueError, match="lanes for"):
        lg.ops.bind_add_sr_multi([(out, dst, src, 3)], (counter, 9, [1, 2]))
    with pytest.raises(ValueError, match="lives on"):
        lg.ops.bind_add_sr_multi([(out, dst, src, 3)], (SeedCounter(lg.HostDevice(), 1, 1), 9, [1]))
    with pytest.raises(TypeError, match="SeedCounter"):
        lg.ops.bind_add_sr_multi([(out, dst, src, 3)], (1, 9, [1]))
    with pytest.raises(ValueError, match="step"):
        counter.set(1, 1 << 32)
