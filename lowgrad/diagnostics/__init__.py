"""Gradient diagnostics on host arrays: one step's statistics (:class:`StepStats`), the gradient
noise scale, where a step went non-finite, and the JSON-lines log of a run. Imports numpy, the
standard library and ``lowgrad.base`` only (docs/diagnostics.md)."""
from lowgrad.diagnostics.log import StepLog, read_log
from lowgrad.diagnostics.noise_scale import NoiseScale, NoiseScaleEMA
from lowgrad.diagnostics.nonfinite import NonFiniteReport
from lowgrad.diagnostics.report import Stats, StepStats, Summary, TensorSummary

__all__ = ["StepStats", "Stats", "Summary", "TensorSummary", "NoiseScale", "NoiseScaleEMA", "NonFiniteReport",
           "StepLog", "read_log"]
