"""Numerical error of the sharded strategies at world 1, 2, 3, 4, 8 against a float64 reference.

Each rank's engine writes synthetic bf16 block gradients (per element a mean ~ N(0,1)*scale, plus
independent noise of std noise*scale for every micro-step and rank); after one step of M
micro-steps every shard should hold the sum over micro-steps of the mean over ranks. The
reference is that sum in float64 of the very bf16 values the engines wrote, so only the
manager's own rounding is measured. Three ways to get the shards:

- ``all_to_all``: the real manager on the host backend (what a GPU gives bit for bit).
- ``scatter_reduce``: the real manager on the host backend, whose reduce-scatter sums in float32
  in rank order and rounds once (the host backend and the single-GPU loopback communicator).
- ``scatter_reduce_ring``: a numpy emulation of NCCL's ring reduce-scatter (average) of bf16:
  every input pre-multiplied by bf16(1/world) and rounded to bf16, then the shard's partial sum
  travels the ring, starting at the rank after the shard's owner, rounded to bf16 (nearest-even)
  after every addition; then the manager's accumulation (copy at micro-step 0, SR add with the
  phase-0 seed after) through lowgrad.sr.reference. The same emulation with the host's
  reduction instead of the ring is checked against the real scatter_reduce manager bit for bit,
  so the two differ only in the reduction.

Per (strategy, world, M): relative L2 error; max error, mean signed error (bias) and mean error
towards larger magnitude (shrinkage shows as < 0), in bf16 ulps at each element's largest exact
running sum; and the fraction of elements whose bits differ from the host scatter_reduce shards.
The default layout's dims divide by 24, so worlds 3 and 6 shard it too. A measured table and
what it means: docs/reproducibility.md.

    PYTHONPATH=. python3 tools/accuracy_world.py --json $OUT/accuracy_world.json
"""
from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _cli import CannotRun, Parser, check_world, int_list, output_help, output_path, run

import numpy as np

import lowgrad as lg
from lowgrad.host.reduce import host_reduce
from lowgrad.managers import STRATEGIES

BF16 = lg.bf16.np
Reduce = Callable[[np.ndarray], np.ndarray]  # (world, n) bf16 inputs -> (n,) bf16 average
# A Qwen2-shaped block whose every dim 0 divides by 24: worlds 1, 2, 3, 4, 6, 8 all shard it.
SMALL = {"model_type": "qwen2", "hidden_size": 48, "intermediate_size": 144, "num_attention_heads": 2,
         "num_key_value_heads": 1, "num_hidden_layers": 2, "vocab_size": 48, "tie_word_embeddings": False}


# ---- synthetic gradients ------------------------------------------------------------------------
def make_layout(config: str = "small", layers: int = 1) -> lg.Layout:
    """The block parameters of ``config`` ("small": :data:`SMALL`; else a preset name or a
    config.json) with ``layers`` layers and no non-block ones (non-block gradients are
    reduce-scattered the same way by every strategy)."""
    base = lg.llama_layout(SMALL if config == "small" else config)
    return lg.Layout(base.block, (), layers)


def make_gradients(numel: int, world: int, micro_steps: int, seed: int, scale: float = 1e-2,
                   noise: float = 2.0) -> np.ndarray:
    """bf16 array ``(micro_steps, world, numel)``: a per-element mean ~ N(0,1)*scale shared by
    all, plus N(0,1)*noise*scale drawn per micro-step and rank."""
    mean = np.random.default_rng([seed, 0]).standard_normal(numel) * scale
    out = np.empty((micro_steps, world, numel), dtype=BF16)
    for m in range(micro_steps):
        for r in range(world):
            eps = np.random.default_rng([seed, 1, m, r]).standard_normal(numel)
            out[m, r] = (mean + eps * (noise * scale)).astype(np.float32).astype(BF16)
    return out


def reference(grads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Float64 sum over micro-steps of the mean over ranks, and per element the largest magnitude
    its running sum reaches (the scale the accumulator rounds at)."""
    running = np.cumsum(grads.astype(np.float64).mean(axis=1), axis=0)
    return running[-1], np.abs(running).max(axis=0)


def tensor_slices(layout: lg.Layout) -> list[tuple[int, int, slice]]:
    """(layer, tensor index, flat slice) of every block tensor in the flat gradient order."""
    out, off = [], 0
    for layer in range(layout.num_layers):
        for i, spec in enumerate(layout.block):
            out.append((layer, i, slice(off, off + spec.numel)))
            off += spec.numel
    return out


# ---- the real managers --------------------------------------------------------------------------
def run_manager(layout: lg.Layout, strategy: str, grads: np.ndarray, seed: int = 1,
                delay: Callable[[int, int, int], None] | None = None, rounding: str = "sr") -> np.ndarray:
    """One step of ``grads.shape[0]`` micro-steps through ``create_gradient_manager`` on
    ``grads.shape[1]`` host-backend ranks; the ranks' shards joined into full tensors (flat, in
    :func:`tensor_slices` order), rounding with ``rounding`` (SR: what the emulations model). ``delay(rank,
    micro_step, layer)``, if given, runs before each ``notify_block`` (to vary the order in which
    ranks arrive)."""
    micro, world = grads.shape[:2]
    slices = tensor_slices(layout)

    def rank_fn(comm: Any) -> list[np.ndarray]:
        gm = lg.create_gradient_manager(layout, comm, strategy=strategy, seed=seed,
                                        rounding=rounding if STRATEGIES[strategy].rounds() else None)
        s = comm.device.stream()
        for m in range(micro):
            gm.start_micro_step(s, m, micro)
            for layer in reversed(range(layout.num_layers)):
                dw, _ = gm.block_full(layer, s)
                for (_, _, sl), (_, t) in zip(slices[layer * len(layout.block):], dw.items()):
                    t.numpy().reshape(-1)[:] = grads[m, comm.rank, sl]
                if delay is not None:
                    delay(comm.rank, m, layer)
                gm.notify_block(layer, s)
            gm.end_micro_step(s)
        shards = []
        for layer, i, _ in slices:
            shard = gm.block_shard(layer, s)[i]
            assert shard is not None  # a manager fills every slot (a Container may have empty ones)
            shards.append(shard.numpy().reshape(-1).copy())
        gm.close()
        return shards

    per_rank = lg.run_threads(world, rank_fn, backend="host")
    return np.concatenate([np.concatenate([per_rank[r][k] for r in range(world)]) for k in range(len(slices))])


# ---- reductions: the host's and NCCL's ring -----------------------------------------------------
def exact_avg(inputs: np.ndarray) -> np.ndarray:
    """The host backend's reduce-scatter (avg) of ``(world, n)`` bf16 inputs: float32 sum in rank
    order, times float32(1/world), one round-to-nearest-even (lowgrad's host_reduce)."""
    return host_reduce(list(inputs), "avg", inputs.shape[0], lg.bf16)


def ring_avg(inputs: np.ndarray, ring: Sequence[int] | None = None) -> np.ndarray:
    """NCCL's ring reduce-scatter (avg) of ``(world, n)`` bf16 inputs, emulated: each input times
    bf16(1/world), rounded to bf16; shard ``d`` (elements ``[d*n/W, (d+1)*n/W)``) starts at the
    rank after ``d`` in ``ring`` (default: rank order), goes round the ring and ends at ``d``,
    rounding the partial sum to bf16 after every addition."""
    world, n = inputs.shape
    ring = list(range(world)) if ring is None else list(ring)
    if sorted(ring) != list(range(world)):
        raise ValueError(f"ring must be a permutation of range({world}), got {ring}")
    scalar = np.float32(np.float32(1.0 / world).astype(BF16))
    pre = (inputs.astype(np.float32) * scalar).astype(BF16)  # an exact product, rounded once
    out, count = np.empty(n, dtype=BF16), n // world
    for d in range(world):
        sl, pos = slice(d * count, (d + 1) * count), ring.index(d)
        order = [ring[(pos + k) % world] for k in range(1, world + 1)]
        partial = pre[order[0], sl]
        for r in order[1:]:
            partial = (partial.astype(np.float32) + pre[r, sl].astype(np.float32)).astype(BF16)
        out[sl] = partial
    return out


def emulate_scatter_reduce(layout: lg.Layout, grads: np.ndarray, reduce: Reduce, seed: int = 1) -> np.ndarray:
    """The scatter_reduce manager's step in numpy with ``reduce`` as the reduce-scatter: per
    micro-step and tensor the average of the ranks' gradients, copied into the shard at
    micro-step 0 and added with SR (phase-0 seed, full-tensor noise indices) after."""
    micro, world = grads.shape[:2]
    acc = np.empty(grads.shape[2], dtype=BF16)
    for m in range(micro):
        for layer, i, sl in tensor_slices(layout):
            mean = reduce(grads[m, :, sl]) if world > 1 else grads[m, 0, sl]
            if m == 0:
                acc[sl] = mean
            else:
                acc[sl] = lg.reference.add_sr(acc[sl], mean, 1.0, lg.use_seed(seed, 0, m, layer, i, 0))
    return acc


# ---- errors -------------------------------------------------------------------------------------
def bf16_ulp(x: np.ndarray) -> np.ndarray:
    """The spacing of bf16 numbers at ``|x|`` (float64; that of the smallest normal at 0)."""
    _, e = np.frexp(np.maximum(np.abs(x), np.finfo(np.float32).tiny))
    return np.ldexp(1.0, e - 8)


def errors(result: np.ndarray, ref: np.ndarray, peak: np.ndarray) -> dict[str, float]:
    """Relative L2 error; max |error|, mean signed error and mean error towards larger magnitude
    (sign(ref) * error), in bf16 ulps at ``peak`` (each element's largest running sum: ulps of
    the final value would explode where micro-steps cancel)."""
    err = result.astype(np.float64) - ref
    ulps = err / bf16_ulp(peak)
    return {"rel_l2": float(np.linalg.norm(err) / np.linalg.norm(ref)), "max_ulp": float(np.max(np.abs(ulps))),
            "bias_ulp": float(np.mean(ulps)), "magnitude_bias_ulp": float(np.mean(np.sign(ref) * ulps))}


def differ(a: np.ndarray, b: np.ndarray) -> float:
    """Fraction of elements whose bf16 bits differ."""
    return float(np.mean(a.view(np.uint16) != b.view(np.uint16)))


# ---- the measurement ----------------------------------------------------------------------------
def measure_one(layout: lg.Layout, world: int, micro: int, seed: int, scale: float,
                noise: float) -> list[dict[str, Any]]:
    """The three strategies at one (world, M), plus the check of the emulation against the manager."""
    grads = make_gradients(layout.num_layers * layout.block_numel, world, micro, seed, scale, noise)
    ref, peak = reference(grads)
    host_sr = run_manager(layout, "scatter_reduce", grads, seed)
    shards = {"all_to_all": run_manager(layout, "all_to_all", grads, seed), "scatter_reduce": host_sr,
              "scatter_reduce_ring": emulate_scatter_reduce(layout, grads, ring_avg, seed)}
    emulation_exact = differ(emulate_scatter_reduce(layout, grads, exact_avg, seed), host_sr) == 0.0
    return [{"strategy": name, "world": world, "micro_steps": micro, **errors(x, ref, peak),
             "differ_from_host_scatter_reduce": differ(x, host_sr), "emulation_matches_manager": emulation_exact}
            for name, x in shards.items()]


def measure(layout: lg.Layout, worlds: Sequence[int], micro_steps: Sequence[int], seed: int = 1,
            scale: float = 1e-2, noise: float = 2.0) -> list[dict[str, Any]]:
    """:func:`measure_one` for every (world, M)."""
    return [row for w in worlds for m in micro_steps for row in measure_one(layout, w, m, seed, scale, noise)]


def table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a Markdown table."""
    lines = ["| strategy | world | M | rel L2 | max ulp | bias ulp | magnitude bias ulp "
             "| bits != host scatter_reduce |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['strategy']} | {r['world']} | {r['micro_steps']} | {r['rel_l2']:.3e} | {r['max_ulp']:.2f} "
                     f"| {r['bias_ulp']:+.4f} | {r['magnitude_bias_ulp']:+.4f} "
                     f"| {r['differ_from_host_scatter_reduce']:.4f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = Parser("accuracy_world", description=__doc__.split("\n\n")[0] + " Runs on the CPU (host backend).")
    p.add_argument("--config", default="small", help="'small' (every dim 0 divides by 24), a preset name or a "
                   "config.json: whose block layout is used")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--worlds", type=int_list(1), default=[1, 2, 3, 4, 8])
    p.add_argument("--micro-steps", type=int_list(1), default=[4, 16, 64])
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--scale", type=float, default=1e-2, help="std of the per-element mean gradient")
    p.add_argument("--noise", type=float, default=2.0, help="std of the per-micro-step, per-rank noise / scale")
    p.add_argument("--json", help=output_help("accuracy_world.json"))
    args = p.parse_args(argv)
    if args.layers < 1:
        p.error("--layers must be at least 1")
    try:
        layout = make_layout(args.config, args.layers)
    except (ValueError, OSError) as exc:
        raise CannotRun(f"--config: {exc}") from None
    for w in args.worlds:
        check_world(layout, w, "--worlds: world")
    args.json = output_path("accuracy_world.json", args.json)
    t0 = time.perf_counter()
    rows = measure(layout, args.worlds, args.micro_steps, args.seed, args.scale, args.noise)
    elapsed = time.perf_counter() - t0
    print(f"accuracy_world: {args.config} blocks x {args.layers} layers ({layout.num_layers * layout.block_numel} "
          f"elements), scale {args.scale:g}, noise {args.noise:g}, seed {args.seed}, host backend, {elapsed:.1f} s")
    print(table(rows))
    ok = all(r["emulation_matches_manager"] for r in rows)
    print(f"emulation with the host's reduction == scatter_reduce manager, bit for bit: {'yes' if ok else 'NO'}")
    with open(args.json, "w") as f:
        json.dump({"config": args.config, "layers": args.layers, "seed": args.seed, "scale": args.scale,
                   "noise": args.noise, "date": time.strftime("%Y-%m-%d"), "seconds": elapsed,
                   "emulation_matches_manager": ok, "results": rows}, f, indent=1)
    print(f"wrote {args.json}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(run("accuracy_world", main))
