"""Race hunter: the gradient managers at world > 1 on one GPU (the loopback communicator), with
the engine and the communicator shaken so that any missing dependency shows up as a mismatch.

Each run drives every rank (a thread) through several steps of micro-steps while:
- the engine works on a foreign stream (a raw int handle, as a framework would pass it);
- before each gradient write the engine's stream is held on the GPU for a random time (a slow
  engine kernel), so a manager that reads a gradient too early reads the old values;
- the rank thread sleeps a random time before some notifies (ranks drift apart on the host);
- every device-side meeting of the communicator is delayed by a random 0..jitter µs.
Every rank's shards must equal the host backend's (the executable reference, no concurrency) bit
for bit. Strategies, offload and eager/graph-replayed runs rotate until the time is up.

    python3 tools/race_hunt.py --world 8 --seconds 120 [--json out.json]
"""
from __future__ import annotations

import itertools
import json
import os
import random
import sys
import time
from collections.abc import Callable
from typing import Any

# before any CUDA context: a hardware queue per rank's loopback stream (docs/loopback.md)
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _cli import Parser, check_world, load_layout, output_help, output_path, require_cuda
from _cli import run as run_tool

import numpy as np

import lowgrad as lg
from lowgrad.buffers.streams import stream_handle
from lowgrad.cuda.compiler import kernel
from lowgrad.managers import STRATEGIES

#: every registered strategy, and with offload where it offloads
STRATS = tuple((name, o) for name, cls in STRATEGIES.items() for o in (False, True) if not o or cls.offloads)
Pause = Callable[[str], None]


def spin(dev: Any, stream: Any, ns: int) -> None:
    """Hold ``stream`` on the GPU for ``ns`` nanoseconds (one thread waiting on the clock;
    asynchronous): a slow engine kernel."""
    dev.kernels.kernel(kernel("loopback_delay")).launch(1, stream_handle(stream), ns)


def engine_inputs(dev: Any, layout: lg.Layout, rank: int) -> dict[Any, lg.Tensor]:
    """This rank's fixed fp32 input per gradient tensor (the engine's 'activations')."""
    rng = np.random.default_rng([11, rank])
    specs: dict[tuple[int | str, str], lg.ParamSpec] = {("nb", s.name): s for s in layout.non_block}
    specs.update({(layer, s.name): s for layer in range(layout.num_layers) for s in layout.block})
    return {k: lg.from_numpy((rng.standard_normal(s.shape) * 0.1).astype(np.float32), dev, name="engine_in")
            for k, s in specs.items()}


def micro_step(gm: Any, layout: lg.Layout, srcs: dict[Any, lg.Tensor], stream: Any, m: int, M: int,
               pause: Pause | None = None) -> None:
    """One engine micro-step, every call on ``stream`` (capturable); ``pause(where)`` runs before
    each gradient write ("write") and each notify ("notify")."""
    def write(t: lg.Tensor, acc: bool, src: lg.Tensor) -> None:
        if pause is not None:
            pause("write")
        if acc:
            lg.ops.add_sr(t, t, src, 1.0, seed=5, stream=stream)
        else:
            lg.ops.add_sr(t, src, src, 0.5, seed=4, stream=stream)
    gm.start_micro_step(stream, m, M)
    for s in layout.non_block:
        t, acc = gm.non_block_full(s.name, stream)
        write(t, acc, srcs[("nb", s.name)])
        if pause is not None:
            pause("notify")
        gm.notify_non_block(s.name, stream)
    for layer in reversed(range(layout.num_layers)):
        dw, acc = gm.block_full(layer, stream)
        for s in layout.block:
            write(dw[s.name], acc or s.zero_init, srcs[(layer, s.name)])
        if pause is not None:
            pause("notify")
        gm.notify_block(layer, stream)
    gm.end_micro_step(stream)


def shard_bits(gm: Any, layout: lg.Layout, stream: Any) -> dict[str, np.ndarray]:
    """Every shard of this rank as raw bits, once ``stream`` has finished."""
    out = {f"nb.{s.name}": gm.non_block_shard(s.name, stream) for s in layout.non_block}
    for layer in range(layout.num_layers):
        c = gm.block_shard(layer, stream)
        out.update({f"{layer}.{s.name}": c[s.name] for s in layout.block})
    gm.device.resolve_stream(stream).synchronize()
    return {k: t.numpy().view(np.uint16 if t.dtype is lg.bf16 else np.uint32).copy() for k, t in out.items()}


def shaker(dev: Any, stream: Any, seed: int, spin_us: int, sleep_us: int) -> Pause:
    """The race hunter's pauses: a device-side hold of the engine's stream before half the
    writes, a host sleep before a third of the notifies."""
    rng = random.Random(seed)

    def pause(where: str) -> None:
        if where == "write" and spin_us and rng.random() < 0.5:
            spin(dev, stream, rng.randrange(spin_us * 1000))
        elif where == "notify" and sleep_us and rng.random() < 0.3:
            time.sleep(rng.randrange(sleep_us) / 1e6)
    return pause


def train(layout: lg.Layout, strategy: str, offload: bool, M: int, steps: int, graphs: bool = False,
          shake: tuple[int, int, int] | None = None) -> Callable[[Any], dict[str, np.ndarray]]:
    """A ``run_threads`` job: ``steps`` steps of ``M`` micro-steps (step 0 eager; with ``graphs``
    the later steps replay one captured graph per kind of micro-step), then this rank's shards.
    ``shake=(seed, spin_us, sleep_us)``: the engine on a foreign stream handle, with pauses."""
    def job(comm: Any) -> dict[str, np.ndarray]:
        dev = comm.device
        own = dev.stream()
        s: Any = own.handle if shake else own
        pause = shaker(dev, s, shake[0] * 1000 + comm.rank, *shake[1:]) if shake else None
        srcs = engine_inputs(dev, layout, comm.rank)
        gm = lg.create_gradient_manager(layout, comm, strategy=strategy, offload=offload, seed=3)
        for m in range(M):
            micro_step(gm, layout, srcs, s, m, M, pause)
        captured: dict[int, Any] = {}
        if graphs:
            for m in sorted({0, min(1, M - 1), M - 1}):
                g = captured[m] = lg.Graph(dev)
                with g.capture(s):
                    micro_step(gm, layout, srcs, s, m, M, pause)
        for _ in range(1, steps):
            for m in range(M):
                if graphs:
                    captured[0 if m == 0 else (M - 1 if m == M - 1 else 1)].replay(s)
                else:
                    micro_step(gm, layout, srcs, s, m, M, pause)
        out = shard_bits(gm, layout, s)
        for g in captured.values():
            g.close()
        gm.close()
        return out
    return job


def mismatches(a: list[dict[str, np.ndarray]], b: list[dict[str, np.ndarray]]) -> list[str]:
    return [f"rank {r} {k}" for r, (x, y) in enumerate(zip(a, b)) for k in y if not np.array_equal(x[k], y[k])]


def hunt(world: int, seconds: float, M: int, steps: int, spin_us: int, sleep_us: int,
         layout: lg.Layout, timeout: float = 120) -> list[dict[str, Any]]:
    """Run rotating configurations until ``seconds`` have passed; one record per configuration
    (a line per run on stdout; ``timeout`` bounds every wait of the communicators)."""
    reference: dict[tuple[str, bool], list[dict[str, np.ndarray]]] = {}
    records: dict[tuple[str, bool, bool], dict[str, Any]] = {}
    deadline = time.monotonic() + seconds
    for run, ((strategy, offload), graphs) in enumerate(itertools.cycle(itertools.product(STRATS, (False, True)))):
        if time.monotonic() > deadline:
            break
        key = (strategy, offload)
        if key not in reference:
            reference[key] = lg.run_threads(world, train(layout, strategy, offload, M, steps), backend="host")
        t0 = time.monotonic()
        got = lg.run_threads(world, train(layout, strategy, offload, M, steps, graphs, (run, spin_us, sleep_us)),
                             backend="cuda", share_gpu=True, timeout=timeout)
        rec = records.setdefault((strategy, offload, graphs), {
            "strategy": strategy, "offload": offload, "graphs": graphs, "runs": 0, "micro_steps": 0,
            "rank_micro_steps": 0, "mismatched_runs": 0, "seconds": 0.0, "first_mismatch": None})
        bad = mismatches(got, reference[key])
        rec["runs"] += 1
        rec["micro_steps"] += M * steps
        rec["rank_micro_steps"] += M * steps * world
        rec["seconds"] += time.monotonic() - t0
        if bad:
            rec["mismatched_runs"] += 1
            rec["first_mismatch"] = rec["first_mismatch"] or f"run {run}: {bad[:3]}"
        print(f"run {run}: {strategy}{'+offload' if offload else ''} {'graphs' if graphs else 'eager'} "
              f"{time.monotonic() - t0:.2f} s{' MISMATCH' if bad else ''}", flush=True)
    return list(records.values())


def main(argv: list[str] | None = None) -> int:
    p = Parser("race_hunt", description=__doc__.split("\n\n")[0] + " Needs an NVIDIA GPU (all ranks on GPU 0).")
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--micro-steps", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--spin-us", type=int, default=200, help="longest device-side hold before a gradient write")
    p.add_argument("--sleep-us", type=int, default=2000, help="longest host sleep before a notify")
    p.add_argument("--jitter-us", type=int, default=50, help="longest device-side delay of each meeting")
    p.add_argument("--config", default="tiny", help="layout preset")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds any rank waits for another")
    p.add_argument("--json", help=output_help("race_hunt.json"))
    args = p.parse_args(argv)
    if args.world < 1 or args.micro_steps < 1 or args.steps < 1:
        p.error("--world, --micro-steps and --steps must be at least 1")
    layout = load_layout(args.config)
    check_world(layout, args.world)
    args.json = output_path("race_hunt.json", args.json)
    require_cuda()
    os.environ["LOWGRAD_LOOPBACK_JITTER_US"] = str(args.jitter_us)  # read when each group is created
    t0 = time.monotonic()
    records = hunt(args.world, args.seconds, args.micro_steps, args.steps, args.spin_us, args.sleep_us, layout,
                   args.timeout)
    print(f"race_hunt: world {args.world}, {args.config} ({layout.total_numel} params), {args.micro_steps} micro-steps "
          f"x {args.steps} steps per run, spin <= {args.spin_us} us, sleep <= {args.sleep_us} us, jitter <= "
          f"{args.jitter_us} us")
    print(f"{'strategy':<24}{'mode':>8}{'runs':>6}{'micro-steps':>13}{'rank micro':>12}{'mismatched':>12}{'s':>8}")
    for r in records:
        label = r["strategy"] + ("+offload" if r["offload"] else "")
        print(f"{label:<24}{'graphs' if r['graphs'] else 'eager':>8}{r['runs']:>6}{r['micro_steps']:>13}"
              f"{r['rank_micro_steps']:>12}{r['mismatched_runs']:>12}{r['seconds']:>8.1f}")
    total = sum(r["micro_steps"] for r in records)
    bad = sum(r["mismatched_runs"] for r in records)
    print(f"total: {sum(r['runs'] for r in records)} runs, {total} micro-steps "
          f"({sum(r['rank_micro_steps'] for r in records)} rank micro-steps), {bad} mismatched runs, "
          f"{time.monotonic() - t0:.0f} s")
    for r in records:
        if r["first_mismatch"]:
            print("MISMATCH", r["strategy"], r["offload"], r["graphs"], r["first_mismatch"])
    with open(args.json, "w") as f:
        json.dump({"world": args.world, "config": args.config, "args": vars(args), "records": records,
                   "date": time.strftime("%Y-%m-%d")}, f, indent=1)
    print(f"wrote {args.json}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(run_tool("race_hunt", main))
