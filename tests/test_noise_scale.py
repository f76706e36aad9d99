"""The noise-scale estimators against gradients of a known covariance (G fixed, each small batch's
mean gradient G + N(0, Σ/B) with Σ diagonal plus low rank), the moving average, and the edges.

Tolerance: over the draws, the mean error of the |G|² and tr(Σ) estimates is within 4 standard
errors of zero (the estimators are unbiased), and the ratio of the averaged estimates is within 5%
of the true B_simple (the per-step ratio is not unbiased: the test does not ask it to be)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from lowgrad.diagnostics.noise_scale import NoiseScale, NoiseScaleEMA, estimate, from_contributions
from lowgrad.diagnostics.report import Stats, StepStats

D, RANK = 512, 4
G2, TRACE = 1.0, 400.0  # B_simple = 400


def _problem(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    g = np.full(D, math.sqrt(G2 / D))
    d = 1.0 / (1 + np.arange(D) / 32)
    d *= 0.6 * TRACE / d.sum()
    u = rng.normal(size=(D, RANK))
    u *= math.sqrt(0.4 * TRACE / (u ** 2).sum())
    return g, np.sqrt(d), u


def _draw(rng: np.random.Generator, shape: tuple[int, ...], batch: int, problem: tuple) -> np.ndarray:
    """Mean gradients of batches of ``batch`` samples, shape ``shape + (D,)``."""
    g, sd, u = problem
    return g + (sd * rng.normal(size=(*shape, D)) + rng.normal(size=(*shape, RANK)) @ u.T) / math.sqrt(batch)


def _stats(x: np.ndarray) -> Stats:
    """Stats of two tensors (the first third of the D values, the rest) of gradients ``x`` [..., D]."""
    sq = np.stack([(x[..., :D // 3] ** 2).sum(-1), (x[..., D // 3:] ** 2).sum(-1)], axis=-1)
    return Stats(sq, np.zeros(sq.shape, np.int64), np.zeros(sq.shape))


def _shards(x: np.ndarray, world: int) -> np.ndarray:
    """``x`` [..., D] as W rank parts [W, ..., D]: rank r holds its slice, zeros elsewhere."""
    out = np.zeros((world, *x.shape))
    for r in range(world):
        sl = slice(r * D // world, (r + 1) * D // world)
        out[r, ..., sl] = x[..., sl]
    return out


def _unbiased(values: np.ndarray, truth: float) -> None:
    err = values.mean() - truth
    assert abs(err) < 4 * values.std() / math.sqrt(len(values)), (err, values.std())


def test_estimates_from_micro_steps_are_unbiased() -> None:
    rng = np.random.default_rng(1)
    problem, M, B, draws = _problem(rng), 8, 16, 1000
    g = _draw(rng, (draws, M), B, problem)
    c = 0.37 * g  # any loss scale k: the estimate is in the units of |S|^2, B_simple does not see k
    s = c.sum(axis=1)
    est = [from_contributions((c[i] ** 2).sum(axis=1), M, B, float((s[i] ** 2).sum()), M * B) for i in range(draws)]
    k2 = (0.37 * M) ** 2  # |S|^2 units -> |G|^2 units
    g2 = np.array([e.g2 for e in est]) / k2
    trace = np.array([e.trace for e in est]) / k2
    _unbiased(g2, G2)
    _unbiased(trace, TRACE)
    assert trace.mean() / g2.mean() == pytest.approx(TRACE / G2, rel=0.05)


@pytest.mark.parametrize("columns", ["per micro-step", "accumulated"])
def test_step_stats_estimates_both_pairs_without_bias(columns: str) -> None:
    """Through StepStats, as a manager reports them: W ranks, each rank's local gradient of each
    micro-step, the reduced (mean over ranks) micro-step gradient and the step's sum; two tensors
    in two layers. Local statistics accumulated over the step (the unsharded strategy) too."""
    rng = np.random.default_rng(2)
    problem, W, M, b, draws = _problem(rng), 4, 4, 8, 400
    g2s, traces, local_g2s, local_traces = [], [], [], []
    for _ in range(draws):
        local = _draw(rng, (W, M), b, problem) / M  # k = 1/M: S is the step's mean gradient
        micro = local.mean(axis=0)  # [M, D]
        step = micro.sum(axis=0)
        if columns == "accumulated":
            local = local.sum(axis=1, keepdims=True)
        st = StepStats(names=["emb", "layers.0.w"], layers=[-1, 0], accumulated=_stats(_shards(step, W)),
                       micro=_stats(_shards(micro, W)) if columns == "per micro-step" else None, local=_stats(local),
                       micro_batch=b * W, local_batch=b * (M if columns == "accumulated" else 1),
                       step_batch=M * b * W, step=0, rank=0, world=W, micro_steps=M)
        total = st.summary()
        assert total.noise_local is not None
        local_g2s.append(total.noise_local.g2)
        local_traces.append(total.noise_local.trace)
        if columns == "per micro-step":
            assert total.noise is not None
            g2s.append(total.noise.g2)
            traces.append(total.noise.trace)
        else:
            assert total.noise is None
        layers = st.layer_summaries()
        assert list(layers) == [-1, 0] and layers[0].noise_local is not None
    _unbiased(np.array(local_g2s), G2)
    _unbiased(np.array(local_traces), TRACE)
    if g2s:
        _unbiased(np.array(g2s), G2)
        _unbiased(np.array(traces), TRACE)


def test_the_formulas() -> None:
    """McCandlish App. A on numbers worked by hand: |G_small|^2 = 5 at 10, |G_big|^2 = 2 at 40."""
    e = estimate(5.0, 10, 2.0, 40)
    assert e is not None and e.b_simple is not None
    assert (e.g2, e.trace, e.b_simple) == pytest.approx((1.0, 40.0, 40.0))


def test_edges() -> None:
    assert from_contributions(np.array([4.0]), 1, 8, 4.0, 8) is None  # one micro-step: nothing to compare
    zero = from_contributions(np.zeros(4), 4, 8, 0.0, 32)
    assert zero == NoiseScale(0.0, 0.0, None)  # a zero gradient: no ratio
    assert from_contributions(np.array([1.0, np.nan]), 2, 8, 1.0, 16) is None
    assert from_contributions(np.array([1.0, 1.0]), 2, 8, np.inf, 16) is None
    noisy = estimate(10.0, 8, 4.0, 16)  # |G_big|^2 below half |G_small|^2: the g2 estimate is negative
    assert noisy is not None and noisy.g2 < 0 and noisy.b_simple is None
    for bad in [(1.0, 8, 1.0, 8), (1.0, 0, 1.0, 8), (-1.0, 8, 1.0, 16)]:
        with pytest.raises(ValueError):
            estimate(*bad)
    with pytest.raises(ValueError, match="no contributions"):
        from_contributions(np.zeros(0), 1, 8, 1.0, 16)


def test_moving_average_of_numerator_and_denominator() -> None:
    ema = NoiseScaleEMA(0.5)
    assert ema.update("x", None) is None
    first = ema.update("x", NoiseScale.of(2.0, 20.0))
    assert first == NoiseScale.of(2.0, 20.0)  # debiased: the first step is itself
    second = ema.update("x", NoiseScale.of(-1.0, 10.0))  # a step whose g2 came out negative
    assert second is not None
    assert second.g2 == pytest.approx((0.25 * 2 + 0.5 * -1) / 0.75)
    assert second.trace == pytest.approx((0.25 * 20 + 0.5 * 10) / 0.75)
    assert second.b_simple is None  # the averaged g2 is 0 here
    assert ema.update("x", None) == second  # no estimate: unchanged
    assert ema.update("y", None) is None  # keys are separate
    for decay in (0.0, 1.0, -0.5):
        with pytest.raises(ValueError, match="decay"):
            NoiseScaleEMA(decay)
