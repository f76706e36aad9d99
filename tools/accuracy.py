"""Accumulation modes against a float64 sum: how much error each way of summing M gradient
micro-steps into one buffer leaves, on synthetic gradients or on your own.

Modes (bytes per element of the accumulator):
- ``fp32``  (4): float32 adds, rounded to nearest;
- ``rn``    (2): bf16, each add rounded to nearest even (what ``grad += g`` does in bf16);
- ``sr``    (2): bf16, stochastic rounding with fresh noise per micro-step (lowgrad's SR: the
  noise of element i at micro-step m is the Philox noise of the per-use seed of (step 0, m));
- ``ldsr``  (2): bf16, low-discrepancy SR: the noise of micro-step m is ``(u_i + m * 40503) mod
  2**16``, ``u_i`` the noise of micro-step 0 — successive rounding errors of one element
  anti-correlated; one rounding is unbiased, the sum is not in general (tools/accuracy_bias.py);
- ``kahan`` (4): a bf16 sum plus a bf16 compensation term (Kahan), both rounded to nearest: the
  compensated scheme at bf16 precision, for the record — it takes as much memory as ``fp32``.

Every add is ``round(float32(acc) + float32(g))``, as lowgrad's SR kernels do it. Synthetic
gradients: per element a mean ``mu ~ N(0, 1)``, micro-step m adds ``mu + sigma * N(0, 1)``.
Your own: ``--grads FILE`` (``.npy`` of shape (M, n), or ``.npz`` whose arrays in name order
are the micro-steps), float32, float16 or bf16 values (bf16 saved through ml_dtypes reads back
as 2-byte raw values and is taken as bf16). The figure is the relative L2 error
``|acc - sum| / |sum|`` against the float64 sum, and the bias (mean signed error over the mean
absolute error, in %).

    python3 tools/accuracy.py [--sigma 0,1,10] [--micro 16,256,4096] [--n 4096] [--json out.json]
    python3 tools/accuracy.py --grads my_grads.npy
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _cli import CannotRun, Parser, float_list, int_list, output_help, output_path, run

import ml_dtypes
import numpy as np

from lowgrad.base.dtypes import bf16
from lowgrad.sr.reference import add_sr
from lowgrad.sr.seedcounter import COUNTER_DTYPE, NEXT_MICRO, ROUNDINGS, SET, apply_op, roundings

MODES = ("fp32", "rn", "sr", "ldsr", "kahan")
BYTES = {"fp32": 4, "rn": 2, "sr": 2, "ldsr": 2, "kahan": 4}
BF16 = ml_dtypes.bfloat16


def accumulate(increments: Iterable[np.ndarray], mode: str, seed: int = 1) -> np.ndarray:
    """The accumulator after adding every increment (float32 arrays of one size) in ``mode``:
    the bf16 modes round as a sharded manager with that ``rounding`` rounds layer 0's tensor 0
    in step 0 (lowgrad's host reference and seed counter, bit for bit)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "kahan":
        return kahan(increments)
    counter = np.zeros(1, COUNTER_DTYPE)
    acc: np.ndarray | None = None
    for m, g in enumerate(increments):
        g = np.asarray(g, dtype=np.float32).reshape(-1)
        if acc is None:
            acc = np.zeros(g.size, np.float32 if mode == "fp32" else BF16)
            apply_op(counter, SET, seed, 0, ROUNDINGS.get(mode, 0))
        elif mode != "fp32":
            apply_op(counter, NEXT_MICRO, 0, 0, 0)
        if g.size != acc.size:
            raise ValueError(f"micro-step {m} has {g.size} elements, micro-step 0 had {acc.size}")
        if mode == "fp32":
            acc = acc + g
        else:
            (rd,) = roundings(counter[0], 0, [0])
            acc = add_sr(acc, g, 1.0, rd.seed, 0, bf16, rd.shift, rd.nearest)
    if acc is None:
        raise ValueError("no micro-steps to accumulate")
    return acc.astype(np.float64)


def kahan(increments: Iterable[np.ndarray]) -> np.ndarray:
    """Kahan summation with a bf16 sum ``s`` and a bf16 compensation ``c`` (float32 arithmetic,
    each stored value rounded to nearest); the result ``s - c``."""
    s: np.ndarray | None = None
    c: np.ndarray | None = None
    for g in increments:
        g = np.asarray(g, dtype=np.float32).reshape(-1)
        if s is None or c is None:
            s, c = np.zeros(g.size, BF16), np.zeros(g.size, BF16)
        y = g - c.astype(np.float32)
        t = (s.astype(np.float32) + y).astype(BF16)
        c = ((t.astype(np.float32) - s.astype(np.float32)) - y).astype(BF16)
        s = t
    if s is None or c is None:
        raise ValueError("no micro-steps to accumulate")
    return s.astype(np.float64) - c.astype(np.float64)


def errors(increments: list[np.ndarray], seed: int = 1) -> dict[str, dict[str, float]]:
    """Relative L2 error and bias (%) of every mode against the float64 sum of ``increments``."""
    ref = np.zeros(np.asarray(increments[0]).size)
    for g in increments:
        ref += np.asarray(g, dtype=np.float32).reshape(-1).astype(np.float64)
    norm = float(np.linalg.norm(ref))
    if not np.isfinite(ref).all() or norm == 0:
        raise ValueError("the gradients must be finite and not all zero")
    out = {}
    for mode in MODES:
        err = accumulate(increments, mode, seed) - ref
        mean_abs = float(np.abs(err).mean())
        out[mode] = {"rel_l2": float(np.linalg.norm(err)) / norm,
                     "bias_pct": 100.0 * float(err.mean()) / mean_abs if mean_abs else 0.0}
    return out


def synthetic(sigma: float, micro: int, n: int, seed: int = 0) -> Iterator[np.ndarray]:
    rng = np.random.default_rng(seed)
    mu = rng.standard_normal(n)
    for _ in range(micro):
        yield (mu + sigma * rng.standard_normal(n)).astype(np.float32)


def load_grads(path: str) -> list[np.ndarray]:
    """The micro-steps of ``path``: an .npy of shape (M, ...) or an .npz (arrays in name order)."""
    if path.endswith(".npz"):
        with np.load(path) as z:
            arrays = [z[k] for k in sorted(z.files)]
    else:
        data = np.load(path)
        if data.ndim < 2:
            raise ValueError(f"{path}: an .npy of gradients must have shape (micro_steps, ...), got {data.shape}")
        arrays = list(data)
    if not arrays:
        raise ValueError(f"{path}: no micro-steps")
    out = []
    for i, a in enumerate(arrays):
        if a.dtype.kind == "V" and a.dtype.itemsize == 2:  # bf16 saved by ml_dtypes reads back as raw 2 bytes
            a = a.view(BF16)
        if a.dtype not in (np.float32, np.float64, np.float16, BF16):
            raise TypeError(f"{path}: micro-step {i} is {a.dtype}, expected floating point")
        out.append(a.astype(np.float32).reshape(-1))
    return out


def main(argv: list[str] | None = None) -> int:
    p = Parser("accuracy", description=__doc__.split("\n\n")[0] + " Runs on the CPU (numpy).")
    p.add_argument("--grads", help=".npy (M, n) or .npz of your gradients, one array per micro-step")
    p.add_argument("--sigma", default="0,1,10", help="synthetic: noise scales (comma list)")
    p.add_argument("--micro", default=None,
                   help="micro-step counts (comma list; synthetic default 16,256,4096); with --grads, the first M "
                        "micro-steps of the file (default: all of them)")
    p.add_argument("--n", type=int, default=4096, help="synthetic: elements")
    p.add_argument("--seed", type=int, default=1, help="base seed of the SR noise")
    p.add_argument("--json", help=output_help("accuracy.json"))
    args = p.parse_args(argv)
    try:
        sigmas, micros = float_list(args.sigma), int_list(1)(args.micro) if args.micro else None
    except argparse.ArgumentTypeError as exc:
        p.error(f"--sigma/--micro: {exc}")
    if args.n < 1:
        p.error("--n must be at least 1")
    args.json = output_path("accuracy.json", args.json)
    t0 = time.monotonic()
    rows: list[dict[str, Any]] = []
    if args.grads:
        try:
            grads = load_grads(args.grads)
            counts = [m for m in micros if m <= len(grads)] if micros else [len(grads)]
            for micro in counts or [len(grads)]:
                rows.append({"source": os.path.basename(args.grads), "micro": micro, "n": grads[0].size,
                             **errors(grads[:micro], args.seed)})
        except (OSError, ValueError, TypeError) as exc:  # missing, unreadable, not gradients, not finite
            raise CannotRun(f"--grads {args.grads}: {exc}") from None
    else:
        for sigma in sigmas:
            for micro in micros or [16, 256, 4096]:
                rows.append({"source": f"synthetic sigma={sigma:g}", "sigma": sigma, "micro": micro, "n": args.n,
                             **errors(list(synthetic(sigma, micro, args.n)), args.seed)})
    print(f"accuracy: relative L2 error against a float64 sum (bias: mean error / mean |error|, %); "
          f"bytes per element: {', '.join(f'{m} {BYTES[m]}' for m in MODES)}")
    print(f"{'source':<28}{'M':>6}" + "".join(f"{m:>18}" for m in MODES))
    for r in rows:
        print(f"{r['source']:<28}{r['micro']:>6}"
              + "".join(f"{r[m]['rel_l2']:>10.2e} ({r[m]['bias_pct']:+4.0f}%)" for m in MODES))
    with open(args.json, "w") as f:
        json.dump({"rows": rows, "args": vars(args), "seconds": time.monotonic() - t0,
                   "date": time.strftime("%Y-%m-%d")}, f, indent=1)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(run("accuracy", main))
