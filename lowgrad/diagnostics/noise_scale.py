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
from typing import Any

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
    steps are not pulled towards zero; a step without an estimate leaves them as they were.

    :meth:`state_dict` and :meth:`load_state_dict` carry the averages across a restart (in a
    checkpoint), so that a resumed run's averages are the uninterrupted run's, bit for bit."""

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

    def state_dict(self) -> dict[str, Any]:
        """The running averages as JSON data: ``{"decay": d, "sums": [[key, g2, trace, weight],
        ...]}``, each key as JSON holds it (a tuple as a list). TypeError for a key that is not a
        str, int, float, bool, None or a tuple of them (JSON could not give it back)."""
        return {"decay": self.decay, "sums": [[_key_to_json(k), g2, trace, weight]
                                              for k, (g2, trace, weight) in self._sums.items()]}

    def load_state_dict(self, state: Any) -> None:
        """Restore the averages of a :meth:`state_dict` (as saved, or read back from JSON),
        checked whole first: ValueError naming the entry (TypeError for one of the wrong type)
        and nothing changed, for another decay than this one's, a duplicate key, a weight
        outside (0, 1] or anything not of the form above."""
        self._sums = self._parse(state)

    def check_state(self, state: Any) -> None:
        """What :meth:`load_state_dict` checks, changing nothing."""
        self._parse(state)

    def _parse(self, state: Any) -> dict[Hashable, tuple[float, float, float]]:
        if not isinstance(state, dict) or set(state) != {"decay", "sums"}:
            raise ValueError(f"a NoiseScaleEMA state holds exactly 'decay' and 'sums', got {state!r:.80}")
        if state["decay"] != self.decay:
            raise ValueError(f"the state's averages were kept with decay {state['decay']!r}, this one's is "
                             f"{self.decay!r}")
        if not isinstance(state["sums"], list):
            raise TypeError(f"a NoiseScaleEMA state's sums are a list, got {type(state['sums']).__name__}")
        sums: dict[Hashable, tuple[float, float, float]] = {}
        for i, entry in enumerate(state["sums"]):
            if not isinstance(entry, list) or len(entry) != 4:
                raise ValueError(f"sums[{i}] must be [key, g2, trace, weight], got {entry!r:.80}")
            key, values = _key_from_json(entry[0], f"sums[{i}]"), entry[1:]
            if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in values):
                raise TypeError(f"sums[{i}]: g2, trace and weight must be numbers, got {values!r:.80}")
            if not 0.0 < values[2] <= 1.0:
                raise ValueError(f"sums[{i}]: a weight is in (0, 1], got {values[2]!r}")
            if key in sums:
                raise ValueError(f"sums[{i}]: the key {key!r} twice")
            sums[key] = (float(values[0]), float(values[1]), float(values[2]))
        return sums


def _key_to_json(key: Hashable) -> Any:
    if isinstance(key, tuple):
        return [_key_to_json(k) for k in key]
    if key is None or isinstance(key, (str, int, float)):
        return key
    raise TypeError(f"a NoiseScaleEMA key of type {type(key).__name__} cannot be saved (JSON holds str, int, "
                    "float, bool, None and tuples of them)")


def _key_from_json(key: Any, where: str) -> Hashable:
    if isinstance(key, list):
        return tuple(_key_from_json(k, where) for k in key)
    if key is None or isinstance(key, (str, int, float)):
        return key
    raise TypeError(f"{where}: a key is a str, int, float, bool, None or a list of them, got {key!r:.80}")
