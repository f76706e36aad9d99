"""What ``lowgrad demo`` prints: one row per strategy, the legend of its columns, and the
PASS/FAIL verdict with its criteria."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BIAS_SIGMAS = 5.0  # |bias| may reach this many standard errors of the mean ...
BIAS_FLOOR = 0.05  # ... or this many ulps, whichever is larger

LEGEND = """\
columns (rank 0 unless said otherwise):
  device MiB, pinned MiB  memory the manager holds, by kind (by name below)
  ms/micro                wall time per micro-step of the last step, slowest rank
  floor ratio             time the step's bytes take at the measured copy bandwidth, over
                          ms/micro (1 = at the copy floor; NCCL traffic not counted)
  max ulps, mean ulps     |shard - float64 reference| over every element of every rank, in
                          bf16 ulps at the largest magnitude the element's sums reach
  bias ulps               mean signed error: about 0 for SR (its sum is unbiased); for LD-SR,
                          the default, a few percent of its error on gradients that vary between
                          micro-steps, up to a third on constant ones (docs/accuracy.md, "Bias")"""


@dataclass
class Result:
    """One strategy's run: times in ms, errors in bf16 ulps, memory in bytes by kind and name."""

    strategy: str
    offload: bool
    world: int
    ms_per_micro: float
    floor_ratio: float
    max_ulps: float
    mean_ulps: float
    bias_ulps: float
    bias_se_ulps: float  # standard error of bias_ulps (std of the errors / sqrt(count))
    memory: dict[str, dict[str, int]]

    @property
    def label(self) -> str:
        return f"{self.strategy}{'+offload' if self.offload else ''}"


def error_stats(errors: np.ndarray) -> dict[str, float]:
    """max |e|, mean |e|, mean e and its standard error, of signed errors ``errors`` (ulps)."""
    return {"max_ulps": float(np.max(np.abs(errors))), "mean_ulps": float(np.mean(np.abs(errors))),
            "bias_ulps": float(np.mean(errors)), "bias_se_ulps": float(np.std(errors) / np.sqrt(errors.size))}


def max_ulps_bound(micro_steps: int) -> int:
    """The largest error a PASS allows: every element is rounded about once per micro-step plus
    once by the cross-rank reduction, and one stochastic rounding moves it by less than 1 ulp."""
    return micro_steps + 1


def failures(r: Result, micro_steps: int) -> list[str]:
    """Why ``r`` fails the verdict (empty when it passes)."""
    out = []
    if not r.max_ulps <= max_ulps_bound(micro_steps):
        out.append(f"max error {r.max_ulps:.2f} ulps > {max_ulps_bound(micro_steps)}")
    limit = max(BIAS_FLOOR, BIAS_SIGMAS * r.bias_se_ulps)
    if not abs(r.bias_ulps) <= limit:
        out.append(f"|bias| {abs(r.bias_ulps):.4f} ulps > {limit:.4f}")
    return out


def verdict(results: list[Result], micro_steps: int) -> tuple[bool, str]:
    """(passed, the verdict line naming the criteria or every failure)."""
    bad = [f"{r.label}: {'; '.join(why)}" for r in results if (why := failures(r, micro_steps))]
    criteria = (f"max error <= {max_ulps_bound(micro_steps)} ulps (micro-steps + 1) and |bias| <= "
                f"max({BIAS_FLOOR} ulps, {BIAS_SIGMAS:g} standard errors)")
    if bad:
        return False, f"verdict: FAIL ({criteria}): " + "; ".join(bad)
    return True, f"verdict: PASS: every strategy within the SR bound ({criteria})"


def print_results(results: list[Result], micro_steps: int) -> bool:
    """Print the table, the memory by name, the legend and the verdict; True on PASS."""
    print(f"{'strategy':<16}{'offload':>8}{'device MiB':>12}{'pinned MiB':>12}{'ms/micro':>10}"
          f"{'floor ratio':>12}{'max ulps':>10}{'mean ulps':>10}{'bias ulps':>11}")
    for r in results:
        dev = sum(r.memory.get("device", {}).values()) / 2**20
        pin = sum(r.memory.get("pinned", {}).values()) / 2**20
        print(f"{r.strategy:<16}{'yes' if r.offload else 'no':>8}{dev:>12.1f}{pin:>12.1f}{r.ms_per_micro:>10.3f}"
              f"{r.floor_ratio:>12.3g}{r.max_ulps:>10.2f}{r.mean_ulps:>10.3f}{r.bias_ulps:>+11.4f}")
    print("memory by name (rank 0, MiB):")
    for r in results:
        parts = ", ".join(f"{name}[{kind}] {n / 2**20:.1f}" for kind, d in r.memory.items() for name, n in d.items()
                          if not name.startswith("demo"))
        print(f"  {r.label}: {parts}")
    print(LEGEND)
    passed, line = verdict(results, micro_steps)
    print(line)
    return passed
