"""Bias of every sharded strategy's ``rounding="sr"`` sum through its exchange, on the host backend:
one step of the real managers on inputs whose mean over the ranks falls where a round to nearest is
biased, and on noisy ones, measured in standard errors of the mean error over the elements of
several seeds (beyond about 3 the bias is measured, not chance).

Inputs (every rank writes the same value into every element at every micro-step, or its own noise):

- ``cross-tie``: 1.0078125 on every rank, M = 3: each node's SR sum is 3.015625 or 3.03125 and the
  mean of two that differ is a tie (issue 40's case for hierarchical's cross-node step);
- ``mean-tie``: ``1 + (r mod 2) 2^-7`` on rank r, M = 4: the mean over the ranks of each micro-step
  is a tie between 1 and 1 + 2^-7 (every bf16 reduce-scatter);
- ``base+noise``, ``iid``: tools/accuracy_bias.py's inputs, each rank its own noise, M = 16.

The block gradients get the input at every micro-step; the non-block ones at the last micro-step
only (their sum is then the exchange's alone). Per (strategy, world, ranks per node, input): the
block sum's relative L2 error, its bias over mean |sum| and in standard errors, the magnitude bias
in standard errors, and the non-block bias in standard errors.

    PYTHONPATH=. python3 tools/exchange_bias.py --json $OUT/exchange_bias.json
"""
from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _cli import Parser, int_at_least, output_help, output_path, run

import numpy as np
from accuracy_bias import bias_stats, synthetic

import lowgrad as lg

Value = Callable[[int, int], np.ndarray]  # (rank, micro-step) -> the float32 gradient of every element
#: input -> (micro-steps, the value of rank r at micro-step m given n elements and a seed)
INPUTS: dict[str, tuple[int, Callable[[int, int], Value]]] = {
    "cross-tie": (3, lambda n, seed: lambda r, m: np.full(n, 1.0078125, np.float32)),
    "mean-tie": (4, lambda n, seed: lambda r, m: np.full(n, 1.0 + (r % 2) * 2.0 ** -7, np.float32)),
    "base+noise": (16, lambda n, seed: lambda r, m: synthetic("base+noise", 16, n, seed, stream=r)(m)),
    "iid": (16, lambda n, seed: lambda r, m: synthetic("iid", 16, n, seed, stream=r)(m)),
}
#: (strategy, world, ranks per node or None): one node, one rank per node, several of several
RUNS = (("scatter_reduce", 2, None), ("scatter_reduce", 8, None), ("all_to_all", 2, None), ("all_to_all", 8, None),
        ("hierarchical", 2, 1), ("hierarchical", 8, 8), ("hierarchical", 8, 4), ("hierarchical", 8, 2),
        ("hierarchical", 16, 4))


def sums(strategy: str, world: int, micro: int, value: Value, n: int, seed: int, rounding: str = "sr",
         **options: Any) -> tuple[np.ndarray, np.ndarray]:
    """One step of ``micro`` micro-steps of the real ``strategy`` manager on ``world`` host ranks,
    ``value`` (as bf16) written into a block tensor and a non-block tensor of ``n`` elements each
    (the non-block one at the last micro-step only); every rank's block and non-block shards,
    joined (float64)."""
    layout = lg.Layout(block=[lg.ParamSpec("w", (n,))], non_block=[lg.ParamSpec("e", (n,))], num_layers=1)

    def fn(c: Any) -> tuple[np.ndarray, np.ndarray]:
        with lg.create_gradient_manager(layout, c, strategy=strategy, seed=seed, rounding=rounding, **options) as gm:
            s = c.device.stream()
            for m in range(micro):
                gm.start_micro_step(s, m, micro)
                v = value(c.rank, m)
                if m == micro - 1:
                    t, _ = gm.non_block_full("e", s)
                    t.numpy()[:] = v
                    gm.notify_non_block("e", s)
                dw, _ = gm.block_full(0, s)
                dw["w"].numpy()[:] = v
                gm.notify_block(0, s)
                gm.end_micro_step(s)
            block = gm.block_shard(0, s)["w"].numpy().astype(np.float64)
            return block, gm.non_block_shard("e", s).numpy().astype(np.float64)
    shards = lg.run_threads(world, fn)
    return np.concatenate([b for b, _ in shards]), np.concatenate([e for _, e in shards])


def exact(value: Value, world: int, micro: int) -> tuple[np.ndarray, np.ndarray]:
    """The float64 sums of the bf16 values the engines write: block (every micro-step), non-block
    (the last)."""
    def mean(m: int) -> np.ndarray:
        return np.mean([value(r, m).astype(lg.bf16.np).astype(np.float64) for r in range(world)], axis=0)
    block = mean(0)
    for m in range(1, micro):
        block = block + mean(m)
    return block, mean(micro - 1)


def measure(strategy: str, world: int, group_size: int | None, kind: str, n: int, seeds: Sequence[int],
            rounding: str = "sr") -> dict[str, Any]:
    """:func:`accuracy_bias.bias_stats` of the block sums and the non-block bias of one run, over
    ``seeds`` x ``n`` elements."""
    micro, make = INPUTS[kind]
    options = {} if group_size is None else {"group_size": group_size}
    got_b, got_e, ref_b, ref_e = [], [], [], []
    for seed in seeds:
        value = make(n, seed)
        block, nb = sums(strategy, world, micro, value, n, seed, rounding, **options)
        want_b, want_e = exact(value, world, micro)
        got_b.append(block)
        got_e.append(nb)
        ref_b.append(want_b)
        ref_e.append(want_e)
    block_stats = bias_stats(np.concatenate(got_b), np.concatenate(ref_b))
    nb_se = bias_stats(np.concatenate(got_e), np.concatenate(ref_e))["bias_se"]
    return {"strategy": strategy, "world": world, "group_size": group_size, "input": kind, "micro": micro,
            "n": block_stats["n"], "rounding": rounding, "block": block_stats, "non_block_bias_se": nb_se}


def table(rows: Sequence[dict[str, Any]]) -> str:
    out = ["| strategy | W | G | input | M | block rel. L2 | block bias (SE) | magnitude bias (SE) | "
           "non-block bias (SE) |", "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        b = r["block"]
        g = "" if r["group_size"] is None else r["group_size"]
        out.append(f"| {r['strategy']} | {r['world']} | {g} | {r['input']} | {r['micro']} | {b['rel_l2']:.1e} | "
                   f"{b['bias']:+.1e} ({b['bias_se']:+.1f}) | {b['magnitude_bias_se']:+.1f} | "
                   f"{r['non_block_bias_se']:+.1f} |")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    p = Parser("exchange_bias", description=__doc__.split("\n\n")[0] + " Runs on the CPU.")
    p.add_argument("--n", type=int_at_least(16), default=1 << 14, help="elements per tensor and seed")
    p.add_argument("--seeds", type=int_at_least(1), default=4, help="seeds per row")
    p.add_argument("--inputs", default=",".join(INPUTS), help=f"comma list of {', '.join(INPUTS)}")
    p.add_argument("--json", help=output_help("exchange_bias.json"))
    args = p.parse_args(argv)
    kinds = [k for k in args.inputs.split(",") if k]
    if any(k not in INPUTS for k in kinds):
        p.error(f"--inputs: one of {', '.join(INPUTS)}")
    if args.n % 16:
        p.error("--n must be a multiple of 16 (the worlds up to 16 shard it)")
    args.json = output_path("exchange_bias.json", args.json)
    t0 = time.perf_counter()
    rows = []
    for strategy, world, G in RUNS:
        for kind in kinds:
            rows.append(measure(strategy, world, G, kind, args.n, range(1, args.seeds + 1)))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    elapsed = time.perf_counter() - t0
    print(f"exchange_bias: {elapsed:.0f} s, {args.seeds} seeds x {args.n} elements per row")
    print(table(rows))
    with open(args.json, "w") as f:
        json.dump({"rows": rows, "args": vars(args), "seconds": elapsed, "date": time.strftime("%Y-%m-%d")}, f,
                  indent=1)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(run("exchange_bias", main))
