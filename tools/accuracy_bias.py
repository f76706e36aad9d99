"""Bias and error of every rounding mode: the accumulated sum of M micro-steps against its float64
value, with the bias in standard errors, on constant, slowly varying, noisy, iid and real gradients,
at world 1 (tools/accuracy.py's accumulation, the managers' roundings bit for bit) and world > 1 (the
real managers on the host backend).

Per (input, M, mode), over the n elements: the relative L2 error ``|err| / |sum|``; the bias, mean
``err`` over mean ``|sum|``, and the same mean in standard errors (``mean(err) / (std(err) /
sqrt(n))``: beyond about 3 the bias is measured, not chance); and the magnitude bias, the same with
``sign(sum) * err`` (growth > 0, shrinkage < 0: on inputs of both signs an odd bias cancels in the
plain mean but not here). A mode passes the 3-SE test where both are within 3 SE.

Inputs (every micro-step's increment is the gradient over M, as a manager scales it):

- ``const0.3``, ``const0.1234``: every element adds ``c / M``;
- ``drift``: a per-element base ``b_i ~ N(0, 1)`` that grows linearly, ``b_i (0.5 + m / M) / M``;
- ``base+noise``: ``(b_i + 0.1 N(0, 1)) / M`` (the issue's "per-element base + 0.1 noise");
- ``iid``: ``N(0, 1) / M``, a zero-mean random walk;
- ``real``: ``--grads g.npy`` (shape (micro_steps, n), e.g. the tiny Qwen2's from
  ``examples/train_transformer.py --save-grads``): disjoint runs of M micro-steps side by side.

Element counts: ``--budget`` element-micro-steps per (input, M), at most ``--max-n`` elements and at
least ``--min-n``. Without arguments a quick run (:data:`QUICK`, about 20 s on 2 cores: M 4, 64,
1024, at most 2**16 elements, world 2) that already shows LD-SR's bias on constants; ``--sweep``
is the measured sweep of docs/accuracy.md (:data:`SWEEP`: budget 2**25, 2**20 elements up to
M = 32, 2**15 at 1024, M 2 to 4096, world 2 and 4; minutes). The issue's table at 2**20 elements:
``--issue-table``; 2**20 at every M: ``--full`` (hours); both take the sweep's sizes. An option
given explicitly overrides either. Candidate roundings (``--candidates``) are schemes measured in
search of LD-SR's error without its bias, in numpy here only (docs/accuracy.md).

    python3 tools/accuracy_bias.py
    python3 tools/accuracy_bias.py --sweep --grads g.npy --json $OUT/bias.json --plot $OUT/bias.png
    python3 tools/accuracy_bias.py --issue-table --candidates
"""
from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _cli import (
    CannotRun,
    Parser,
    check_world,
    int_at_least,
    int_list,
    output_help,
    output_path,
    require_matplotlib,
    run,
)

import accuracy_world as aw
import numpy as np
from accuracy import BF16, MODES, accumulate, load_grads

from lowgrad.managers import STRATEGIES
from lowgrad.sr.philox import sr_noise
from lowgrad.sr.seedcounter import ld_shift
from lowgrad.sr.seeds import use_seed

Increments = Callable[[int], np.ndarray]  # micro-step m -> float32 (n,)
INPUTS = ("const0.3", "const0.1234", "drift", "base+noise", "iid")
ISSUE_TABLE = (("const0.3", 4), ("const0.3", 64), ("const0.3", 1024), ("const0.1234", 16), ("base+noise", 1024))
BF16_MODES = tuple(m for m in MODES if m not in ("fp32", "kahan"))
SE_LIMIT = 3.0
#: the sizes of a run without arguments (seconds) and of ``--sweep`` (docs/accuracy.md's tables);
#: an option given on the command line overrides them
QUICK = {"micro": [4, 64, 1024], "budget": 1 << 22, "min_n": 1 << 12, "max_n": 1 << 16, "worlds": [2],
         "world_micro": [4], "world_layers": 2}
SWEEP = {"micro": [2, 4, 16, 64, 256, 1024, 4096], "budget": 1 << 25, "min_n": 1 << 14, "max_n": 1 << 20,
         "worlds": [2, 4], "world_micro": [4, 64], "world_layers": 8}


# ---- statistics ---------------------------------------------------------------------------------
def bias_stats(result: np.ndarray, ref: np.ndarray) -> dict[str, float]:
    """Relative L2 error, bias (mean error / mean |ref|) and magnitude bias (mean of sign(ref) *
    error / mean |ref|), each bias also in standard errors of its mean over the elements."""
    err = np.asarray(result, np.float64).reshape(-1) - np.asarray(ref, np.float64).reshape(-1)
    ref = np.asarray(ref, np.float64).reshape(-1)
    scale, norm, n = float(np.abs(ref).mean()), float(np.linalg.norm(ref)), err.size
    if n < 2 or not scale or not np.isfinite(err).all():
        raise ValueError("bias_stats needs at least 2 finite errors and a non-zero reference")
    out = {"n": n, "rel_l2": float(np.linalg.norm(err)) / norm}
    for name, e in (("bias", err), ("magnitude_bias", np.sign(ref) * err)):
        mean, sd = float(e.mean()), float(e.std(ddof=1))
        out[name] = mean / scale
        out[f"{name}_se"] = mean / (sd / np.sqrt(n)) if sd else (0.0 if mean == 0 else float(np.copysign(np.inf, mean)))
    return out


def passes(stats: dict[str, float], limit: float = SE_LIMIT) -> bool:
    """Whether both biases are within ``limit`` standard errors."""
    return abs(stats["bias_se"]) <= limit and abs(stats["magnitude_bias_se"]) <= limit


# ---- inputs -------------------------------------------------------------------------------------
def synthetic(kind: str, micro: int, n: int, seed: int = 0, stream: int = 0) -> Increments:
    """Micro-step m's increment of input ``kind`` (:data:`INPUTS`) for ``n`` elements; the noise
    of ``stream`` (a rank's own), the base shared by every stream."""
    if kind.startswith("const"):
        c = np.full(n, np.float32(float(kind.removeprefix("const")) / micro))
        return lambda m: c
    base = np.random.default_rng([seed, 0]).standard_normal(n)
    if kind == "drift":
        return lambda m: (base * ((0.5 + m / micro) / micro)).astype(np.float32)
    if kind == "base+noise":
        return lambda m: ((base + 0.1 * np.random.default_rng([seed, 1, stream, m]).standard_normal(n)) / micro).astype(
            np.float32)
    if kind == "iid":
        return lambda m: (np.random.default_rng([seed, 1, stream, m]).standard_normal(n) / micro).astype(np.float32)
    raise ValueError(f"input must be one of {INPUTS}, got {kind!r}")


def real(grads: np.ndarray, micro: int, n_max: int) -> Increments:
    """Disjoint runs of ``micro`` consecutive micro-steps of ``grads`` (M_total, n) side by side,
    as many as fit in ``n_max`` elements (at least one)."""
    runs = max(1, min(grads.shape[0] // micro, n_max // grads.shape[1]))
    return lambda m: np.concatenate([grads[r * micro + m] for r in range(runs)])


def exact_sum(inc: Increments, micro: int) -> np.ndarray:
    ref = inc(0).astype(np.float64)
    for m in range(1, micro):
        ref += inc(m)
    return ref


# ---- candidate roundings (numpy only; not lowgrad modes) ------------------------------------------
def round_bits(s: np.ndarray, r: np.ndarray) -> np.ndarray:
    """Finite float32 ``s`` rounded to bf16 with 16-bit noise ``r`` (round_sr's rule), as float32."""
    return ((s.view(np.uint32) + r) & np.uint32(0xFFFF0000)).view(np.float32)


def _exponent(x: np.ndarray) -> np.ndarray:
    return (x.view(np.uint32) >> np.uint32(23)) & np.uint32(0xFF)


def candidate(inc: Increments, micro: int, n: int, scheme: str, seed: int = 1) -> np.ndarray:
    """The accumulator after ``micro`` micro-steps with candidate ``scheme`` (:data:`CANDIDATES`).
    Noise as the managers draw it: micro-step m's fresh noise is the Philox noise of the per-use
    seed of (step 0, m); LD-SR's is micro-step 0's plus ``ld_shift(m)``."""
    def noise(m: int) -> np.ndarray:
        return sr_noise(use_seed(seed, 0, m, 0, 0, 0), 0, n).astype(np.uint32)

    u0 = noise(0)
    # one bit per element and step from another Philox stream (the phase-1 seed): whether the
    # element's LD sequence is reflected (r -> 2**16 - 1 - r) this step
    flip = sr_noise(use_seed(seed, 0, 0, 0, 0, 1), 0, n) >= 1 << 15
    acc = np.zeros(n, np.float32)
    prev = u0
    for m in range(micro):
        s = acc + inc(m)
        ld = (u0 + np.uint32(ld_shift(m))) & np.uint32(0xFFFF)
        if scheme in ("ldsr_reflect", "ldsr_reflect_cross"):
            ld = np.where(flip, np.uint32(0xFFFF) - ld, ld)
        if scheme in ("ldsr_cross", "ldsr_reflect_cross"):  # fresh noise where the sum left the binade upwards
            r = np.where(_exponent(s) > _exponent(acc), noise(m), ld)
        elif scheme == "ldsr_reflect":
            r = ld
        elif scheme == "ldsr_dither":  # the LD noise plus fresh noise of half the range
            r = (ld + (noise(m) >> np.uint32(1)) + np.uint32(0xC000)) & np.uint32(0xFFFF)
        elif scheme == "antithetic":  # micro-steps in pairs: fresh r, then 2**16 - 1 - r
            prev = noise(m) if m % 2 == 0 else np.uint32(0xFFFF) - prev
            r = prev
        else:
            raise ValueError(f"scheme must be one of {CANDIDATES}, got {scheme!r}")
        acc = round_bits(s, r)
    return acc.astype(np.float64)


CANDIDATES = ("ldsr_cross", "ldsr_reflect", "ldsr_reflect_cross", "ldsr_dither", "antithetic")


# ---- world 1 and world > 1 ----------------------------------------------------------------------
def measure(inc: Increments, micro: int, n: int, modes: Sequence[str], seed: int = 1) -> dict[str, dict[str, float]]:
    """:func:`bias_stats` of every mode (accuracy.py's or a candidate) on one input."""
    ref = exact_sum(inc, micro)
    out = {}
    for mode in modes:
        t0 = time.perf_counter()
        got = candidate(inc, micro, n, mode, seed) if mode in CANDIDATES else accumulate(
            (inc(m) for m in range(micro)), mode, seed)
        out[mode] = {**bias_stats(got, ref), "seconds": time.perf_counter() - t0}
    return out


def measure_world(layout: Any, world: int, micro: int, kind: str, strategy: str, roundings: Sequence[str],
                  seed: int = 1) -> dict[str, dict[str, float]]:
    """The real ``strategy`` manager on ``world`` host ranks, one step of ``micro`` micro-steps of
    input ``kind`` as bf16 gradients (every rank the same base, its own noise), per rounding; the
    reference is the float64 sum over micro-steps of the mean over ranks. ``layout``: e.g.
    ``accuracy_world.make_layout("small", layers)``, sharded over ``world`` ranks."""
    n = layout.num_layers * layout.block_numel
    grads = np.empty((micro, world, n), BF16)
    for r in range(world):
        inc = synthetic(kind, micro, n, seed, stream=r)
        for m in range(micro):
            grads[m, r] = inc(m).astype(BF16)
    ref, _ = aw.reference(grads)
    return {rd: bias_stats(aw.run_manager(layout, strategy, grads, seed, rounding=rd), ref) for rd in roundings}


# ---- output -------------------------------------------------------------------------------------
def table(rows: Sequence[dict[str, Any]], modes: Sequence[str]) -> str:
    """Markdown: per row and mode, relative L2, bias (SE) and magnitude bias (SE); ``!`` marks a
    bias beyond 3 SE."""
    head = "| input | world | M | n | " + " | ".join(modes) + " |"
    lines = [head, "| --- | ---: | ---: | ---: |" + " --- |" * len(modes)]
    for r in rows:
        cells = []
        for mode in modes:
            s = r["modes"].get(mode)
            if s is None:
                cells.append("")
                continue
            flag = "" if passes(s) else " !"
            cells.append(f"{s['rel_l2']:.2e}, {s['bias']:+.1e} ({s['bias_se']:+.0f}), "
                         f"{s['magnitude_bias_se']:+.0f}{flag}")
        lines.append(f"| {r['input']} | {r['world']} | {r['micro']} | {r['n']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: Sequence[dict[str, Any]], modes: Sequence[str], path: str) -> None:
    """Relative L2 and bias in SE against M, one column per world-1 input."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    inputs = list(dict.fromkeys(r["input"] for r in rows if r["world"] == 1))
    fig, axes = plt.subplots(2, len(inputs), figsize=(3.2 * len(inputs), 6), squeeze=False)
    for j, name in enumerate(inputs):
        sel = sorted((r for r in rows if r["world"] == 1 and r["input"] == name), key=lambda r: r["micro"])
        for mode in modes:
            pts = [(r["micro"], r["modes"][mode]) for r in sel if mode in r["modes"]]
            if not pts:
                continue
            ms = [p[0] for p in pts]
            axes[0][j].loglog(ms, [p[1]["rel_l2"] for p in pts], marker="o", label=mode)
            axes[1][j].semilogx(ms, [p[1]["magnitude_bias_se"] for p in pts], marker="o", label=mode)
        axes[0][j].set_title(name)
        axes[1][j].axhspan(-SE_LIMIT, SE_LIMIT, color="0.9")
        axes[1][j].set_yscale("symlog", linthresh=3)
        axes[1][j].set_xlabel("micro-steps M")
    axes[0][0].set_ylabel("relative L2 error")
    axes[1][0].set_ylabel("magnitude bias (SE)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def elements(micro: int, budget: int, min_n: int, max_n: int) -> int:
    return max(min_n, min(max_n, budget // micro))


def cases(args: Any, grads: np.ndarray | None) -> Iterator[tuple[str, int, int, Increments]]:
    """(input, M, n, increments) of the world-1 rows."""
    if args.issue_table:
        for kind, micro in ISSUE_TABLE:
            yield kind, micro, args.max_n, synthetic(kind, micro, args.max_n)
        return
    for kind in args.inputs:
        for micro in args.micro:
            n = elements(micro, args.budget, args.min_n, args.max_n)
            yield kind, micro, n, synthetic(kind, micro, n)
    if grads is not None:
        for micro in (m for m in args.micro if m <= grads.shape[0]):
            inc = real(grads, micro, elements(micro, args.budget, args.min_n, args.max_n))
            yield "real", micro, inc(0).size, inc


def main(argv: Sequence[str] | None = None) -> int:
    p = Parser("accuracy_bias", description=__doc__.split("\n\n")[0] + " Runs on the CPU.")
    p.add_argument("--inputs", default=",".join(INPUTS), help=f"synthetic inputs (comma list of {', '.join(INPUTS)})")
    p.add_argument("--sweep", action="store_true", help="the measured sweep's sizes (docs/accuracy.md; minutes) "
                   "instead of the quick run's; the defaults below are quick / sweep")
    p.add_argument("--micro", type=int_list(2), help="micro-step counts (4,64,1024 / 2,4,16,64,256,1024,4096)")
    p.add_argument("--grads", help="real gradients: .npy (M_total, n) or .npz, as tools/accuracy.py reads them")
    p.add_argument("--budget", type=int_at_least(1), help="element-micro-steps per row (2**22 / 2**25)")
    p.add_argument("--min-n", type=int_at_least(2), help="at least this many elements per row (2**12 / 2**14)")
    p.add_argument("--max-n", type=int_at_least(2), help="at most this many elements per row (2**16 / 2**20)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--candidates", action="store_true", help=f"also the candidate schemes {', '.join(CANDIDATES)}")
    p.add_argument("--issue-table", action="store_true",
                   help="only issue 36's rows, at --max-n elements (the sweep's sizes)")
    p.add_argument("--full", action="store_true",
                   help="the heavy sweep: --max-n elements at every M (the sweep's sizes; hours on a CPU)")
    p.add_argument("--worlds", type=int_list(2), help="world sizes of the host-backend rows (2 / 2,4)")
    p.add_argument("--world-micro", type=int_list(2), help="micro-step counts of those rows (4 / 4,64)")
    p.add_argument("--world-layers", type=int_at_least(1), help="layers of the small Qwen2 layout there (2 / 8)")
    p.add_argument("--world-inputs", default="const0.3,base+noise")
    p.add_argument("--strategy", default="all_to_all", choices=[n for n, c in STRATEGIES.items() if c.rounds()],
                   help="a strategy that rounds (the rows compare its roundings)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", help=output_help("accuracy_bias.json"))
    p.add_argument("--plot", help="write the figure here (PNG; needs matplotlib)")
    args = p.parse_args(argv)
    sizes = SWEEP if args.sweep or args.full or args.issue_table else QUICK
    for key, value in sizes.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.inputs = [s for s in args.inputs.split(",") if s]
    args.world_inputs = [s for s in args.world_inputs.split(",") if s]
    for s in args.inputs + args.world_inputs:
        if s not in INPUTS:
            p.error(f"unknown input {s!r} (one of {', '.join(INPUTS)})")
    modes = [s for s in args.modes.split(",") if s]
    if any(m not in MODES for m in modes):
        p.error(f"--modes: one of {', '.join(MODES)}")
    if args.min_n > args.max_n:
        p.error("--min-n must not exceed --max-n")
    if args.full:
        args.min_n = args.max_n
    layout = aw.make_layout("small", args.world_layers)
    for world in [] if args.issue_table else args.worlds:
        check_world(layout, world, "--worlds: world")
    modes += list(CANDIDATES) if args.candidates else []
    if args.plot:
        require_matplotlib("--plot needs matplotlib")
        args.plot = output_path("accuracy_bias.png", args.plot)  # its folder exists, before the run
    grads = None
    if args.grads:
        try:
            grads = np.stack(load_grads(args.grads))
        except (OSError, ValueError, TypeError) as exc:
            raise CannotRun(f"--grads {args.grads}: {exc}") from None
    args.json = output_path("accuracy_bias.json", args.json)
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for kind, micro, n, inc in cases(args, grads):
        rows.append({"input": kind, "world": 1, "micro": micro, "n": n,
                     "modes": measure(inc, micro, n, modes, args.seed)})
        print(table(rows[-1:], modes).splitlines()[-1], flush=True)
    if not args.issue_table:
        world_modes = [m for m in BF16_MODES if m in modes]
        for world in args.worlds:
            for micro in args.world_micro:
                for kind in args.world_inputs:
                    st = measure_world(layout, world, micro, kind, args.strategy, world_modes, args.seed)
                    rows.append({"input": kind, "world": world, "micro": micro, "n": next(iter(st.values()))["n"],
                                 "strategy": args.strategy, "modes": st})
                    print(table(rows[-1:], modes).splitlines()[-1], flush=True)
    elapsed = time.perf_counter() - t0
    print(f"accuracy_bias: {elapsed:.0f} s; cells: relative L2, bias / mean |sum| (in SE), magnitude bias in SE; "
          f"'!' beyond {SE_LIMIT:g} SE")
    print(table(rows, modes))
    with open(args.json, "w") as f:
        json.dump({"rows": rows, "args": vars(args), "seconds": elapsed, "date": time.strftime("%Y-%m-%d")}, f,
                  indent=1)
    print(f"wrote {args.json}")
    if args.plot:
        plot(rows, modes, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(run("accuracy_bias", main))
