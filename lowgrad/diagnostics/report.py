"""One step's gradient statistics on the host (:class:`StepStats`), and what is read from them:
per parameter, per layer, for the whole model, the noise scale and the first non-finite value.

What a manager hands over, every rank holding every rank's rows (gathered at the end of the step),
for T tensors in layout order (the non-block tensors, then layer 0's block tensors, layer 1's, ...):

- ``accumulated`` [W, T]: rank r's part of the accumulated gradient S at the end of the step (the
  parts of all ranks make the tensor), covering ``step_batch`` samples;
- ``micro`` [W, M, T] or None: rank r's part of the gradient the manager consumed at micro-step m
  (for the sharded strategies the reduced gradient's shard on rank r), covering ``micro_batch``
  samples; None where the strategy never sees a micro-step's reduced gradient (``all_to_all`` at
  world > 1; the unsharded one, whose engine accumulates);
- ``local`` [W, M, T] or [W, 1, T], or None: each rank's own full gradient before any exchange, of
  each micro-step (covering ``local_batch`` samples) or accumulated over the step (the unsharded
  strategy); world > 1 only (at world 1 there is no exchange).

Each is a :class:`Stats` triple: ``sumsq`` the sum of squares of all values (so NaN or inf when one
is), ``nonfinite`` the count of NaN and ±inf, ``maxabs`` the largest |x| of the finite values (0 for
none). Squared norms and counts add over tensors and shards, and maxima take the maximum. An entry
that was not measured (a manager does not see every tensor at every level: the engine accumulates
the non-block gradients itself) has ``nonfinite`` -1 and NaN in the other two; the noise scale
then uses only the tensors measured at both batch sizes.

Batch sizes are in samples, or any unit as long as they are in one: the micro-steps' batches add up
to the step's (``step_batch = micro_steps * micro_batch``) and so do the local ones
(``step_batch = world * local columns * local_batch``), since S is their mean
(lowgrad's managers average over ranks and sum over micro-steps).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from functools import cached_property
from typing import Any, TypeVar

import numpy as np
from numpy.typing import NDArray

from lowgrad.base.integers import integer
from lowgrad.diagnostics.noise_scale import NoiseScale, group_estimates
from lowgrad.diagnostics.nonfinite import NonFiniteReport, first_nonfinite

_T = TypeVar("_T")


def _unchecked(cls: type[_T], values: dict[str, Any]) -> _T:
    """An instance of the frozen dataclass ``cls`` with ``values`` as its fields, without
    ``__post_init__``'s checks (its constructor would run them)."""
    obj = object.__new__(cls)
    obj.__dict__.update(values)
    return obj


@dataclass(frozen=True)
class Stats:
    """Sum of squares, non-finite count and largest finite |x|: three arrays of one shape."""

    sumsq: NDArray[np.float64]
    nonfinite: NDArray[np.int64]
    maxabs: NDArray[np.float64]

    def __post_init__(self) -> None:
        for field, dtype in (("sumsq", np.float64), ("nonfinite", np.int64), ("maxabs", np.float64)):
            a = getattr(self, field)
            if not isinstance(a, np.ndarray) or a.dtype != dtype:
                got = a.dtype if isinstance(a, np.ndarray) else type(a).__name__
                raise TypeError(f"Stats.{field} must be a numpy array of {np.dtype(dtype)}, got {got}")
        if not self.sumsq.shape == self.nonfinite.shape == self.maxabs.shape:
            raise ValueError(f"Stats arrays differ in shape: sumsq {self.sumsq.shape}, "
                             f"nonfinite {self.nonfinite.shape}, maxabs {self.maxabs.shape}")
        measured = self.nonfinite >= 0
        if (self.sumsq < 0).any() or (self.nonfinite < -1).any():
            raise ValueError("Stats.sumsq cannot be negative, nor Stats.nonfinite below -1 (not measured)")
        if not (np.isnan(self.sumsq[~measured]).all() and np.isnan(self.maxabs[~measured]).all()):
            raise ValueError("an entry not measured (nonfinite -1) has NaN sumsq and maxabs")
        if not np.isfinite(self.maxabs[measured]).all() or (self.maxabs[measured] < 0).any():
            raise ValueError("Stats.maxabs is the largest |x| of the finite values: finite and not negative")

    @classmethod
    def _trusted(cls, sumsq: NDArray[np.float64], nonfinite: NDArray[np.int64], maxabs: NDArray[np.float64]) -> Stats:
        """Without the checks: for arrays that their maker built to fit (a manager's rows)."""
        return _unchecked(cls, {"sumsq": sumsq, "nonfinite": nonfinite, "maxabs": maxabs})

    def measured(self, lead: int) -> NDArray[np.bool_]:
        """Per column (the last axis): measured in every entry of the ``lead`` leading axes."""
        return np.asarray((self.nonfinite >= 0).all(axis=tuple(range(lead))))


@dataclass(frozen=True)
class TensorSummary:
    """One parameter's gradient in the step: ``norm``, ``nonfinite`` and ``maxabs`` of the
    accumulated gradient; ``micro_norms`` the norm of each micro-step's contribution (None
    without per-micro-step statistics)."""

    name: str
    layer: int
    norm: float
    nonfinite: int
    maxabs: float
    micro_norms: tuple[float, ...] | None


@dataclass(frozen=True)
class Summary:
    """A group of tensors (a layer, or all of them): the accumulated gradient's ``norm``,
    ``nonfinite`` and ``maxabs``; ``noise`` the noise scale from micro-steps against the step,
    ``noise_local`` the one from each rank's local gradient against the step (world > 1). Each
    is None where there is nothing to estimate from (one micro-step, no such statistics, a
    non-finite value)."""

    norm: float
    nonfinite: int
    maxabs: float
    noise: NoiseScale | None
    noise_local: NoiseScale | None


def _positive(what: str, value: object) -> int:
    n = integer(what, value)
    if n < 1:
        raise ValueError(f"{what} must be at least 1, got {n}")
    return n


def check_names(what: str, names: Any, count: int | None = None) -> tuple[str, ...]:
    """``names`` (parameter names, one per column) as a tuple: TypeError naming ``what`` unless a
    list or tuple of str (one string is not a sequence of names); ValueError unless they are
    distinct, non-empty, at least one and, given ``count``, ``count`` of them."""
    if isinstance(names, (str, bytes)) or not isinstance(names, Sequence):
        raise TypeError(f"{what} must be a list or tuple of parameter names (str), got {type(names).__name__} "
                        f"{names!r:.80}")
    out = tuple(names)
    for i, n in enumerate(out):
        if not isinstance(n, str):
            raise TypeError(f"{what}[{i}] must be a str (a parameter name), got {type(n).__name__} {n!r:.80}")
    want = "at least one" if count is None else f"{count}, one per column"
    if not out or not all(out) or len(set(out)) != len(out) or count is not None and len(out) != count:
        raise ValueError(f"{what} must be distinct non-empty strings, {want}; got {len(out)}")
    return out


@dataclass(frozen=True, kw_only=True)
class StepStats:
    """One step's statistics (the module's docstring says what each field holds); every field is
    checked on construction (TypeError or ValueError naming it). Built by a manager, or by hand
    from host arrays."""

    names: Sequence[str]  # kept as a tuple
    layers: Sequence[int]  # kept as a tuple
    accumulated: Stats
    micro: Stats | None
    local: Stats | None
    micro_batch: int
    local_batch: int
    step_batch: int
    step: int
    rank: int
    world: int
    micro_steps: int

    def __post_init__(self) -> None:
        names, layers = check_names("names", self.names), tuple(integer("a layer", x) for x in self.layers)
        if len(layers) != len(names):
            raise ValueError(f"{len(names)} names but {len(layers)} layers")
        if min(layers) < -1 or any(b < a for a, b in zip(layers, layers[1:])):
            raise ValueError("layers must be in layout order: -1 (non-block) first, then 0, 1, ... not decreasing")
        for field in ("micro_batch", "local_batch", "step_batch", "world", "micro_steps"):
            object.__setattr__(self, field, _positive(field, getattr(self, field)))
        step, rank = integer("step", self.step), integer("rank", self.rank)
        if step < 0 or not 0 <= rank < self.world:
            raise ValueError(f"step must be >= 0 and rank in [0, {self.world}), got step {step} and rank {rank}")
        object.__setattr__(self, "names", names)
        object.__setattr__(self, "layers", layers)
        object.__setattr__(self, "step", step)
        object.__setattr__(self, "rank", rank)
        W, M, T = self.world, self.micro_steps, len(names)
        self._check("accumulated", self.accumulated, {(W, T)})
        if self.micro is not None:
            self._check("micro", self.micro, {(W, M, T)})
            if self.step_batch != M * self.micro_batch:
                raise ValueError(f"step_batch {self.step_batch} is not micro_steps {M} x "
                                 f"micro_batch {self.micro_batch}")
        if self.local is not None:
            if W == 1:
                raise ValueError("local statistics are for world > 1 "
                                 "(at world 1 the micro-step gradient is the local one)")
            self._check("local", self.local, {(W, M, T), (W, 1, T)})
            if self.step_batch != W * self.local.sumsq.shape[1] * self.local_batch:
                raise ValueError(f"step_batch {self.step_batch} is not world {W} x {self.local.sumsq.shape[1]} "
                                 f"local column(s) x local_batch {self.local_batch}")

    @classmethod
    def _trusted(cls, **values: Any) -> StepStats:
        """Without the checks: for fields that their maker built to fit (a manager's rows; names
        and layers as tuples). Its checks would cost more than everything read from it after."""
        assert values.keys() == _STEP_FIELDS, "every field, by name"
        return _unchecked(cls, values)

    @staticmethod
    def _check(what: str, stats: object, shapes: set[tuple[int, ...]]) -> None:
        if not isinstance(stats, Stats):
            raise TypeError(f"{what} must be a Stats, got {type(stats).__name__}")
        if stats.sumsq.shape not in shapes:
            raise ValueError(f"{what} has shape {stats.sumsq.shape}, expected {' or '.join(map(str, sorted(shapes)))}")

    # --- what is read from them ---------------------------------------------------------------

    def tensors(self) -> dict[str, TensorSummary]:
        """Each parameter's summary, by name, in layout order."""
        acc = self.accumulated
        norms = np.sqrt(acc.sumsq.sum(axis=0))
        nonfinite, maxabs = acc.nonfinite.sum(axis=0), acc.maxabs.max(axis=0)
        micro = np.sqrt(self.micro.sumsq.sum(axis=0)) if self.micro is not None else None  # [M, T]
        return {name: TensorSummary(name, self.layers[t], float(norms[t]), int(nonfinite[t]), float(maxabs[t]),
                                    None if micro is None else tuple(float(x) for x in micro[:, t]))
                for t, name in enumerate(self.names)}

    def layer_summaries(self) -> dict[int, Summary]:
        """Each layer's summary (-1: the non-block tensors), in layout order."""
        starts = self._layer_starts
        return dict(zip((self.layers[s] for s in starts), self._summaries(starts)))

    def summary(self) -> Summary:
        """The whole model's summary."""
        return self._summaries(np.zeros(1, np.intp))[0]

    def first_nonfinite(self) -> NonFiniteReport | None:
        """Where the step first went non-finite (:mod:`lowgrad.diagnostics.nonfinite`), or None."""
        return first_nonfinite(self.step, self.names, self.layers, self.micro_steps,
                               None if self.local is None else self.local.nonfinite,
                               None if self.micro is None else self.micro.nonfinite, self.accumulated.nonfinite)

    @cached_property
    def _layer_starts(self) -> NDArray[np.intp]:
        """The first column of each layer (layers are in layout order)."""
        return np.flatnonzero(np.diff(self.layers, prepend=self.layers[0] - 1))

    def _summaries(self, starts: NDArray[np.intp]) -> list[Summary]:
        """The groups of tensors that begin at ``starts`` (ascending from 0; each ends where the
        next begins), each as one: sums over a group's columns in one ``reduceat`` per quantity."""
        acc = self.accumulated
        column = acc.sumsq.sum(axis=0)
        totals = np.add.reduceat(column, starts)
        nonfinite = np.add.reduceat(acc.nonfinite.sum(axis=0), starts)
        maxabs = np.maximum.reduceat(acc.maxabs.max(axis=0), starts)
        # micro: the M micro-steps' contributions summed over ranks (the reduced gradient's shards);
        # local: each rank's local gradient is its own small batch, no sum over ranks
        noise = self._noise(self.micro, True, self.micro_steps, self.micro_batch, column, starts)
        noise_local = self._noise(self.local, False, None, self.local_batch, column, starts)
        return [Summary(float(np.sqrt(t)), int(n), float(m), a, b)
                for t, n, m, a, b in zip(totals, nonfinite, maxabs, noise, noise_local)]

    def _noise(self, small: Stats | None, over_ranks: bool, summed: int | None, b_small: int,
               column: NDArray[np.float64], starts: NDArray[np.intp]) -> list[NoiseScale | None]:
        """Each group's estimate from the ``small`` batches against the step, over the tensors
        measured at both batch sizes (None for a group with none of them); ``summed``: the
        contributions that add up to the step (None: one per column of ``small``)."""
        if small is None:
            return [None] * len(starts)
        cols = np.flatnonzero(small.measured(2))
        if not cols.size:
            return [None] * len(starts)
        # where each group begins among the measured columns; the groups that have any
        first = np.searchsorted(cols, starts)
        has = np.diff(first, append=cols.size) > 0
        at = first[has]
        parts = small.sumsq[..., cols]  # [W, columns, measured tensors]
        if over_ranks:
            parts = parts.sum(axis=0, keepdims=True)
        contributions = np.add.reduceat(parts, at, axis=2).reshape(-1, at.size)
        n = small.sumsq.shape[1] if summed is None else summed
        estimates = iter(group_estimates(contributions, n, b_small, np.add.reduceat(column[cols], at),
                                         self.step_batch))
        return [next(estimates) if h else None for h in has.tolist()]


_STEP_FIELDS = frozenset(f.name for f in fields(StepStats))
