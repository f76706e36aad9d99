"""Micro-step time of every gradient-manager strategy against the bytes-moved floor.

A synthetic engine hands each layer's gradients to the manager exactly as a real one would (one
device-to-device copy per layer from a random bf16 pool, so the data is never zeros); the
manager does its exchange and SR accumulation on its own stream (at world 1 with device shards:
on the engine's stream, docs/protocol.md). For each strategy (world 1 on
one GPU, or the host backend with --backend host) it reports the median micro-step time (CUDA
events on the engine stream, micro-steps after the first), the host time to issue a micro-step,
the bytes the engine and manager must move, and the ratio floor/time where the floor is those
bytes at the device-to-device copy bandwidth measured in the same run (for offload: the shard
traffic at the pinned H2D + D2H bandwidth). Prints a table, writes JSON.

With ``--stats-rounds N`` it also measures what the gradient statistics (``stats=True``) cost:
N rounds of each selected strategy with statistics off and on, interleaved, and the micro-step
time's ratio on/off per round (median and spread).

With ``--share-gpu --world N`` every rank runs on the one GPU through the loopback communicator:
all ranks share one HBM, so the floor is the sum of all ranks' bytes at the copy bandwidth, and
the exchange is device traffic too (a reduce-scatter reads the layer once and writes its shard;
an all-to-all reads and writes (N-1)/N of the layer), counted in the floor.

    PYTHONPATH=. python3 tools/bench_manager.py --config Qwen2.5-1.5B --json $OUT/bench_manager.json
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any

# before any CUDA context: a hardware queue per rank's loopback stream (docs/loopback.md)
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _cli import Parser, check_world, load_layout, output_help, output_path, require_cuda, run

import numpy as np

import lowgrad as lg
from lowgrad.base.dtypes import byte
from lowgrad.buffers.memory import align_up
from lowgrad.buffers.tensor import span
from lowgrad.cli.bandwidth import copy_bandwidths
from lowgrad.managers import STRATEGIES

# the layout by backend: a 1.5B model loads an H200; on the CPU a tiny one finishes in seconds
DEFAULT_CONFIG = {"cuda": "Qwen2.5-1.5B", "host": "tiny"}

# (strategy, offload, inline) of every registered strategy: None is the manager's default (inline at
# world 1 with device shards), False the communication stream where the strategy could work inline,
# and offload where it offloads
RUNS = tuple(run for name, cls in STRATEGIES.items() for run in (
    (name, False, None), *(((name, False, False),) if cls.inline_refusal(1, False) is None else ()),
    *(((name, True, None),) if cls.offloads else ())))


def run_label(strategy: str, offload: bool, inline: bool | None) -> str:
    """``scatter_reduce``, ``scatter_reduce+offload``, ``scatter_reduce+comm_stream`` (inline=False)."""
    return strategy + ("+offload" if offload else "") + ("+comm_stream" if inline is False else "")


def bench(comm: Any, layout: lg.Layout, strategy: str, offload: bool, micro: int, steps: int,
          bw: dict[str, float], engine_writes: bool = True, shared: bool = False,
          inline: bool | None = None, stats: bool = False) -> dict[str, Any]:
    dev, world = comm.device, comm.world
    gm = lg.create_gradient_manager(layout, comm, strategy=strategy, offload=offload, seed=1, inline=inline,
                                    stats=stats)
    on_engine_stream = gm.inline
    stream = dev.stream()
    layer_bytes = max(sum(align_up(2 * s.numel) for s in layout.block),
                      max((2 * s.numel for s in layout.non_block), default=0))
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 1 << 16, layer_bytes // 2 + 8, dtype=np.uint16) & np.uint16(0xBFFF)  # finite, |x| < 2
    pool = lg.from_numpy(bits.view(np.uint8), dev, name="bench_pool")
    events = [dev.event(timing=True) for _ in range(micro + 1)]
    per_step, host_ms = [], []
    for _ in range(steps):
        t_host = 0.0
        for m in range(micro):
            h0 = time.perf_counter()
            events[m].record(stream)
            gm.start_micro_step(stream, m, micro)
            for s in layout.non_block:
                t, _ = gm.non_block_full(s.name, stream)
                if engine_writes:
                    lg.ops.copy(t.flat().bitcast(byte), pool.view(0, t.nbytes), stream)
                gm.notify_non_block(s.name, stream)
            for layer in reversed(range(layout.num_layers)):
                dw, _ = gm.block_full(layer, stream)
                if engine_writes:
                    dst = span(list(dw.tensors()), byte)
                    lg.ops.copy(dst, pool.view(0, dst.nbytes), stream)
                gm.notify_block(layer, stream)
            gm.end_micro_step(stream)
            t_host += time.perf_counter() - h0
        events[micro].record(stream)
        events[micro].synchronize()
        per_step.append([events[m].elapsed_ms(events[m + 1]) for m in range(micro)])
        host_ms.append(t_host * 1e3 / micro)
    last = per_step[-1]
    steady = statistics.median(last[1:-1] if micro > 2 else last)
    B = 2 * layout.block_numel * layout.num_layers
    NB = 2 * layout.non_block_numel
    engine = 2 * (B + NB) if engine_writes else 0
    # per micro-step after the first, as the strategy's model says (a strategy that keeps full
    # gradients exchanges only in a step's last micro-step, which the median leaves out)
    model = STRATEGIES[strategy].micro_step_bytes(B, world, first=False, offload=offload)
    shard_traffic = model.device
    if shared and world > 1:  # the loopback's exchange is HBM traffic of this GPU
        shard_traffic += model.exchange
    if offload:  # the shard's read and write cross PCIe (one each way); the own slice is on the device
        pcie = model.pcie
        floor_s = max((engine + shard_traffic - pcie) / bw["d2d"], pcie / (bw["h2d"] + bw["d2h"]))
    else:
        floor_s = (engine + shard_traffic) / bw["d2d"]
    if shared:
        floor_s *= world  # every rank's bytes go through the one GPU
    rep = gm.memory_report().as_dict()
    gm.close()
    pool.close()
    return {"label": run_label(strategy, offload, inline), "strategy": strategy, "offload": offload,
            "inline": on_engine_stream, "world": world, "engine_writes": engine_writes,
            "micro_ms": steady,
            "micro_ms_all": last, "host_ms_per_micro": statistics.median(host_ms[-1:]),
            "bytes_per_micro": engine + shard_traffic, "floor_ms": floor_s * 1e3, "ratio": floor_s * 1e3 / steady,
            "memory": rep}


def count(n: int) -> str:
    """``n`` to three significant figures in the unit that fits: 2.65M, 494M, 7.62B (the tiny
    layout's count is not 0.00B)."""
    for exponent, unit in ((9, "B"), (6, "M"), (3, "k")):
        text = f"{n / 10**exponent:.3g}"
        if float(text) >= 1:  # after rounding: 999 999 is 1M, not 1e+03k
            return text + unit
    return str(n)


def main(argv: list[str] | None = None) -> int:
    p = Parser("bench_manager", description=__doc__.split("\n\n")[0] + " The CUDA backend needs an NVIDIA GPU; "
               "--backend host runs on the CPU.")
    p.add_argument("--config", help="preset name or config.json (default: "
                   + ", ".join(f"{v} with --backend {k}" for k, v in DEFAULT_CONFIG.items()) + ")")
    p.add_argument("--backend", choices=("cuda", "host"), default="cuda")
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--micro-steps", type=int, default=6)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--strategies", default="all",
                   help="comma list of strategy[+offload|+comm_stream], or all")
    p.add_argument("--share-gpu", action="store_true",
                   help="all ranks on one GPU through the loopback communicator (floor: all ranks' bytes)")
    p.add_argument("--manager-only", action="store_true",
                   help="the engine writes nothing (gradients keep the pool's first values): the manager's "
                        "own exchange and SR traffic against its own floor")
    p.add_argument("--stats-rounds", type=int, default=0,
                   help="also measure stats=True: this many rounds of each strategy with statistics off and on")
    p.add_argument("--timeout", type=float, default=None, help="seconds any rank waits for another")
    p.add_argument("--json", help=output_help("bench_manager.json"))
    args = p.parse_args(argv)
    if args.world < 1 or args.micro_steps < 1 or args.steps < 1 or args.stats_rounds < 0:
        p.error("--world, --micro-steps and --steps must be at least 1, --stats-rounds at least 0")
    if args.share_gpu and args.backend != "cuda":
        p.error("--share-gpu runs the ranks on one GPU: it needs --backend cuda")
    args.config = args.config or DEFAULT_CONFIG[args.backend]
    layout = load_layout(args.config)
    check_world(layout, args.world)
    args.json = output_path("bench_manager.json", args.json)
    if args.backend == "cuda":
        require_cuda(1 if args.share_gpu else args.world,
                     host_hint="--backend host runs it on the CPU (the tiny layout by default)")
    dev = lg.Device(0) if args.backend == "cuda" else lg.HostDevice()
    bw = copy_bandwidths(dev, 1 << 31 if args.backend == "cuda" else 1 << 26)
    print(f"bench_manager: {args.config} ({count(layout.total_numel)} params, {layout.num_layers} layers), "
          f"world {args.world}{' on one GPU (loopback)' if args.share_gpu else ''}, {args.backend}; "
          f"copy {bw['d2d'] / 1e9:.0f} GB/s, pinned H2D {bw['h2d'] / 1e9:.1f} "
          f"+ D2H {bw['d2h'] / 1e9:.1f} GB/s")
    wanted = None if args.strategies == "all" else set(args.strategies.split(","))
    selected = [(st, off, inl) for st, off, inl in RUNS
                if (wanted is None or run_label(st, off, inl) in wanted)
                and not (inl is False and args.world > 1)]  # else the default's run

    def one(strategy: str, offload: bool, inline: bool | None, stats: bool) -> dict[str, Any]:
        return lg.run_threads(args.world, lambda c: bench(c, layout, strategy, offload, args.micro_steps, args.steps,
                                                           bw, not args.manager_only, args.share_gpu, inline, stats),
                              backend=args.backend, share_gpu=args.share_gpu, timeout=args.timeout)[0]
    results, stats_cost = [], []
    for strategy, offload, inline in selected:
        label = run_label(strategy, offload, inline)
        try:
            results.append(one(strategy, offload, inline, False))
            if args.stats_rounds:  # off and on interleaved, so drift between rounds hits both alike
                rounds = [(one(strategy, offload, inline, False)["micro_ms"],
                           one(strategy, offload, inline, True)["micro_ms"]) for _ in range(args.stats_rounds)]
                ratios = [on / off for off, on in rounds]
                stats_cost.append({"label": label, "rounds": rounds, "ratio_median": statistics.median(ratios),
                                   "ratio_min": min(ratios), "ratio_max": max(ratios)})
        except Exception as exc:  # noqa: BLE001 - report and continue with the next strategy
            print(f"{label}: FAILED {type(exc).__name__}: {exc}")
    print(f"{'strategy':<28}{'ms/micro':>10}{'floor ms':>10}{'ratio':>8}{'host ms':>9}{'GB/micro':>10}"
          f"{'device MiB':>12}{'pinned MiB':>12}")
    for r in results:
        label = r["label"]
        dev_mib = sum(r["memory"].get("device", {}).values()) / 2**20
        pin_mib = sum(r["memory"].get("pinned", {}).values()) / 2**20
        print(f"{label:<28}{r['micro_ms']:>10.3f}{r['floor_ms']:>10.3f}{r['ratio']:>8.3f}"
              f"{r['host_ms_per_micro']:>9.3f}{r['bytes_per_micro'] / 1e9:>10.2f}{dev_mib:>12.0f}{pin_mib:>12.0f}")
    print("target: scatter_reduce at world 1 >= 0.90 of the floor; +comm_stream: inline=False (the accumulation "
          "beside the engine's copies instead of after them)")
    if stats_cost:
        print(f"{'stats=True cost':<28}{'off ms':>10}{'on ms':>10}{'on/off':>8}{'min':>8}{'max':>8}  "
              f"({args.stats_rounds} rounds, median; target <= 1.01)")
        for c in stats_cost:
            off = statistics.median(r[0] for r in c["rounds"])
            on = statistics.median(r[1] for r in c["rounds"])
            print(f"{c['label']:<28}{off:>10.3f}{on:>10.3f}{c['ratio_median']:>8.4f}{c['ratio_min']:>8.4f}"
                  f"{c['ratio_max']:>8.4f}")
    with open(args.json, "w") as f:
        json.dump({"config": args.config, "world": args.world, "share_gpu": args.share_gpu, "ceilings": bw,
                   "results": results, "stats_cost": stats_cost,
                   "date": time.strftime("%Y-%m-%d"), "device": getattr(dev, "name", "host")}, f, indent=1)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(run("bench_manager", main))
