"""``hierarchical`` with ``cross_node_bits=8`` on the host backend: the step's shards equal an
independent emulation of the hop from the accumulator's pieces before it (each node's pieces for
the others quantized to int8 with SR, the node's own piece added in float32 with the others,
rounded once); the option's checks before anything is allocated; the hop adds no bias to the
step's sum (means over seeds within 4 standard errors)."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from test_hierarchical import small_layout
from test_managers import bf16_grad, drive

import lowgrad as lg
from lowgrad.contracts.communicator import all_to_all_skip, all_to_all_source
from lowgrad.managers.exchange import Int8Hop
from lowgrad.sr import reference as ref
from lowgrad.sr.philox import sr_noise
from lowgrad.sr.seedcounter import ld_shift

QB = ref.QBLOCK


def quantize(x: np.ndarray, seed: int, offset: int, shift: int) -> np.ndarray:
    """The values the receiver reads (float32), written from the definition's words."""
    x = x.astype(np.float32)
    r = ((sr_noise(seed, offset, x.size).astype(np.int64) + shift) % 65536).astype(np.float32) / np.float32(65536)
    out = np.zeros(x.size, np.float32)
    for b in range(0, x.size, QB):
        s = np.float32(np.abs(x[b:b + QB]).max()) / np.float32(127)
        if s > 0:
            q = np.clip(np.floor((x[b:b + QB] / s).astype(np.float32) + r[b:b + QB]), -127, 127)
            out[b:b + QB] = q.astype(np.float32) * s
    return out


def run(world: int, G: int, rounding: str, seed: int = 7, micro: int = 3,
        capture: dict[Any, Any] | None = None, layout: lg.Layout | None = None,
        gfun: Any = bf16_grad) -> list[dict[str, np.ndarray]]:
    layout = layout or small_layout()

    def job(c: Any) -> dict[str, np.ndarray]:
        with lg.create_gradient_manager(layout, c, strategy="hierarchical", group_size=G, seed=seed,
                                        rounding=rounding, cross_node_bits=8) as gm:
            return drive(c, layout, "hierarchical", False, micro, gm=gm, gfun=gfun)
    return lg.run_threads(world, job)


@pytest.mark.parametrize("world,G", [(4, 2), (8, 2), (8, 4)])
@pytest.mark.parametrize("rounding", ["sr", "ldsr"])
def test_the_shards_equal_an_independent_emulation(monkeypatch: pytest.MonkeyPatch, world: int, G: int,
                                                   rounding: str) -> None:
    captured: dict[tuple[int, int], list[list[np.ndarray]]] = {}
    real = Int8Hop.run

    def spy(self: Int8Hop, layer: int) -> None:
        captured[self.ctx.rank, layer] = [[p.numpy().astype(np.float32).reshape(-1) for p in ps]
                                          for ps in self.pieces[layer]]
        real(self, layer)
    monkeypatch.setattr(Int8Hop, "run", spy)
    M, seed, layout = 3, 7, small_layout()
    got = run(world, G, rounding, seed, M)
    N, last = world // G, M - 1
    ld = rounding == "ldsr"
    shift = ld_shift(last) if ld else 0
    for r in range(world):
        n, g = divmod(r, G)
        skip = all_to_all_skip(n, N)
        for layer in range(layout.num_layers):
            for i, s in enumerate(layout.block):
                chunk = s.numel // world
                acc = captured[r, layer][i][n].copy()
                for m in range(N):
                    if m == skip:
                        continue
                    k = all_to_all_source(n, N, m)
                    q_seed = lg.use_seed(seed, 0, 0 if ld else last, layer, i, 0)
                    acc = acc + quantize(captured[k * G + g, layer][i][n], q_seed,
                                         (N + 1 + k) * s.numel + (n * G + g) * chunk, shift)
                scale = 1.0 / world if rounding == "sr" else 1.0 / N
                r_seed = lg.use_seed(seed, 0, 0 if ld else last, layer, i, 1)
                want = ref.round_sr((acc * np.float32(scale)).astype(np.float32), r_seed,
                                    N * s.numel + r * chunk, lg.bf16, shift)
                shard = got[r][f"{layer}.{s.name}"].reshape(-1).astype(np.float32)
                assert np.array_equal(shard, want.astype(np.float32)), (r, layer, s.name)


@pytest.mark.parametrize("bits,exc", [(4, ValueError), ("8", TypeError), (8.0, TypeError), (True, TypeError)])
def test_a_bad_width_is_refused_before_anything_is_made(bits: Any, exc: type) -> None:
    layout = small_layout()

    def job(c: Any) -> int:
        with pytest.raises(exc, match="cross_node_bits"):
            lg.create_gradient_manager(layout, c, strategy="hierarchical", group_size=2, cross_node_bits=bits)
        with lg.create_gradient_manager(layout, c, strategy="hierarchical", group_size=2, cross_node_bits=8,
                                        rounding="sr") as gm:  # the corrected call
            return gm.world
    assert lg.run_threads(4, job) == [4] * 4


def test_the_other_strategies_refuse_the_option() -> None:
    with pytest.raises(TypeError, match="cross_node_bits"):
        lg.run_threads(2, lambda c: lg.create_gradient_manager(small_layout(), c, strategy="scatter_reduce",
                                                               cross_node_bits=8))


def test_the_int8_hop_adds_no_bias() -> None:
    """2 nodes x 1 rank, one micro-step, every rank writing a value between two int8 steps of its
    block (the block's largest value sets the scale): the mean of the step's mean over 400 seeds
    equals the exact mean within 4 standard errors; round to nearest of the same hop misses it."""
    layout = lg.Layout(block=[lg.ParamSpec("w", (256,))], non_block=[], num_layers=1)

    def grads(rank: int, m: int, layer: int, i: int, shape: tuple[int, ...], step: int) -> np.ndarray:
        g = np.full(shape, 0.302734375, np.float32)  # bf16-exact; 38.45 int8 steps of 1/127
        g[::128] = 1.0  # each block's scale 1/127
        return g

    means = np.array([run(2, 1, "sr", seed=s, micro=1, layout=layout, gfun=grads)[0]["0.w"][1:64].mean()
                      for s in range(400)])
    exact = 0.302734375
    se = means.std() / np.sqrt(len(means))
    assert abs(means.mean() - exact) < 4 * se + 1e-9, (means.mean(), exact, se)
    nearest = run(2, 1, "rn", micro=1, layout=layout, gfun=grads)[0]["0.w"][1:64].mean()
    assert abs(nearest - exact) > 100 * se  # 38.45 steps round to 38 on the other node: a bf16 step low


def test_a_nan_crosses_the_hop_as_nan_and_the_next_step_is_clean() -> None:
    """A NaN in one rank's gradient at step 0 makes its block's scale NaN: the receiving rank's
    shard holds NaN (the step is seen as non-finite, not silently cleaned), and step 1 on the same
    managers is finite again."""
    layout = small_layout()

    def gfun(rank: int, m: int, layer: int, i: int, shape: tuple[int, ...], step: int) -> np.ndarray:
        g = bf16_grad(rank, m, layer, i, shape, step)
        if step == 0 and rank == 1 and layer == 0 and i == 0:
            g.reshape(-1)[-1] = np.nan  # in rank 3's chunk: it reaches node 1 only through the hop
        return g

    def job(c: Any) -> tuple[bool, bool]:
        with lg.create_gradient_manager(layout, c, strategy="hierarchical", group_size=2, seed=3, rounding="sr",
                                        cross_node_bits=8) as gm:
            first = drive(c, layout, "hierarchical", False, 2, gm=gm, gfun=gfun)
            second = drive(c, layout, "hierarchical", False, 2, gm=gm, gfun=gfun, first_step=1)
            return (bool(np.isnan(first["0.w1"]).any()),
                    all(np.isfinite(v).all() for k, v in second.items() if not k.startswith("nb.")))
    out = lg.run_threads(4, job)
    assert [nan for nan, _ in out] == [False, False, False, True] and all(clean for _, clean in out)
