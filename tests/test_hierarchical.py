"""The ``hierarchical`` strategy (lowgrad/managers/strategies/hierarchical.py) on the host
backend: bit for bit the shards of an independent numpy reference at world 4 (2 nodes x 2) and
8 (2 x 4, 4 x 2), with and without offload, every rounding; the group size from the launcher;
checks before anything is allocated; statistics, discard_step and lowgrad.torch."""
from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest
from test_managers import bf16_grad, drive, reference, ulp

import lowgrad as lg
from lowgrad.contracts.communicator import all_to_all_skip, all_to_all_source
from lowgrad.sr import reference as sr_ref
from lowgrad.sr.seedcounter import ld_shift

SHAPES = [(4, 2), (8, 4), (8, 2), (4, 1), (4, 4)]  # (world, GPUs per node)


def small_layout(layers: int = 3) -> lg.Layout:
    """Dims that divide by 8; a zero_init tensor (zeroed and added into by the engine)."""
    block = [lg.ParamSpec("w1", (8, 6)), lg.ParamSpec("b1", (8,), zero_init=True), lg.ParamSpec("w2", (16, 3))]
    return lg.Layout(block=block, non_block=[lg.ParamSpec("emb", (16, 4)), lg.ParamSpec("norm", (8,))],
                     num_layers=layers)


def mean_bf16(parts: list[np.ndarray]) -> np.ndarray:
    """An average reduction as NCCL's and the host's: float32 sum in rank order, times
    float32(1/n), rounded to nearest even bf16."""
    acc = np.zeros(parts[0].shape, np.float32)
    for p in parts:
        acc = acc + p.astype(np.float32)
    return (acc * np.float32(1.0 / len(parts))).astype(ml_dtypes.bfloat16)


def expected(layout: lg.Layout, world: int, G: int, micro: int, seed: int, rounding: str,
             step: int = 0) -> list[dict[str, np.ndarray]]:
    """Every rank's block shards: per micro-step the node's mean of each chunk of W, accumulated
    per chunk with SR (node n: the noise of the chunk's element indices in the full tensor plus
    n * numel), then the mean over the nodes of each rank's chunk."""
    N = world // G
    out: list[dict[str, np.ndarray]] = [{} for _ in range(world)]
    for layer in range(layout.num_layers):
        for i, s in enumerate(layout.block):
            chunk = s.numel // world
            grads = [[bf16_grad(r, m, layer, i, s.shape, step).reshape(-1) for m in range(micro)]
                     for r in range(world)]
            acc: dict[tuple[int, int], np.ndarray] = {}  # (node, chunk) -> accumulated node mean
            for n in range(N):
                for c in range(world):
                    sl = slice(c * chunk, (c + 1) * chunk)
                    for m in range(micro):
                        nm = mean_bf16([grads[n * G + k][m][sl] for k in range(G)])
                        if m == 0:
                            acc[n, c] = nm
                            continue
                        ld = rounding == "ldsr"
                        seed_m = lg.use_seed(seed, step, 0 if ld else m, layer, i, 0)
                        acc[n, c] = sr_ref.add_sr(acc[n, c], nm, 1.0, seed_m, n * s.numel + c * chunk,
                                                  shift=ld_shift(m) if ld else 0, nearest=rounding == "rn")
            for r in range(world):
                shard = mean_bf16([acc[n, r] for n in range(N)])
                out[r][f"{layer}.{s.name}"] = shard.astype(np.float64).reshape((s.shape[0] // world,) + s.shape[1:])
    return out


def fold(dst: np.ndarray, parts: dict[int, np.ndarray], me: int, size: int, scale: float, seed: int,
         index: int) -> np.ndarray:
    """A SumExchange's result for rank ``me`` of a group of ``size``: ``reduce_sr`` of the peers'
    ``parts`` (by their rank in the group) as the all-to-all leaves them in the slots, into ``dst``."""
    skip = all_to_all_skip(me, size)
    src = np.zeros((size, dst.size), dst.dtype)
    for slot in range(size):
        if slot != skip:
            src[slot] = parts[all_to_all_source(me, size, slot)]
    return sr_ref.reduce_sr(dst, src.reshape(-1), size, skip, scale, True, seed, index)


def expected_sr(layout: lg.Layout, world: int, G: int, micro: int, seed: int,
                step: int = 0) -> list[dict[str, np.ndarray]]:
    """Every rank's block shards under ``rounding="sr"``, whose exchanges add in float32 and round
    once with SR: per micro-step each rank's own chunks ``k*G + g`` into its accumulator pieces (a
    copy at micro-step 0, an SR add after, phase 0), then the node's peers' chunks, in the slot
    order the all-to-all leaves them (:func:`all_to_all_source`), added in float32 and rounded once
    (phase 1; node n's noise); at the last micro-step the other nodes' pieces ``n`` the same way
    into piece ``n``, scaled by 1/world (the noise of index ``N * numel`` on)."""
    N = world // G
    out: list[dict[str, np.ndarray]] = [{} for _ in range(world)]
    for layer in range(layout.num_layers):
        for i, s in enumerate(layout.block):
            c = s.numel // world
            grads = [[bf16_grad(r, m, layer, i, s.shape, step).reshape(-1).astype(ml_dtypes.bfloat16)
                      for m in range(micro)] for r in range(world)]
            acc: dict[tuple[int, int, int], np.ndarray] = {}  # (node, index in it, piece) -> piece
            for m in range(micro):
                last = m == micro - 1
                for n in range(N):
                    for g in range(G):
                        for k in range(N):
                            sl = slice((k * G + g) * c, (k * G + g + 1) * c)
                            own, idx = grads[n * G + g][m][sl], n * s.numel + (k * G + g) * c
                            p = own.copy() if m == 0 else sr_ref.add_sr(
                                acc[n, g, k], own, 1.0, lg.use_seed(seed, step, m, layer, i, 0), idx)
                            if G > 1:
                                peers = {h: grads[n * G + h][m][sl] for h in range(G) if h != g}
                                p = fold(p, peers, g, G, 1.0 / world if last and N == 1 else 1.0,
                                         lg.use_seed(seed, step, m, layer, i, 1), idx)
                            acc[n, g, k] = p
            for r in range(world):
                n, g = divmod(r, G)
                shard = acc[n, g, n]
                if N > 1:
                    shard = fold(shard, {h: acc[h, g, n] for h in range(N) if h != n}, n, N, 1.0 / world,
                                 lg.use_seed(seed, step, micro - 1, layer, i, 1), N * s.numel + r * c)
                out[r][f"{layer}.{s.name}"] = shard.astype(np.float64).reshape((s.shape[0] // world,) + s.shape[1:])
    return out


def run(world: int, G: int, offload: bool, micro: int, rounding: str = "ldsr", seed: int = 0,
        **kw: Any) -> list[dict[str, np.ndarray]]:
    layout = small_layout()

    def fn(c: Any) -> dict[str, np.ndarray]:
        gm = lg.create_gradient_manager(layout, c, strategy="hierarchical", offload=offload, seed=seed,
                                        rounding=rounding, group_size=G, **kw)
        with gm:
            return drive(c, layout, "hierarchical", offload, micro, gm=gm, gfun=bf16_grad)
    return lg.run_threads(world, fn)


@pytest.mark.parametrize("world,G", SHAPES)
@pytest.mark.parametrize("offload", [False, True])
def test_bit_identical_to_the_reference(world: int, G: int, offload: bool) -> None:
    layout = small_layout()
    got = run(world, G, offload, 3, seed=11)
    want = expected(layout, world, G, 3, 11, "ldsr")
    for r in range(world):
        for key, w in want[r].items():
            assert np.array_equal(got[r][key], w), (r, key)
        # the non-block gradients: reduced over every rank as in every strategy
        ref = reference(layout, world, 3, r)
        for key in (k for k in ref if k.startswith("nb.")):
            want_nb, mag = ref[key]
            assert (np.abs(got[r][key] - want_nb) / ulp(mag)).max() <= 8, key


@pytest.mark.parametrize("rounding", ["sr", "rn", "ldsr"])
@pytest.mark.parametrize("micro", [1, 2])
def test_every_rounding_and_micro_step_count(rounding: str, micro: int) -> None:
    got = run(4, 2, False, micro, rounding=rounding, seed=5)
    want = (expected_sr(small_layout(), 4, 2, micro, 5) if rounding == "sr"
            else expected(small_layout(), 4, 2, micro, 5, rounding))
    assert all(np.array_equal(got[r][k], w) for r in range(4) for k, w in want[r].items())


@pytest.mark.parametrize("world,G", [*SHAPES, (4, 4), (8, 8), (8, 1)])
@pytest.mark.parametrize("offload", [False, True])
def test_sr_exchanges_bit_identical_to_the_reference(world: int, G: int, offload: bool) -> None:
    """Under "sr" every exchange is an all-to-all summed in float32 and rounded once with SR:
    the bits of :func:`expected_sr` at every node shape, one node and one rank per node included,
    with and without offload (the pieces summed into in pinned memory)."""
    got = run(world, G, offload, 3, rounding="sr", seed=7)
    want = expected_sr(small_layout(), world, G, 3, 7)
    for r in range(world):
        for key, w in want[r].items():
            assert np.array_equal(got[r][key], w), (world, G, r, key)


def test_sr_on_one_node_is_all_to_all() -> None:
    """One node under "sr": the exchange of all_to_all, with its noise, bit for bit (blocks and
    non-block gradients)."""
    layout = small_layout()

    def job(strategy: str, **kw: Any) -> list[dict[str, np.ndarray]]:
        def fn(c: Any) -> dict[str, np.ndarray]:
            with lg.create_gradient_manager(layout, c, strategy=strategy, rounding="sr", seed=3, **kw) as gm:
                return drive(c, layout, strategy, False, 3, gm=gm, gfun=bf16_grad)
        return lg.run_threads(4, fn)
    a2a, hier = job("all_to_all"), job("hierarchical", group_size=4)
    assert all(np.array_equal(a2a[r][k], hier[r][k]) for r in range(4) for k in a2a[r])


def test_one_node_is_scatter_reduce_and_one_gpu_per_node_is_close() -> None:
    """G = world: one node, the same bits as scatter_reduce; the float64 mean within SR bounds
    at every shape."""
    layout = small_layout()
    sr = lg.run_threads(4, lambda c: drive(c, layout, "scatter_reduce", False, 3, gfun=bf16_grad))
    hier = run(4, 4, False, 3)
    assert all(np.array_equal(sr[r][k], hier[r][k]) for r in range(4) for k in sr[r])
    for G in (1, 2):
        got = run(4, G, False, 3)
        for r in range(4):
            for key, (want, mag) in reference(layout, 4, 3, r).items():
                assert (np.abs(got[r][key] - want) / ulp(mag)).max() <= 10, (G, r, key)


def test_group_size_from_the_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without group_size the launcher's ranks per node group the ranks: the same bits as
    group_size=2 under LOCAL_WORLD_SIZE=2 or OMPI_COMM_WORLD_LOCAL_SIZE=2; a bad value is named."""
    layout = small_layout()
    want = run(4, 2, False, 2)

    def default(c: Any) -> dict[str, np.ndarray]:
        with lg.create_gradient_manager(layout, c, strategy="hierarchical") as gm:
            return drive(c, layout, "hierarchical", False, 2, gm=gm, gfun=bf16_grad)
    for var in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"):
        for other in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"):
            monkeypatch.delenv(other, raising=False)
        monkeypatch.setenv(var, "2")
        got = lg.run_threads(4, default)
        assert all(np.array_equal(a[k], b[k]) for a, b in zip(got, want) for k in a), var
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "2(x2)")
    with pytest.raises(ValueError, match=r"SLURM_NTASKS_PER_NODE='2\(x2\)' is not a positive int"):
        lg.run_threads(4, default)
    monkeypatch.delenv("SLURM_NTASKS_PER_NODE")  # no launcher: one node, scatter_reduce's bits
    sr = lg.run_threads(4, lambda c: drive(c, layout, "scatter_reduce", False, 2, gfun=bf16_grad))
    assert all(np.array_equal(a[k], b[k]) for a, b in zip(lg.run_threads(4, default), sr) for k in a)


@pytest.mark.parametrize("group_size,exc,match", [
    (3, ValueError, "group_size 3 must be a positive divisor of world 4"), (0, ValueError, "positive divisor"),
    (True, TypeError, "group_size"), (2.0, TypeError, "group_size")])
def test_bad_group_size_raises_before_anything_is_allocated(group_size: Any, exc: type[Exception],
                                                            match: str) -> None:
    layout = small_layout()

    def fn(c: Any) -> None:
        before = c.device.memory_report().as_dict()
        with pytest.raises(exc, match=match):
            lg.create_gradient_manager(layout, c, strategy="hierarchical", group_size=group_size)
        assert c.device.memory_report().as_dict() == before
        with pytest.raises(TypeError, match="takes no options"):
            lg.create_gradient_manager(layout, c, strategy="hierarchical", group_size=2, nodes=2)
        with pytest.raises(ValueError, match="inline=True needs"):
            lg.create_gradient_manager(layout, c, strategy="hierarchical", group_size=2, inline=True)
        lg.create_gradient_manager(layout, c, strategy="hierarchical", group_size=2).close()
    lg.run_threads(4, fn)


def test_memory_is_two_buffers_and_one_node_shard_per_layer() -> None:
    layout = small_layout()
    B = sum(s.numel for s in layout.block) * 2  # bf16 bytes of one layer's gradients

    def fn(c: Any) -> Any:
        with lg.create_gradient_manager(layout, c, strategy="hierarchical", group_size=2, offload=True) as gm:
            return gm.memory_report().as_dict()
    rep = lg.run_threads(4, fn)[0]
    assert rep["device"]["block_grad"] == 2 * B, rep
    assert rep["pinned"]["block_grad_node_shards"] == layout.num_layers * B // 2, rep


# ---- two nodes of two ranks (LOCAL_WORLD_SIZE=2 at world 4) through the other suites' jobs -----------

@pytest.fixture
def two_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")


@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("rounding", [None, "sr"])
@pytest.mark.parametrize("fault", [(0, "before", -1), (1, "fetched", 0), (2, "non_block", 1), (2, "end", -1)],
                         ids=lambda f: f"m{f[0]}-{f[1]}{f[2]}")
def test_discard_step_poisons_every_rank_and_leaves_no_trace(two_nodes: None, offload: bool, rounding: str | None,
                                                             fault: tuple[int, str, int]) -> None:
    from test_manager_faults import check_faulted, faulted_and_clean
    check_faulted(*faulted_and_clean(4, "hierarchical", offload, fault, rounding=rounding), fault)


@pytest.mark.parametrize("rounding,group_size", [(None, "2"), ("sr", "2"), ("sr", "4")])
def test_statistics_local_rows_and_the_step(monkeypatch: pytest.MonkeyPatch, rounding: str | None,
                                            group_size: str) -> None:
    """Each rank's own gradient per micro-step and the step's shards; the micro-step rows (the
    mean over every rank of a micro-step) are measured nowhere across two nodes, nor under "sr"
    on one node (the all-to-all's sum holds no micro-step's mean)."""
    from test_manager_stats import M, columns, ranks_stats, sq
    from test_managers import small_layout as stats_layout  # the layout ranks_stats drives
    monkeypatch.setenv("LOCAL_WORLD_SIZE", group_size)
    block = stats_layout().block
    results = ranks_stats(4, "hierarchical", False, rounding=rounding)
    stats = results[0][1]
    assert stats.micro is None and stats.local is not None
    for r, (shards, _) in enumerate(results):
        for t, (name, layer, i) in enumerate(columns()):
            shard = shards[f"nb.{name}" if layer < 0 else f"{layer}.{block[i].name}"]
            assert stats.accumulated.sumsq[r, t] == pytest.approx(sq(shard), rel=1e-6), (r, name)
            for m in range(M if layer >= 0 else 0):  # the engine accumulates the non-block ones
                want = sq(bf16_grad(r, m, layer, i, block[i].shape, 1))
                assert stats.local.sumsq[r, m, t] == pytest.approx(want, rel=1e-6), (r, m, name)


@pytest.mark.parametrize("fault", ["nan", "backward", "data"])
def test_torch_a_faulted_step_is_skipped_on_every_rank(two_nodes: None, fault: str) -> None:
    pytest.importorskip("torch")
    from test_torch_faults import check_skipped
    from test_torch_faults import run as torch_run
    check_skipped(4, torch_run(4, fault, fault_rank=3, strategy="hierarchical"),
                  torch_run(4, "skip", strategy="hierarchical"))


def test_torch_shards_equal_the_manager_driven_by_hand(two_nodes: None) -> None:
    pytest.importorskip("torch")
    from test_torch_adapter import test_shards_equal_the_manager_driven_by_hand as by_hand
    by_hand(4, "hierarchical", True)


def test_a_rank_that_does_not_create_its_manager_fails_the_others_in_bounded_time() -> None:
    """Creating the manager splits the communicator, a collective: a rank that never creates it
    makes the others' creation fail (CommTimeoutError naming it), with nothing left open."""
    import time
    layout = small_layout()

    def fn(c: Any) -> None:
        if c.rank == 3:
            time.sleep(1.0)
            return
        lg.create_gradient_manager(layout, c, strategy="hierarchical", group_size=2)

    t0 = time.monotonic()
    with pytest.raises(lg.CommTimeoutError, match=r"\[3\]"):
        lg.run_threads(4, fn, timeout=0.3)
    assert time.monotonic() - t0 < 5


def test_the_node_exchange_reuses_one_list_per_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    """notify is a hot path: the node's reduce-scatter gets the list of slices built once per
    buffer at allocation, not one built per call (2 steps x 3 layers x 3 micro-steps: 2 lists)."""
    from lowgrad.managers.strategy import StrategyContext

    lists: dict[int, list[Any]] = {}
    real = StrategyContext.reduce_scatter_all

    def spy(self: Any, tensors: list[Any], comm: Any = None, op: str = "avg") -> None:
        if comm is not None and comm is not self.comm:
            lists.setdefault(self.rank, []).append(tensors)  # kept alive: the ids stay distinct
        real(self, tensors, comm, op)

    monkeypatch.setattr(StrategyContext, "reduce_scatter_all", spy)
    layout = small_layout()

    def fn(c: Any) -> None:
        with lg.create_gradient_manager(layout, c, strategy="hierarchical", group_size=2) as gm:
            drive(c, layout, "hierarchical", False, 3, steps=2, gm=gm, gfun=bf16_grad)
    lg.run_threads(4, fn)
    # per rank: the node exchanges of every micro-step and layer, the cross-node ones of the last
    assert all(len({id(x) for x in ls if len(x) == 2 * len(layout.block)}) == 2 for ls in lists.values()), \
        {r: len({id(x) for x in ls}) for r, ls in lists.items()}


def test_each_node_rounds_with_its_own_noise() -> None:
    """Every rank has the same gradients, so every node accumulates the same values: with one
    noise for all nodes their accumulators, and so the mean over the nodes, would be those of
    scatter_reduce bit for bit and its error theirs; with each node's own noise the errors average
    out across the N = 4 nodes (fresh SR noise, 2^14 elements, 16 micro-steps)."""
    layout = lg.Layout(block=[lg.ParamSpec("w", (4096, 4))], non_block=[], num_layers=1)
    M = 16
    base = np.random.default_rng(0).standard_normal((4096, 4)).astype(np.float32)

    def same(rank: int, micro: int, layer: int, i: int, shape: tuple[int, ...], step: int = 0) -> np.ndarray:
        g = base + 0.02 * np.random.default_rng(micro).standard_normal(shape).astype(np.float32)
        return g.astype(lg.bf16.np).astype(np.float32)
    exact = np.sum([same(0, m, 0, 0, (4096, 4)).astype(np.float64) for m in range(M)], axis=0)

    def job(strategy: str, **kw: Any) -> Any:
        def fn(c: Any) -> dict[str, np.ndarray]:
            with lg.create_gradient_manager(layout, c, strategy=strategy, rounding="sr", **kw) as gm:
                return drive(c, layout, strategy, False, M, gm=gm, gfun=same)
        shards = lg.run_threads(4, fn)
        return np.concatenate([shards[r]["0.w"] for r in range(4)])

    def rms(x: np.ndarray) -> float:
        return float(np.sqrt(np.mean((x - exact) ** 2)))
    sr, hier = job("scatter_reduce"), job("hierarchical", group_size=1)
    assert not np.array_equal(sr, hier)
    assert rms(hier) < 0.75 * rms(sr), (rms(hier), rms(sr))
