"""What an 8-bit cross-node hop costs and saves in ``hierarchical``: its bias and error on real
gradients against the bf16 hop, and its modelled time. Issue 40's study emulates several schemes in
numpy on the CPU; ``--lowgrad`` also measures the one lowgrad built (``cross_node_bits=8``: int8, SR,
a scale per 128 elements) through its hierarchical manager on the host backend.

The hop: at the last micro-step each node's accumulated sums (bf16) cross the nodes and are summed
in float32 on the receiver, rounded once with SR (``rounding="sr"``). Emulated here with ``N``
nodes of ``G`` ranks and ``M`` micro-steps, rank r's micro-step m the real gradient of micro-batch
``r*M + m`` (``--grads``: ``(micro_steps, n)`` float32, e.g. the tiny Qwen2's from
``examples/train_transformer.py --save-grads``); each node's accumulator is its exact sum rounded
once to bf16 with SR, as the node's accumulation leaves it, unbiased. Then the other nodes' pieces
reach the receiver as:

- ``bf16``: as they are (today's hop, 2 bytes an element);
- ``int8-sr`` / ``int8-rn``: int8 with one float32 scale per block of ``--block`` elements
  (``amax / 127``), rounded stochastically / to nearest (ZeRO++'s qgZ rounds to nearest);
- ``e4m3-sr`` / ``e4m3-rn``, ``e5m2-sr`` / ``e5m2-rn``: fp8 with a power-of-two scale per block
  that brings the block's largest magnitude to the format's largest finite value;

the receiver adds its own piece (bf16, it never leaves) and the others, dequantised, in float32
and rounds once to bf16 with SR, times 1/W. Per scheme, against the float64 mean: relative L2
error, bias over mean |sum| and in standard errors, magnitude bias in standard errors
(tools/accuracy_bias.py's statistics), over ``--seeds`` repetitions of the noise; and the
hierarchical strategy's last micro-step per layer and exposed time per step from
tools/predict_scaling.py with the cross-node bytes of each width (``--inter-node-gbps-per-node``).

    python3 examples/train_transformer.py --size tiny --save-grads g.npy --micro-steps 128 --batch 4 --seq 64 \\
        --save-elems 65536
    PYTHONPATH=. python3 tools/compressed_hop.py --grads g.npy --json $OUT/compressed_hop.json
"""
from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _cli import CannotRun, Parser, int_at_least, output_help, output_path, run

import ml_dtypes
import numpy as np
from accuracy import load_grads
from accuracy_bias import bias_stats

SCHEMES = ("bf16", "int8-sr", "int8-rn", "e4m3-sr", "e4m3-rn", "e5m2-sr", "e5m2-rn")
FP8 = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}


def _grid(dtype: Any) -> np.ndarray:
    """Every finite value of a 1-byte float type, ascending (float64), one zero."""
    vals = np.arange(256, dtype=np.uint8).view(dtype).astype(np.float64)
    return np.unique(vals[np.isfinite(vals)])


GRIDS = {name: _grid(t) for name, t in FP8.items()}


def round_to(x: np.ndarray, grid: np.ndarray, rng: np.random.Generator | None) -> np.ndarray:
    """``x`` (within the grid's range) on ``grid``: to nearest (ties to the lower neighbour), or
    stochastically, up with probability (x - lo) / (hi - lo), where ``rng`` is given."""
    hi_i = np.clip(np.searchsorted(grid, x, side="left"), 1, grid.size - 1)
    lo, hi = grid[hi_i - 1], grid[hi_i]
    on = x >= hi
    frac = np.where(on, 1.0, (x - lo) / (hi - lo))
    up = frac > (rng.random(x.shape) if rng is not None else 0.5)
    return np.where(up, hi, lo)


def bf16_sr(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """float32 ``x`` to bf16 with SR (16 random low bits added, then truncated), as float64."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    noisy = (bits + rng.integers(0, 1 << 16, bits.shape, dtype=np.uint64)) & np.uint64(0xFFFF0000)
    return noisy.astype(np.uint32).view(np.float32).astype(np.float64)


def quantize(piece: np.ndarray, scheme: str, block: int, rng: np.random.Generator) -> np.ndarray:
    """What the receiver reads of ``piece`` (float64 values of bf16) after ``scheme``'s hop."""
    if scheme == "bf16":
        return piece
    kind, how = scheme.split("-")
    noise = rng if how == "sr" else None
    blocks = piece.reshape(-1, block)
    amax = np.abs(blocks).max(axis=1, keepdims=True)
    if kind == "int8":
        scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32).astype(np.float64)
        q = round_to(blocks / scale, np.arange(-127.0, 128.0), noise)
    else:
        grid = GRIDS[kind]
        scale = np.exp2(np.ceil(np.log2(np.where(amax > 0, amax, 1.0) / grid[-1])))  # exact, amax within range
        q = round_to(blocks / scale, grid, noise)
    return (q * scale).reshape(piece.shape)


def hop(grads: np.ndarray, nodes: int, per_node: int, micro: int, scheme: str, block: int,
        rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """The step's mean after the cross-node hop and its float64 value, over every element of
    ``grads``; each node in turn is the receiver of a share of the elements (as rank ``n*G + g``
    holds piece ``n``)."""
    W = nodes * per_node
    sums = np.stack([grads[n * per_node * micro:(n + 1) * per_node * micro].astype(np.float64).sum(axis=0)
                     for n in range(nodes)])
    exact = sums.sum(axis=0) / W
    acc = bf16_sr(sums.astype(np.float32), rng)  # each node's accumulator
    share = np.array_split(np.arange(grads.shape[1]), nodes)
    out = np.empty(grads.shape[1])
    for n, idx in enumerate(share):  # node n receives the others' pieces of its share
        total = acc[n, idx].astype(np.float32)
        for k in range(nodes):
            if k != n:
                total = total + quantize(acc[k, idx], scheme, block, rng).astype(np.float32)
        out[idx] = bf16_sr(total, rng) / W
    return out, exact


def measure(grads: np.ndarray, nodes: int, per_node: int, micro: int, block: int, seeds: int,
            schemes: Sequence[str] = SCHEMES) -> dict[str, dict[str, float]]:
    """:func:`accuracy_bias.bias_stats` of every scheme over ``seeds`` repetitions of the noise."""
    out = {}
    for scheme in schemes:
        got, ref = [], []
        for seed in range(seeds):
            rng = np.random.default_rng([seed, SCHEMES.index(scheme)])
            g, e = hop(grads, nodes, per_node, micro, scheme, block, rng)
            got.append(g)
            ref.append(e)
        out[scheme] = bias_stats(np.concatenate(got), np.concatenate(ref))
    return out


def measure_lowgrad(grads: np.ndarray, nodes: int, per_node: int, micro: int,
                    seeds: int) -> dict[str, dict[str, float]]:
    """The same measurement through lowgrad itself: ``hierarchical`` (``rounding="sr"``) on the host
    backend, one block tensor of the sampled elements, rank r's micro-step m writing micro-batch
    ``r*micro + m`` (its bf16 value), with the hop in bf16 (``cross_node_bits=16``) and in int8
    (``cross_node_bits=8``, the built kernels' definition); each seed a manager seed."""
    import lowgrad as lg
    W, n = nodes * per_node, grads.shape[1]
    g16 = grads[:W * micro].astype(lg.bf16.np).astype(np.float32)
    exact = g16.astype(np.float64).sum(axis=0) / W
    layout = lg.Layout(block=[lg.ParamSpec("g", (n,))], non_block=[], num_layers=1)
    out = {}
    for bits in (16, 8):
        got = []
        for seed in range(seeds):
            def job(c: Any, seed: int = seed, bits: int = bits) -> np.ndarray:
                dev, stream = c.device, c.device.stream()
                src = dev.alloc((n,), lg.fp32, kind="pinned", name="engine_scratch")
                with lg.create_gradient_manager(layout, c, strategy="hierarchical", group_size=per_node, seed=seed,
                                                rounding="sr", cross_node_bits=bits) as gm:
                    for m in range(micro):
                        gm.start_micro_step(stream, m, micro)
                        dw, _ = gm.block_full(0, stream)
                        src.numpy()[:] = g16[c.rank * micro + m]
                        lg.ops.add_sr(dw["g"], src, src, 0.5, seed=1, stream=stream)  # exact: bf16 values
                        gm.notify_block(0, stream)
                        gm.end_micro_step(stream)
                    shard = gm.block_shard(0, stream)["g"]
                    stream.synchronize()
                    return shard.numpy().astype(np.float64).copy()
            got.append(np.concatenate(lg.run_threads(W, job)))
        out[f"lowgrad {'int8 (cross_node_bits=8)' if bits == 8 else 'bf16'}"] = bias_stats(
            np.concatenate(got), np.tile(exact, seeds))
    return out


def modelled(nodes: int, per_node: int, micro: int, node_gbps: float, model: str) -> dict[str, Any]:
    """hierarchical's last micro-step per layer and exposed time per step (tools/predict_scaling.py)
    with the cross-node hop in bf16 and in 8 bits (``cross_node_bits=8``: a byte an element and a
    float32 scale per 128)."""
    import predict_scaling as ps

    import lowgrad as lg
    a = ps.parse_args(["--inter-node-gbps-per-node", str(node_gbps), "--gpus-per-node", str(per_node),
                       "--micro-steps", str(micro), "--rounding", "sr"])
    m = ps.load_measured(a.bench_kernels, a.bench_manager, a.bench_layer)
    cfg, layout = ps.config_of(a), lg.llama_layout(model)
    base, eight = (next(r for r in ps.multi_node(model, layout, nodes, m, replace(cfg, cross_node_bits=bits))
                        if r["strategy"] == "hierarchical") for bits in (16, 8))
    return {"model": model, "node_gbps": node_gbps, "backward_ms": base["backward_ms"],
            "last_ms_bf16": base["last_ms"], "last_ms_8bit": eight["last_ms"],
            "step_exposed_ms_bf16": base["step_exposed_ms"], "step_exposed_ms_8bit": eight["step_exposed_ms"]}


def main(argv: Sequence[str] | None = None) -> int:
    p = Parser("compressed_hop", description=__doc__.split("\n\n")[0] + " Runs on the CPU.")
    p.add_argument("--grads", required=True, help="real gradients: .npy (micro_steps, n), as tools/accuracy.py reads")
    p.add_argument("--nodes", type=int_at_least(2), default=2)
    p.add_argument("--gpus-per-node", type=int_at_least(1), default=4)
    p.add_argument("--micro-steps", type=int_at_least(1), default=8)
    p.add_argument("--block", type=int_at_least(1), default=256, help="elements per quantisation scale")
    p.add_argument("--seeds", type=int_at_least(1), default=8)
    p.add_argument("--inter-node-gbps-per-node", type=float, default=25.0)
    p.add_argument("--model", default="Qwen2.5-7B", help="the preset whose step is modelled")
    p.add_argument("--lowgrad", action="store_true",
                   help="also through lowgrad's hierarchical manager on the host backend, its hop in bf16 and in "
                        "int8 (cross_node_bits=8; blocks of 128 whatever --block says)")
    p.add_argument("--json", help=output_help("compressed_hop.json"))
    args = p.parse_args(argv)
    try:
        grads = np.stack(load_grads(args.grads))
    except (OSError, ValueError, TypeError) as exc:
        raise CannotRun(f"--grads {args.grads}: {exc}") from None
    need = args.nodes * args.gpus_per_node * args.micro_steps
    if grads.shape[0] < need:
        raise CannotRun(f"--grads has {grads.shape[0]} micro-batches; {args.nodes} x {args.gpus_per_node} ranks x "
                        f"{args.micro_steps} micro-steps need {need}")
    n = grads.shape[1] // (args.block * args.nodes) * args.block * args.nodes
    if n == 0:
        raise CannotRun(f"--grads has {grads.shape[1]} elements, fewer than --block x --nodes")
    args.json = output_path("compressed_hop.json", args.json)
    t0 = time.perf_counter()
    stats = measure(grads[:, :n], args.nodes, args.gpus_per_node, args.micro_steps, args.block, args.seeds)
    if args.lowgrad:
        stats.update(measure_lowgrad(grads[:, :n], args.nodes, args.gpus_per_node, args.micro_steps, args.seeds))
    times = modelled(args.nodes, args.gpus_per_node, args.micro_steps, args.inter_node_gbps_per_node, args.model)
    print(f"compressed_hop: {args.nodes} nodes x {args.gpus_per_node} ranks, {args.micro_steps} micro-steps, "
          f"{n} elements x {args.seeds} seeds, blocks of {args.block}; {time.perf_counter() - t0:.0f} s")
    print("| scheme | rel. L2 | bias (SE) | magnitude bias (SE) |\n| --- | ---: | ---: | ---: |")
    for scheme, s in stats.items():
        print(f"| {scheme} | {s['rel_l2']:.2e} | {s['bias']:+.1e} ({s['bias_se']:+.1f}) | "
              f"{s['magnitude_bias_se']:+.1f} |")
    print(f"modelled ({times['model']}, {args.nodes} x {args.gpus_per_node} GPUs, {times['node_gbps']:g} GB/s per "
          f"node): last micro-step {times['last_ms_bf16']:.2f} ms per layer in bf16, {times['last_ms_8bit']:.2f} ms "
          "in 8 bits "
          f"(backward {times['backward_ms']:.2f} ms); exposed per step {times['step_exposed_ms_bf16']:.0f} ms, "
          f"{times['step_exposed_ms_8bit']:.0f} ms")
    with open(args.json, "w") as f:
        json.dump({"stats": stats, "modelled": times, "args": vars(args), "elements": n,
                   "date": time.strftime("%Y-%m-%d")}, f, indent=1)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(run("compressed_hop", main))
