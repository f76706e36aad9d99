"""``lowgrad demo``: the main job, end to end (see :data:`DESCRIPTION`); the table and the
verdict are in :mod:`lowgrad.cli.demo_report`."""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from lowgrad import ops
from lowgrad.base.dtypes import bf16
from lowgrad.base.errors import LowgradError
from lowgrad.buffers.tensor import Tensor, from_numpy
from lowgrad.cli.bandwidth import copy_bandwidths
from lowgrad.cli.demo_report import Result, error_stats, failures, print_results
from lowgrad.cuda import driver as _cuda
from lowgrad.managers.layout import Layout, ParamSpec, llama_layout
from lowgrad.managers.strategies import STRATEGIES

SUMMARY = "run every gradient manager end to end and check the shards against float64"
DESCRIPTION = """\
Synthetic gradients (different for every rank, micro-step, layer and tensor) go through every
gradient manager exactly as an engine would hand them over: every registered strategy, without
and (where it offloads) with pinned offload. After the last step every rank's shards
are compared with a float64 reference. Runs on the GPU when there is one, else on the host
backend (threads as ranks).

Prints, per strategy: memory by kind and name, time per micro-step and its ratio to the
copy-bandwidth floor, and the error in bf16 ulps (max, mean, signed mean = bias); then a
verdict. PASS when, for every strategy, the max error is at most micro-steps + 1 ulps and
|bias| is at most max(0.05 ulps, 5 standard errors of the mean). Exit status: 0 on PASS, 1 on
FAIL, 2 for a bad argument or setup (one line on stderr, nothing run)."""

# A ~107M-parameter Qwen-style model: big enough to load an H200, small enough for a minute.
GPU_DEFAULT = {"model_type": "qwen2", "hidden_size": 1024, "intermediate_size": 2816, "num_attention_heads": 16,
               "num_key_value_heads": 4, "num_hidden_layers": 8, "vocab_size": 16384, "tie_word_embeddings": True}
_WINDOW = 1 << 16  # pool windows start at one of this many offsets
_ENGINE_SEED = 0xE6


def _int_in(low: int, high_bits: int | None = None) -> Callable[[str], int]:
    """An argparse ``type``: a decimal int in ``[low, 2**high_bits)`` (no upper bound when None)."""
    def parse(text: str) -> int:
        try:
            v = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < low or (high_bits is not None and v >> high_bits):
            bound = f"at least {low}" if high_bits is None else f"in [{low}, 2**{high_bits})"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {v}")
        return v
    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The demo's options; counts must be positive and the seed fit 64 bits (an argparse error
    otherwise, before anything runs)."""
    positive = _int_in(1)
    p.add_argument("--config", help="a preset name (e.g. tiny, Qwen2.5-0.5B) or a config.json path "
                                    "(default: tiny on the host, a 107M Qwen-style model on the GPU)")
    p.add_argument("--layers", type=positive, help="override num_hidden_layers")
    p.add_argument("--backend", choices=("auto", "cuda", "host"), default="auto")
    p.add_argument("--world", type=positive, help="ranks (threads); default 1 on the GPU, 2 on the host")
    p.add_argument("--strategy", choices=("all", *STRATEGIES), default="all")
    p.add_argument("--offload", nargs="?", const="on", choices=("both", "off", "on"), default="both",
                   help="the runs with pinned offload, without it, or both (default); --offload alone is on, "
                        "as in examples/train_lm.py")
    p.add_argument("--micro-steps", type=positive, default=4)
    p.add_argument("--steps", type=positive, default=2, help="optimizer steps; the last one is timed and checked")
    p.add_argument("--seed", type=_int_in(0, 64), default=1234)
    p.add_argument("--json", help="write the results here")


def _layout(args: argparse.Namespace, backend: str) -> Layout:
    cfg: Any = args.config or ("tiny" if backend == "host" else GPU_DEFAULT)
    if args.layers is None:
        return llama_layout(cfg)
    from lowgrad.managers.layout import _layout_from_config, _load_config

    loaded, src = _load_config(cfg)
    return _layout_from_config(dict(loaded, num_hidden_layers=args.layers), src)


def _pool_offsets(rank: int, micro: int, layer: int, tensor: int) -> int:
    h = (rank * 0x9E3779B1 + micro * 0x85EBCA77 + layer * 0xC2B2AE3D + tensor * 0x27D4EB2F) & 0xFFFFFFFF
    return (h ^ (h >> 15)) % _WINDOW


def _specs(layout: Layout) -> list[tuple[int, int, ParamSpec]]:
    """(layer, tensor index, spec) for every gradient; non-block tensors use layer -1."""
    out = [(-1, i, s) for i, s in enumerate(layout.non_block)]
    return out + [(l, i, s) for l in range(layout.num_layers) for i, s in enumerate(layout.block)]


def _reference(pool: np.ndarray, layout: Layout, world: int, micro: int
               ) -> dict[tuple[int, int], tuple[np.ndarray, np.ndarray]]:
    """float64 ``sum over micro-steps of mean over ranks`` of every full gradient, and the
    largest magnitude any partial sum or contribution reaches (the scale of the rounding)."""
    ref = {}
    for layer, i, s in _specs(layout):
        acc, mag = np.zeros(s.numel, np.float64), np.zeros(s.numel, np.float64)
        for m in range(micro):
            contrib = np.zeros(s.numel, np.float64)
            for r in range(world):
                o = _pool_offsets(r, m, layer, i)
                g = pool[o:o + s.numel].astype(np.float64)
                contrib += g / world
                mag = np.maximum(mag, np.abs(g))
            acc += contrib
            mag = np.maximum(mag, np.abs(acc))
        ref[(layer, i)] = (acc.reshape(s.shape), mag.reshape(s.shape))
    return ref


def _ulp(x: np.ndarray) -> np.ndarray:
    """One bf16 ulp at the magnitude of ``x`` (normal range)."""
    e = np.floor(np.log2(np.maximum(np.abs(x), 2.0 ** -126)))
    return np.exp2(e - 7)


def _engine_write(dw: Tensor, accumulate: bool, pool_dev: Tensor, offset: int, seed: int, stream: Any) -> None:
    g = pool_dev.view(offset, dw.numel)
    if accumulate:
        ops.add_sr(dw, dw, g, 1.0, seed, 0, stream=stream)
    else:
        ops.copy(dw, g, stream=stream)


def _rank_job(comm: Any, args: argparse.Namespace, layout: Layout, pool: np.ndarray, strategy: str,
              offload: bool, bar: _Bar) -> dict[str, Any]:
    from lowgrad.managers import create_gradient_manager

    dev, rank = comm.device, comm.rank
    pool_dev = from_numpy(pool, dev, name="demo_pool")
    stream = dev.stream()
    gm = create_gradient_manager(layout, comm, strategy=strategy, offload=offload, dtype=bf16, seed=args.seed)
    M = args.micro_steps
    t0 = t1 = 0.0
    for step in range(args.steps):
        comm.barrier()
        t0 = time.perf_counter()
        for m in range(M):
            gm.start_micro_step(stream, m, M)
            for i, s in enumerate(layout.non_block):
                t, acc = gm.non_block_full(s.name, stream)
                _engine_write(t, acc, pool_dev, _pool_offsets(rank, m, -1, i), _ENGINE_SEED + m, stream)
                gm.notify_non_block(s.name, stream)
            for layer in reversed(range(layout.num_layers)):
                dw, acc = gm.block_full(layer, stream)
                for i, (_, t) in enumerate(dw.items()):
                    _engine_write(t, acc, pool_dev, _pool_offsets(rank, m, layer, i), _ENGINE_SEED + m, stream)
                gm.notify_block(layer, stream)
            gm.end_micro_step(stream)
            if rank == 0:  # one progress bar for all ranks
                bar.tick(f"{strategy}{'+offload' if offload else ''} step {step} micro {m}")
        stream.synchronize()
        comm.barrier()
        t1 = time.perf_counter()
    shards: dict[tuple[int, int], Any] = {}
    for i, s in enumerate(layout.non_block):
        shards[(-1, i)] = gm.non_block_shard(s.name, stream)
    for layer in range(layout.num_layers):
        c = gm.block_shard(layer, stream)
        for i, s in enumerate(layout.block):
            shards[(layer, i)] = c[s.name]
    stream.synchronize()
    host = {k: v.numpy().astype(np.float64) for k, v in shards.items()}
    report = gm.memory_report().as_dict()
    gm.close()
    pool_dev.close()
    return {"ms": (t1 - t0) * 1e3, "shards": host, "memory": report}


class _Bar:
    """A one-line progress bar on stderr."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.tty = total, 0, sys.stderr.isatty()

    def tick(self, label: str) -> None:
        self.done += 1
        n = 30 * self.done // self.total
        line = f"[{'#' * n}{'.' * (30 - n)}] {self.done}/{self.total} {label:<40}"
        if self.tty:
            sys.stderr.write("\r" + line)
        elif self.done == self.total or n != 30 * (self.done - 1) // self.total:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")


def _bytes_per_micro(layout: Layout, strategy: str, world: int, first: bool) -> int:
    """Bytes the engine and the manager must move per micro-step (bf16), excluding NCCL: the
    engine writes every gradient (and adds into the blocks too where the strategy keeps them
    whole), the strategy's kernels move what :meth:`Strategy.micro_step_bytes` says."""
    B, NB = 2 * layout.block_numel * layout.num_layers, 2 * layout.non_block_numel
    cls = STRATEGIES[strategy]
    engine = 2 * (B + NB) if first else (2 * B if cls.sharded else 3 * B) + 3 * NB
    return engine + cls.micro_step_bytes(B, world, first).device


def run(args: argparse.Namespace) -> int:
    """Run the demo for parsed ``args``; 0 on PASS, 1 on FAIL, 2 (one line on stderr, nothing
    run) for a bad layout, world, GPU count or output path. ``args.prog`` names the command."""
    from lowgrad.cuda.device import Device, device_count
    from lowgrad.launch.bootstrap import run_threads

    backend = args.backend
    if backend == "auto":
        backend = "cuda" if _cuda.available() else "host"
    world = (1 if backend == "cuda" else 2) if args.world is None else args.world
    try:
        layout = _layout(args, backend)
        layout.check_world(world)
        if backend == "cuda":
            _cuda.driver()  # CudaUnavailableError with the reason, before "0 GPUs visible"
            if world > device_count():
                raise ValueError(f"--world {world} needs {world} GPUs, {device_count()} visible")
        if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
            raise ValueError(f"--json {args.json!r}: no such directory")
    except (ValueError, TypeError, OSError, LowgradError) as exc:
        print(f"{args.prog}: error: {exc}", file=sys.stderr)
        return 2
    # every registered strategy, and with offload where it offloads
    runs = [(s, o) for s, cls in STRATEGIES.items() for o in (False, True) if args.strategy in ("all", s) and
            (not o or cls.offloads and args.offload in ("both", "on")) and (o or args.offload in ("both", "off"))]
    max_numel = max(s.numel for _, _, s in _specs(layout))
    rng = np.random.default_rng(args.seed)
    pool = (rng.standard_normal(max_numel + _WINDOW, dtype=np.float32) * 0.01).astype(bf16.np)
    from lowgrad.host.device import HostDevice

    bw_dev = Device(0) if backend == "cuda" else HostDevice()
    bw = copy_bandwidths(bw_dev, 1 << 28 if backend == "cuda" else 1 << 24, pinned=False, reps=5)["d2d"]
    print(f"lowgrad demo: backend {backend}, world {world}, {layout.total_numel / 1e6:.1f}M parameters "
          f"({layout.num_layers} layers), {args.micro_steps} micro-steps x {args.steps} steps, "
          f"copy bandwidth {bw / 1e9:.1f} GB/s")
    ref = _reference(pool, layout, world, args.micro_steps)
    bar = _Bar(len(runs) * args.steps * args.micro_steps)
    results = []
    for strategy, offload in runs:
        job = functools.partial(_rank_job, args=args, layout=layout, pool=pool, strategy=strategy, offload=offload,
                                bar=bar)
        out = run_threads(world, job, backend=backend)
        errs = []
        for rank, r in enumerate(out):
            for (layer, i), got in r["shards"].items():
                spec = layout.non_block[i] if layer < 0 else layout.block[i]
                want, mag = (_rows(x, rank, world, spec) for x in ref[(layer, i)])
                errs.append(((got - want) / _ulp(mag)).ravel())
        M = args.micro_steps
        floor_s = (_bytes_per_micro(layout, strategy, world, True) +
                   (M - 1) * _bytes_per_micro(layout, strategy, world, False)) / bw / M
        ms = max(r["ms"] for r in out) / M
        results.append(Result(strategy, offload, world, ms, floor_s * 1e3 / ms,
                              memory=out[0]["memory"], **error_stats(np.concatenate(errs))))
    bar.close()
    passed = print_results(results, args.micro_steps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dict(r.__dict__, passed=not failures(r, args.micro_steps)) for r in results], f, indent=1)
    return 0 if passed else 1


def _rows(full: np.ndarray, rank: int, world: int, spec: ParamSpec) -> np.ndarray:
    """The rows of ``full`` that rank ``rank`` holds (numpy twin of ``shard_view``)."""
    rows = spec.shape[0] // world
    return full[rank * rows:(rank + 1) * rows]
