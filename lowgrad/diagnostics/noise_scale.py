"""The gradient noise scale B_simple = tr(Σ) / |G|² (McCandlish et al. 2018, "An Empirical Model
of Large-Batch Training", appendix A), estimated from squared gradient norms at two batch sizes.

With G the true gradient and Σ the per-sample covariance, the mean gradient of a batch of B
samples has E|G_B|² = |G|² + tr(Σ)/B. Two batch sizes B_small < B_big give two equations, and
their solution is unbiased for both unknowns:

    |G|²  ≈ (B_big |G_big|² − B_small |G_small|²) / (B_big − B_small)
    tr(Σ) ≈ (|G_small|² − |G_big|²) / (1/B_small − 1/B_big)

where |G_small|² is the mean over the n small batches whose average is the big one (then
B_big = n B_small). B_simple, their ratio, is not unbiased: it is the ratio of two noisy
estimates, and |G|²'s can even be zero or negative on one step.

**Units.** A manager sees *contributions* c_i = k g_i (g_i the mean gradient of a small batch, k
one constant of the step: the engine's loss scale) and accumulates S = Σ_i c_i over the n of them,
not their mean. Taking S itself as the big batch's mean gradient (k = 1/n, an engine that scales
each micro-step's loss by 1/n) gives g_i = n c_i, so |G_small|² = n² mean_i |c_i|² and
|G_big|² = |S|²: ``g2`` and ``trace`` are then in the units of |S|², the squared norm the
manager reports. Another k multiplies both by the same constant; B_simple does not change.
"""
from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray


@dataclass(frozen=True)
class NoiseScale:
    """One estimate: ``g2`` ≈ |G|², ``trace`` ≈ tr(Σ) (per sample: it carries the unit of the
    batch sizes), ``b_simple`` = trace / g2, None where g2 is not positive (a zero gradient, or an
    estimate that noise pushed to zero or below: the ratio means nothing there)."""

    g2: float
    trace: float
    b_simple: float | None

    @classmethod
    def of(cls, g2: float, trace: float) -> NoiseScale:
        return cls(g2, trace, trace / g2 if g2 > 0 else None)


def estimate(small: float, b_small: float, big: float, b_big: float) -> NoiseScale | None:
    """The two-batch estimate from ``small`` = |G_small|² (the mean over the small batches) at
    batch ``b_small`` and ``big`` = |G_big|² at ``b_big``; None when a norm is not finite (a
    non-finite gradient has no noise scale). ValueError unless 0 < b_small < b_big and the
    norms are not negative."""
    if not 0 < b_small < b_big:
        raise ValueError(f"the batch sizes must satisfy 0 < b_small < b_big, got {b_small} and {b_big}")
    if small < 0 or big < 0:
        raise ValueError(f"squared norms cannot be negative, got {small} and {big}")
    if not (math.isfinite(small) and math.isfinite(big)):
        return None
    g2 = (b_big * big - b_small * small) / (b_big - b_small)
    trace = (small - big) / (1.0 / b_small - 1.0 / b_big)
    return NoiseScale.of(g2, trace)


def from_contributions(contributions: NDArray[np.float64], summed: int, b_small: int,
                       total: float, b_big: int) -> NoiseScale | None:
    """The estimate from the squared norms |c_i|² of small-batch contributions and |S|² of
    their accumulation (the module's units): ``summed`` contributions add up to S along the
    micro-steps (the n above when nothing else averages; ranks whose contributions are averaged
    count in ``b_big`` only). None when there is one small batch per big one (nothing to compare)."""
    return group_estimates(contributions.reshape(-1, 1), summed, b_small, np.array([total], np.float64), b_big)[0]


def group_estimates(contributions: NDArray[np.float64], summed: int, b_small: int,
                    totals: NDArray[np.float64], b_big: int) -> list[NoiseScale | None]:
    """:func:`from_contributions` of G groups at once (the layers of a step): column g of
    ``contributions`` [n, G] and ``totals[g]`` are group g's; one mean over the columns."""
    if contributions.shape[0] == 0:
        raise ValueError("no contributions to estimate from")
    if contributions.shape[0] == 1:
        return [None] * contributions.shape[1]
    small = float(summed) ** 2 * contributions.mean(axis=0)
    return [estimate(s, b_small, t, b_big) for s, t in zip(small.tolist(), totals.tolist())]


class NoiseScaleEMA:
    """Moving averages of estimates across steps, one pair per key (global, a layer, ...).

    The averages are of ``g2`` and of ``trace`` separately, and B_simple is their ratio: the
    per-step ``g2`` is an unbiased but noisy estimate that reaches zero or below on some steps,
    so per-step ratios are heavy-tailed and averaging them converges to nothing useful, while
    the ratio of the averages converges to B_simple (what McCandlish et al. do). The averages
    are debiased (divided by the weight the steps so far carry, as Adam does), so the first
    steps are not pulled towards zero; a step without an estimate leaves them as they were."""

    def __init__(self, decay: float = 0.9) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {decay!r}")
        self.decay = decay
        self._sums: dict[Hashable, tuple[float, float, float]] = {}  # key -> (g2, trace, weight)

    def update(self, key: Hashable, value: NoiseScale | None) -> NoiseScale | None:
        """Fold this step's estimate for ``key`` in (None: no estimate this step); the averaged
        estimate, None while ``key`` has had none."""
        if value is not None:
            g2, trace, weight = self._sums.get(key, (0.0, 0.0, 0.0))
            d = self.decay
            self._sums[key] = (d * g2 + (1 - d) * value.g2, d * trace + (1 - d) * value.trace,
                               d * weight + (1 - d))
        if key not in self._sums:
            return None
        g2, trace, weight = self._sums[key]
        return NoiseScale.of(g2 / weight, trace / weight)
