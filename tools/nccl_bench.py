"""NCCL bandwidth of lowgrad's communicator, next to PyTorch's torch.distributed where installed.

For reduce-scatter (avg), all-gather, all-reduce (sum) and lowgrad's destructive all-to-all,
in bf16 and fp32, over buffer sizes from ``--min-bytes`` to ``--max-bytes`` (factor 4 steps),
at ``world`` = every visible GPU (``lowgrad.run_threads``, one thread per GPU). Each point is
timed with CUDA events on the rank's stream: warm-up, then the median of ``--iters`` timed
repeats. Sizes are the full buffer (nccl-tests' convention) and

    algbw = bytes / time;  busbw = algbw * (n-1)/n  (reduce-scatter, all-gather, all-to-all)
                           busbw = algbw * 2(n-1)/n (all-reduce)

The torch peer runs the same points in ``world`` spawned processes (``init_method=file://``,
backend ``nccl``; world 1 is a single-process group), with ``reduce_scatter_tensor``,
``all_gather_into_tensor``, ``all_reduce`` and ``all_to_all_single``. Prints a table
(GB/s = 1e9 B/s) and writes JSON (``--json PATH``); ``ratio`` is lowgrad busbw / torch busbw.

``--mode blocking|nonblocking`` picks lowgrad's NCCL mode (``LOWGRAD_NCCL_BLOCKING``; default:
the environment's, non-blocking when unset). Each point also records the host's cost of a call
(``host_us``: ``--iters`` calls issued back to back, no wait between, divided by ``--iters``):
the figure that issue 33's world-1 bound (within 10% of the non-blocking mode) is checked on.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _cli import Parser, output_help, output_path, require_cuda, run

COLLECTIVES = ("reduce_scatter", "all_gather", "all_reduce", "all_to_all")
DTYPES = ("bf16", "fp32")
BUS_FACTOR = {"reduce_scatter": lambda n: (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
              "all_reduce": lambda n: 2 * (n - 1) / n, "all_to_all": lambda n: (n - 1) / n}


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B")
    return int(float(text[:-1]) * units[text[-1]]) if text and text[-1] in units else int(text)


def sizes(lo: int, hi: int, factor: int) -> list[int]:
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= factor
    return out


def point_elements(nbytes: int, itemsize: int, world: int) -> int:
    """Elements of the full buffer for ``nbytes``, a multiple of ``world``."""
    n = nbytes // itemsize
    return max(world, n - n % world)


# ---- lowgrad -------------------------------------------------------------------------------
def lowgrad_rank(comm: Any, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    import lowgrad as lg
    from lowgrad.cuda import driver as _cuda

    dev, world = comm.device, comm.world
    stream = dev.stream()
    start, end = dev.event(timing=True), dev.event(timing=True)
    rows = []
    for dname in cfg["dtypes"]:
        dtype = getattr(lg, dname)
        buf = dev.alloc((point_elements(cfg["sizes"][-1], dtype.itemsize, world),), dtype, name="bench")
        _cuda.check("cuMemsetD8", _cuda.driver().cuMemsetD8(buf.ptr, 0, buf.nbytes))
        for op in cfg["ops"]:
            for nbytes in cfg["sizes"]:
                t = buf.view(0, point_elements(nbytes, dtype.itemsize, world))
                call: Callable[[], object] = {"reduce_scatter": lambda: comm.reduce_scatter(t, "avg", stream),
                        "all_gather": lambda: comm.all_gather(t, stream=stream),
                        "all_reduce": lambda: comm.all_reduce(t, "sum", stream),
                        "all_to_all": lambda: comm.all_to_all(t, stream)}[op]
                for _ in range(cfg["warmup"]):
                    call()
                comm.wait(stream)
                times = []
                for _ in range(cfg["iters"]):
                    start.record(stream)
                    call()
                    end.record(stream)
                    comm.wait(end)
                    times.append(start.elapsed_ms(end))
                t0 = time.perf_counter()
                for _ in range(cfg["iters"]):
                    call()
                host_us = (time.perf_counter() - t0) / cfg["iters"] * 1e6
                comm.wait(stream)
                rows.append({"op": op, "dtype": dname, "bytes": t.nbytes, "ms": statistics.median(times),
                             "host_us": host_us})
        buf.close()
    return rows


def run_lowgrad(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    import lowgrad as lg

    results = lg.run_threads(cfg["world"], lambda c: lowgrad_rank(c, cfg), backend="cuda", timeout=cfg["timeout"])
    return results[0]


# ---- torch ---------------------------------------------------------------------------------
def torch_rank(rank: int, cfg: dict[str, Any], init_file: str, queue: Any) -> None:
    import torch
    import torch.distributed as dist

    try:
        world = cfg["world"]
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
        rows = []
        for dname in cfg["dtypes"]:
            dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dname]
            itemsize = torch.tensor([], dtype=dtype).element_size()
            n_max = point_elements(cfg["sizes"][-1], itemsize, world)
            a = torch.zeros(n_max, dtype=dtype, device="cuda")
            b = torch.zeros(n_max, dtype=dtype, device="cuda")
            for op in cfg["ops"]:
                for nbytes in cfg["sizes"]:
                    n = point_elements(nbytes, itemsize, world)
                    x, y = a[:n], b[:n]
                    avg = dist.ReduceOp.AVG
                    call: Callable[[], object] = {
                        "reduce_scatter": lambda: dist.reduce_scatter_tensor(y[:n // world], x, op=avg),
                        "all_gather": lambda: dist.all_gather_into_tensor(y, x[:n // world]),
                        "all_reduce": lambda: dist.all_reduce(x),
                        "all_to_all": lambda: dist.all_to_all_single(y, x)}[op]
                    for _ in range(cfg["warmup"]):
                        call()
                    torch.cuda.synchronize()
                    times = []
                    for _ in range(cfg["iters"]):
                        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        s.record()
                        call()
                        e.record()
                        e.synchronize()
                        times.append(s.elapsed_time(e))
                    t0 = time.perf_counter()
                    for _ in range(cfg["iters"]):
                        call()
                    host_us = (time.perf_counter() - t0) / cfg["iters"] * 1e6
                    torch.cuda.synchronize()
                    rows.append({"op": op, "dtype": dname, "bytes": n * itemsize, "ms": statistics.median(times),
                                 "host_us": host_us})
            del a, b
        dist.destroy_process_group()
        if rank == 0:
            queue.put(("ok", rows))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which prints it
        queue.put(("error", f"rank {rank}: {type(exc).__name__}: {exc}"))


def run_torch(cfg: dict[str, Any]) -> list[dict[str, Any]] | str:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [ctx.Process(target=torch_rank, args=(r, cfg, init_file, queue)) for r in range(cfg["world"])]
        for p in procs:
            p.start()
        try:
            status, payload = queue.get(timeout=cfg["timeout"] * 4)
        except Exception:  # noqa: BLE001 - queue.Empty after the timeout, or nothing readable: no result
            status, payload = "error", "torch peer timed out"
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return payload if status == "ok" else str(payload)


# ---- report --------------------------------------------------------------------------------
def annotate(rows: list[dict[str, Any]], world: int) -> None:
    for r in rows:
        r["algbw_GBps"] = r["bytes"] / (r["ms"] * 1e-3) / 1e9
        r["busbw_GBps"] = r["algbw_GBps"] * BUS_FACTOR[r["op"]](world)


def merge(ours: list[dict[str, Any]], theirs: list[dict[str, Any]] | None, world: int) -> list[dict[str, Any]]:
    annotate(ours, world)
    index = {}
    if theirs:
        annotate(theirs, world)
        index = {(t["op"], t["dtype"], t["bytes"]): t for t in theirs}
    out = []
    for r in ours:
        row = {"op": r["op"], "dtype": r["dtype"], "bytes": r["bytes"], "world": world, "lowgrad_ms": r["ms"],
               "lowgrad_algbw_GBps": r["algbw_GBps"], "lowgrad_busbw_GBps": r["busbw_GBps"],
               "lowgrad_host_us": r["host_us"]}
        t = index.get((r["op"], r["dtype"], r["bytes"]))
        if t is not None:
            row.update(torch_ms=t["ms"], torch_algbw_GBps=t["algbw_GBps"], torch_busbw_GBps=t["busbw_GBps"],
                       torch_host_us=t["host_us"], ratio=t["ms"] / r["ms"])
        out.append(row)
    return out


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'op':<15}{'dtype':<6}{'bytes':>12}{'ms':>10}{'algbw':>9}{'busbw':>9}{'host us':>9}"
            f"{'torch ms':>10}{'t.busbw':>9}{'t.host':>8}{'ratio':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        line = (f"{r['op']:<15}{r['dtype']:<6}{r['bytes']:>12}{r['lowgrad_ms']:>10.3f}"
                f"{r['lowgrad_algbw_GBps']:>9.1f}{r['lowgrad_busbw_GBps']:>9.1f}{r['lowgrad_host_us']:>9.1f}")
        if "torch_ms" in r:
            line += f"{r['torch_ms']:>10.3f}{r['torch_busbw_GBps']:>9.1f}{r['torch_host_us']:>8.1f}{r['ratio']:>7.2f}"
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = Parser("nccl_bench", description=__doc__.split("\n\n")[0] + " Needs an NVIDIA GPU (one rank per GPU).",
                formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--min-bytes", type=parse_size, default=parse_size("1M"), help="smallest buffer (default 1M)")
    ap.add_argument("--max-bytes", type=parse_size, default=parse_size("1G"), help="largest buffer (default 1G)")
    ap.add_argument("--factor", type=int, default=4, help="size step factor (default 4)")
    ap.add_argument("--ops", default=",".join(COLLECTIVES), help=f"comma-separated subset of {','.join(COLLECTIVES)}")
    ap.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated subset of bf16,fp32")
    ap.add_argument("--warmup", type=int, default=5, help="untimed repeats per point (default 5)")
    ap.add_argument("--iters", type=int, default=20, help="timed repeats per point; the median is reported")
    ap.add_argument("--world", type=int, default=0, help="GPUs to use (default: all visible)")
    ap.add_argument("--timeout", type=float, default=300.0, help="communicator timeout in seconds")
    ap.add_argument("--no-torch", action="store_true", help="skip the torch.distributed peer")
    ap.add_argument("--mode", choices=("blocking", "nonblocking"),
                    help="lowgrad's NCCL mode (default: LOWGRAD_NCCL_BLOCKING, non-blocking when unset)")
    ap.add_argument("--json", metavar="PATH", help=output_help("nccl_bench.json"))
    args = ap.parse_args(argv)

    ops = [o for o in args.ops.split(",") if o]
    dtypes = [d for d in args.dtypes.split(",") if d]
    bad = [o for o in ops if o not in COLLECTIVES] + [d for d in dtypes if d not in DTYPES]
    if bad or args.factor < 2 or args.min_bytes <= 0 or args.max_bytes < args.min_bytes:
        ap.error(f"bad arguments: {bad or 'sizes/factor'}")
    if args.world < 0:
        ap.error("--world must be at least 1 (0: every visible GPU)")
    args.json = output_path("nccl_bench.json", args.json)

    import lowgrad as lg
    from lowgrad.cuda import nccl
    from lowgrad.cuda.communicator import BLOCKING_ENV, blocking_mode

    if args.mode is not None:  # the communicators run_threads makes read it
        os.environ[BLOCKING_ENV] = "1" if args.mode == "blocking" else "0"
    mode = "blocking" if blocking_mode() else "nonblocking"
    require_cuda(max(1, args.world))
    world = args.world or lg.device_count()
    cfg = {"world": world, "ops": ops, "dtypes": dtypes, "sizes": sizes(args.min_bytes, args.max_bytes, args.factor),
           "warmup": args.warmup, "iters": args.iters, "timeout": args.timeout}
    print(f"lowgrad NCCL bench: world {world}, {mode} mode, NCCL {'.'.join(map(str, nccl.version()))} "
          f"({nccl.library_path()})")
    ours = run_lowgrad(cfg)
    theirs: list[dict[str, Any]] | None = None
    torch_note = "skipped (--no-torch)" if args.no_torch else "not installed"
    if not args.no_torch and importlib.util.find_spec("torch") is not None:
        got = run_torch(cfg)
        if isinstance(got, str):
            torch_note = f"failed: {got}"
        else:
            theirs, torch_note = got, "ok"
    rows = merge(ours, theirs, world)
    print(table(rows))
    print(f"torch peer: {torch_note}; ratio = torch ms / lowgrad ms (= lowgrad busbw / torch busbw)")
    with open(args.json, "w") as f:
        json.dump({"world": world, "mode": mode, "nccl": nccl.version(), "nccl_library": nccl.library_path(),
                   "torch": torch_note, "rows": rows}, f, indent=1)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run("nccl_bench", main))
