"""A gradient-accumulation micro-step captured in a CUDA graph against the same micro-step run
eagerly: host time per replay and per replayed kernel, GPU time per micro-step, and a bit-for-bit
comparison of the shards.

The engine writes each gradient with one kernel (``ops.add_sr`` of two bf16 pools, so every layer
is a kernel the graph replays); the manager (default scatter_reduce, world 1) accumulates with
its per-layer multi-tensor SR kernel. Micro-step 0 of step 0 runs eagerly (warm-up), then one
graph per micro-step kind (first, middle, last) is captured and replayed for the remaining steps,
while a second manager with the same seed runs the same steps eagerly. Prints a table, writes JSON.

    PYTHONPATH=. python3 tools/bench_graph.py --config Qwen2.5-1.5B --json $OUT/bench_graph.json
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _cli import Parser, load_layout, output_help, output_path, require_cuda, run

import numpy as np

import lowgrad as lg
from lowgrad.buffers.tensor import Tensor, span
from lowgrad.managers import STRATEGIES


def micro_step(gm: Any, layout: lg.Layout, pools: tuple[Tensor, ...], stream: Any, m: int, M: int) -> None:
    gm.start_micro_step(stream, m, M)
    for s in layout.non_block:
        t, _ = gm.non_block_full(s.name, stream)
        lg.ops.add_sr(t.flat(), pools[0].view(0, t.numel), pools[1].view(0, t.numel), 0.5, 1, 0, stream)
        gm.notify_non_block(s.name, stream)
    for layer in reversed(range(layout.num_layers)):
        dw, _ = gm.block_full(layer, stream)
        d = span(list(dw.tensors()), lg.bf16)
        lg.ops.add_sr(d, pools[0].view(0, d.numel), pools[1].view(0, d.numel), 0.5, 2 + layer, 0, stream)
        gm.notify_block(layer, stream)
    gm.end_micro_step(stream)


def main(argv: list[str] | None = None) -> int:
    p = Parser("bench_graph", description=__doc__.split("\n\n")[0] + " Needs an NVIDIA GPU.")
    p.add_argument("--config", default="Qwen2.5-1.5B")
    p.add_argument("--strategy", choices=tuple(STRATEGIES), default="scatter_reduce")
    p.add_argument("--micro-steps", type=int, default=4, help="at least 3 (first, middle and last graphs)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--json", help=output_help("bench_graph.json"))
    args = p.parse_args(argv)
    if args.micro_steps < 3 or args.steps < 1:
        p.error("--micro-steps must be >= 3 (first, middle and last graphs) and --steps >= 1")
    layout, M = load_layout(args.config), args.micro_steps
    args.json = output_path("bench_graph.json", args.json)
    require_cuda()

    def job(comm: Any) -> dict[str, Any]:
        dev = comm.device
        s = dev.stream()
        n = max(sum(sp.numel for sp in layout.block) + 128 * len(layout.block),
                max((sp.numel for sp in layout.non_block), default=0))
        rng = np.random.default_rng(0)
        pools = tuple(lg.from_numpy((rng.integers(0, 1 << 16, n, dtype=np.uint16) & np.uint16(0xBFFF)).view(
            lg.bf16.np), dev, name="bench_pool") for _ in range(2))
        eager, graphed = (lg.create_gradient_manager(layout, comm, strategy=args.strategy, seed=5) for _ in range(2))
        for gm in (eager, graphed):
            for m in range(M):
                micro_step(gm, layout, pools, s, m, M)
        dev.synchronize()
        graphs = {}
        for m in (0, 1, M - 1):
            g = lg.Graph(dev)
            with g.capture(s):
                micro_step(graphed, layout, pools, s, m, M)
            graphs[m] = g
        evs = [dev.event(timing=True) for _ in range(M + 1)]
        timing: dict[str, list[float]] = {"eager_host": [], "replay_host": [], "eager_gpu": [], "replay_gpu": []}
        for _ in range(args.steps):
            for name, gm in (("eager", eager), ("replay", graphed)):
                dev.synchronize()
                for m in range(M):
                    evs[m].record(s)
                    t0 = time.perf_counter()
                    if name == "eager":
                        micro_step(gm, layout, pools, s, m, M)
                    else:
                        graphs[0 if m == 0 else (M - 1 if m == M - 1 else 1)].replay(s)
                    timing[f"{name}_host"].append(time.perf_counter() - t0)
                evs[M].record(s)
                evs[M].synchronize()
                timing[f"{name}_gpu"] += [evs[m].elapsed_ms(evs[m + 1]) for m in range(M)]
        shards_a, shards_b = eager.shards(), graphed.shards()
        s.synchronize()
        identical = all(np.array_equal(a.numpy().view(np.uint8), b.numpy().view(np.uint8))
                        for a, b in zip(shards_a, shards_b))
        mid = graphs[1]
        med = {k: statistics.median(v) for k, v in timing.items()}
        return {"identical": identical, "steps": [eager.step, graphed.step], "kernel_nodes": mid.kernel_nodes,
                "nodes": mid.nodes, "median": med,
                "replay_host_us_per_kernel": med["replay_host"] * 1e6 / mid.kernel_nodes,
                "eager_host_us_per_kernel": med["eager_host"] * 1e6 / mid.kernel_nodes}

    (r,) = lg.run_threads(1, job, backend="cuda")
    med = r["median"]
    print(f"bench_graph: {args.config}, {args.strategy}, world 1, {M} micro-steps x {args.steps} steps; middle "
          f"micro-step graph: {r['nodes']} nodes, {r['kernel_nodes']} kernels")
    print(f"{'path':<10}{'host us/micro':>15}{'host us/kernel':>16}{'GPU ms/micro':>14}")
    for name in ("eager", "replay"):
        print(f"{name:<10}{med[name + '_host'] * 1e6:>15.1f}{r[name + '_host_us_per_kernel']:>16.2f}"
              f"{med[name + '_gpu']:>14.3f}")
    print(f"shards bit-identical: {r['identical']}; steps {r['steps']}; target: replay host time per kernel <= 1 us")
    with open(args.json, "w") as f:
        json.dump({"config": args.config, "strategy": args.strategy, "micro_steps": M, **r,
                   "date": time.strftime("%Y-%m-%d"), "device": lg.Device(0).name}, f, indent=1)
    print(f"wrote {args.json}")
    return 0 if r["identical"] else 1


if __name__ == "__main__":
    sys.exit(run("bench_graph", main))
