"""Kernel bandwidth, launch overhead and NVRTC compile times, against the copy bandwidth.

For each kernel and size: the median time (CUDA events between back-to-back launches on one
stream, after warm-up, >= 20 repeats, rotating >= 3 input sets when the data is smaller than
4x L2), the bytes moved (each input read once, each output written once), GB/s, and the ratio
to the device-to-device copy bandwidth (cuMemcpyAsync of 2 GiB through lowgrad.ops.copy,
read + write) measured in the same run. Pinned-destination SR is compared with the pinned
H2D + D2H copy bandwidths. Also: host launch overhead (lowgrad.ops.add_sr vs the bare
Kernel.launch), cold/warm NVRTC times (fresh LOWGRAD_CACHE_DIR, subprocesses), a grid-size sweep,
and a PyTorch peer where torch is installed. A failing case prints its error; the rest run.

    PYTHONPATH=. python tools/bench_kernels.py [--json PATH] [--device 0] [--repeats 20]
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))
from _cli import CannotRun, Parser, output_help, output_path, require_cuda, run  # noqa: E402

GiB, MiB = 1 << 30, 1 << 20
TARGETS = (  # (result key, comparison, bound, description), from the issue
    ("add_sr bf16 2^28", ">=", 0.95, "add_sr bf16 2^28 / copy bw"),
    ("reduce_sr bf16 8 shards", ">=", 0.95, "reduce_sr bf16 8 shards / copy bw"),
    ("add_sr pinned dst 2^26", ">=", 0.90, "pinned add_sr / (H2D + D2H) bw"),
    ("launch_us", "<=", 4.0, "ops.add_sr launch overhead (us)"),
    ("cold_compile_s", "<=", 3.0, "cold NVRTC compile (s)"),
    ("warm_load_s", "<=", 0.050, "warm cache load + cuModuleLoadData (s)"),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser("bench_kernels", description=__doc__.split("\n\n")[0] + " Needs an NVIDIA GPU.",
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help=output_help("bench_kernels.json"))
    p.add_argument("--device", type=int, default=0, help="GPU ordinal")
    p.add_argument("--repeats", type=int, default=20, help="timed repeats per case (at least 20)")
    p.add_argument("--launches", type=int, default=10_000, help="calls for the launch-overhead measurement")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch peer")
    p.add_argument("--no-compile", action="store_true", help="skip the NVRTC cold/warm timings")
    args = p.parse_args(argv)
    if args.device < 0 or args.launches < 1:
        p.error("--device must be at least 0 and --launches at least 1")
    return args


class Bench:
    """One device, one stream, the copy bandwidths, and every result so far."""

    def __init__(self, lg: Any, device: int, repeats: int) -> None:
        self.lg = lg
        self.dev = lg.Device(device)
        self.s = self.dev.stream()
        self.repeats = max(20, repeats)
        self.results: dict[str, Any] = {"device": {"name": self.dev.name, "arch": self.dev.arch,
                                                   "sm_count": self.dev.sm_count, "l2_bytes": self.dev.l2_bytes,
                                                   "total_memory": self.dev.total_memory},
                                        "cases": {}, "errors": {}}
        self.l2 = self.dev.l2_bytes
        self._pad: tuple[Any, Any] | None = None
        self.copy_bw = math.nan
        self.pinned_bw = math.nan
        self._chunks: dict[str, Any] = {}

    # ---- helpers ---------------------------------------------------------------------------
    def alloc(self, n: int, dtype: Any, kind: str = "device") -> Any:
        return self.dev.alloc(n, dtype, kind=kind, name="bench")

    def randomize(self, t: Any) -> Any:
        """Fill ``t`` with random non-zero values (a 16 Mi-element random chunk, tiled by copies)."""
        import numpy as np
        lg = self.lg
        chunk = self._chunks.get(t.dtype.name)
        if chunk is None:
            rng = np.random.default_rng(1234)
            x = (rng.standard_normal(1 << 24) * 0.25 + 0.5).astype(np.float32).astype(t.dtype.np)
            chunk = self._chunks[t.dtype.name] = lg.from_numpy(x, self.dev, name="bench_chunk")
        flat = t.flat()
        for off in range(0, t.numel, chunk.numel):
            m = min(chunk.numel, t.numel - off)
            if t.kind == "device":
                lg.ops.copy(flat.view(off, m), chunk.view(0, m), stream=self.s)
            else:
                flat.view(off, m).numpy()[:] = chunk.view(0, m).numpy()
        self.s.synchronize()
        return t

    def n_sets(self, set_bytes: int) -> int:
        """Input sets to rotate so that the data of one pass does not sit in L2."""
        return 1 if set_bytes >= 4 * self.l2 else min(16, max(3, math.ceil(4 * self.l2 / set_bytes)))

    def pad(self, stream: int) -> None:
        """~2.5 ms of copies, so the host gets ahead of the GPU before the first timed event."""
        if self._pad is not None:
            for _ in range(2):
                self.lg.ops.copy(self._pad[1], self._pad[0], stream=stream)

    def time_ms(self, fns: Sequence[Callable[[], object]], reps: int | None = None, warmup: int = 3) -> float:
        """Median ms of one call, events recorded between back-to-back calls on ``self.s``."""
        reps = reps or self.repeats
        for i in range(warmup):
            fns[i % len(fns)]()
        self.pad(self.s.handle)
        evs = [self.dev.event(timing=True) for _ in range(reps + 1)]
        evs[0].record(self.s)
        for i in range(reps):
            fns[i % len(fns)]()
            evs[i + 1].record(self.s)
        evs[-1].synchronize()
        return statistics.median(evs[i].elapsed_ms(evs[i + 1]) for i in range(reps))

    def record(self, key: str, n: int, nbytes: int, ms: float, peer_bw: float | None = None,
               extra: dict[str, Any] | None = None) -> None:
        bw = nbytes / (ms / 1e3)
        ref = self.copy_bw if peer_bw is None else peer_bw
        row = {"elements": n, "bytes": nbytes, "median_ms": ms, "GBps": bw / 1e9, "ratio": bw / ref,
               "vs": "copy" if peer_bw is None else "pinned H2D+D2H", **(extra or {})}
        self.results["cases"][key] = row
        print(f"{key:<34} {n:>12,} {nbytes / MiB:>10.1f} {ms:>10.4f} {bw / 1e9:>9.1f} {row['ratio']:>7.3f}",
              flush=True)

    def case(self, key: str, fn: Callable[[], None]) -> None:
        """Run one case; an exception is printed and recorded, and the run goes on."""
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - a benchmark reports and continues
            self.results["errors"][key] = f"{type(exc).__name__}: {exc}"
            print(f"{key:<34} FAILED: {type(exc).__name__}: {exc}", flush=True)
            traceback.print_exc(limit=3, file=sys.stdout)
        finally:
            import gc
            gc.collect()

    # ---- ceilings ----------------------------------------------------------------------------
    def copy_bandwidths(self) -> None:
        lg = self.lg
        n = 2 * GiB
        a, b = self.alloc(n, lg.byte), self.alloc(n, lg.byte)
        lg.ops.fill_zero(a, stream=self.s)
        self._pad = (a, b)  # kept: also the pad of every timed case
        ms = self.time_ms([lambda: lg.ops.copy(b, a, stream=self.s)], warmup=2)
        self.copy_bw = 2 * n / (ms / 1e3)
        m = GiB
        p = self.alloc(m, lg.byte, kind="pinned")
        d = a.view(0, m)
        h2d = m / (self.time_ms([lambda: lg.ops.copy(d, p, stream=self.s)], warmup=1) / 1e3)
        d2h = m / (self.time_ms([lambda: lg.ops.copy(p, d, stream=self.s)], warmup=1) / 1e3)
        bidir = self.bidirectional(p, d)
        p.close()
        self.pinned_bw = h2d + d2h
        self.results["copy"] = {"d2d_bytes": n, "d2d_GBps": self.copy_bw / 1e9, "h2d_GBps": h2d / 1e9,
                                "d2h_GBps": d2h / 1e9, "pinned_sum_GBps": self.pinned_bw / 1e9,
                                "pinned_bidirectional_GBps": bidir / 1e9}
        print(f"copy bandwidth: D2D {self.copy_bw / 1e9:.1f} GB/s (read+write of 2 GiB), "
              f"pinned H2D {h2d / 1e9:.1f} + D2H {d2h / 1e9:.1f} = {self.pinned_bw / 1e9:.1f} GB/s; "
              f"H2D and D2H at the same time (two streams, copy engines) {bidir / 1e9:.1f} GB/s", flush=True)

    def bidirectional(self, p: Any, d: Any) -> float:
        """Bytes/s of an H2D and a D2H copy (each half of ``p``) running at once on two streams."""
        lg = self.lg
        half = p.nbytes // 2
        s1, s2 = self.dev.stream(), self.dev.stream()
        e0, e1, e2 = self.dev.event(timing=True), self.dev.event(), self.dev.event()
        times = []
        for _ in range(6):
            e0.record(self.s)
            s1.wait(e0), s2.wait(e0)
            lg.ops.copy(d.view(0, half), p.view(0, half), stream=s1)
            lg.ops.copy(p.view(half, half), d.view(half, half), stream=s2)
            e1.record(s1), e2.record(s2)
            self.s.wait(e1), self.s.wait(e2)
            end = self.dev.event(timing=True).record(self.s)
            end.synchronize()
            times.append(e0.elapsed_ms(end) / 1e3)
        return 2 * half / statistics.median(times[1:])

    # ---- kernels -----------------------------------------------------------------------------
    def add_sr(self, key: str, n: int, b_dtype: Any, kind: str = "device", peer_bw: float | None = None) -> None:
        lg = self.lg
        isz = lg.bf16.itemsize
        set_bytes = n * (isz + b_dtype.itemsize)
        k = 1 if kind != "device" else self.n_sets(set_bytes)
        sets = [(self.randomize(self.alloc(n, lg.bf16, kind)), self.randomize(self.alloc(n, b_dtype)))
                for _ in range(k)]
        fns = [lambda a=a, b=b, i=i: lg.ops.add_sr(a, a, b, seed=i, stream=self.s) for i, (a, b) in enumerate(sets)]
        ms = self.time_ms(fns)
        if kind == "device":
            self.record(key, n, n * (2 * isz + b_dtype.itemsize), ms, extra={"sets": k})
        else:  # PCIe traffic: the destination read and written over the bus
            self.record(key, n, 2 * n * isz, ms, peer_bw=peer_bw, extra={"sets": k, "dst_kind": kind})

    def reduce_sr(self, key: str, n: int, shards: int) -> None:
        lg = self.lg
        isz = lg.bf16.itemsize
        set_bytes = n * isz * (shards + 1)
        k = self.n_sets(set_bytes)
        sets = [(self.randomize(self.alloc(n, lg.bf16)), self.randomize(self.alloc(n * shards, lg.bf16)))
                for _ in range(k)]
        fns = [lambda d=d, s=s, i=i: lg.ops.reduce_sr(d, s, shards, skip=-1, scale=1.0 / shards, accumulate=True,
                                                      seed=i, stream=self.s) for i, (d, s) in enumerate(sets)]
        ms = self.time_ms(fns)
        self.record(key, n, n * isz * (shards + 2), ms, extra={"sets": k, "skip": -1, "accumulate": True})

    def fill_zero(self, n: int) -> None:
        lg = self.lg
        t = self.alloc(n, lg.bf16)
        ms = self.time_ms([lambda: lg.ops.fill_zero(t, stream=self.s)])
        self.record(f"fill_zero bf16 2^{n.bit_length() - 1}", n, t.nbytes, ms)

    def norm_squared(self, n: int, x_dtype: Any, out_dtype: Any) -> None:
        lg = self.lg
        xs = [self.randomize(self.alloc(n, x_dtype)) for _ in range(self.n_sets(n * x_dtype.itemsize))]
        out = self.alloc(1, out_dtype)
        ms = self.time_ms([functools.partial(lg.ops.norm_squared, x, out, stream=self.s) for x in xs])
        self.record(f"norm_squared {x_dtype.name}->{out_dtype.name} 2^{n.bit_length() - 1}", n,
                    n * x_dtype.itemsize, ms, extra={"sets": len(xs)})

    def grid_sweep(self, n: int) -> None:
        lg = self.lg
        a, b = self.randomize(self.alloc(n, lg.bf16)), self.randomize(self.alloc(n, lg.bf16))
        kern = self.dev.kernels
        saved = kern.max_grid
        rows = []
        try:
            for mult in (2, 4, 8, 16, 32, 64):
                kern.max_grid = self.dev.sm_count * mult
                ms = self.time_ms([lambda: lg.ops.add_sr(a, a, b, seed=7, stream=self.s)])
                bw = 3 * n * 2 / (ms / 1e3)
                rows.append({"sm_mult": mult, "max_grid": kern.max_grid, "median_ms": ms, "GBps": bw / 1e9,
                             "ratio": bw / self.copy_bw})
                print(f"  max_grid = {mult:>2} x SMs = {kern.max_grid:>6}: {ms:.4f} ms  {bw / 1e9:8.1f} GB/s "
                      f"ratio {bw / self.copy_bw:.3f}", flush=True)
        finally:
            kern.max_grid = saved
            self.results["grid_sweep"] = {"case": f"add_sr bf16 2^{n.bit_length() - 1}", "default": saved,
                                          "rows": rows}

    def launch_overhead(self, calls: int) -> None:
        import numpy as np
        lg = self.lg
        from lowgrad.contracts.kernel_source import kernel_for
        n = 1024
        a = lg.from_numpy(np.ones(n, np.float32).astype(lg.bf16.np), self.dev, name="bench")
        b = lg.from_numpy(np.full(n, 1e-3, np.float32).astype(lg.bf16.np), self.dev, name="bench")
        s = self.s
        h = s.handle
        kern = self.dev.kernels
        k = kern.kernel(kernel_for("add_sr", lg.bf16, lg.bf16, lg.bf16))
        grid, pa, pb = kern.grid(n, k.block), a.ptr, b.ptr

        # Host cost only: the GPU is first kept busy (a queue of large add_sr kernels, ~4 ms) so
        # the timed launches just queue behind it; otherwise a tiny kernel's GPU time (a few us)
        # paces the host once the launch queue fills, and that is what would be measured.
        big_n = 1 << 27
        ba = self.dev.alloc(big_n, lg.bf16, name="bench")
        bb = self.dev.alloc(big_n, lg.bf16, name="bench")
        lg.ops.fill_zero(ba, stream=s), lg.ops.fill_zero(bb, stream=s)
        bound = lg.ops.bind_add_sr(a, a, b)
        batch = 500

        def timed(issue: Any) -> float:
            total, done = 0.0, 0
            while done < calls:
                for _ in range(20):
                    lg.ops.add_sr(ba, ba, bb, 1.0, 1, 0, h)
                t0 = time.perf_counter()
                issue(batch, done)
                total += time.perf_counter() - t0
                done += batch
                s.synchronize()
            return total / done

        def via_ops(k_: int, base: int) -> None:
            add = lg.ops.add_sr
            for i in range(base, base + k_):
                add(a, a, b, 1.0, i, 0, s)

        def via_bound(k_: int, base: int) -> None:
            for i in range(base, base + k_):
                bound(i, h)

        def via_kernel(k_: int, base: int) -> None:
            launch = k.launch
            for i in range(base, base + k_):
                launch(grid, h, pa, pa, pb, 1.0, i, 0, n)

        ops_s, bound_s, bare_s = timed(via_ops), timed(via_bound), timed(via_kernel)
        gpu_ms = self.time_ms([lambda: lg.ops.add_sr(a, a, b, seed=1, stream=s)], reps=200)
        ba.close(), bb.close()
        self.results["launch_us"] = ops_s * 1e6
        self.results["launch"] = {"elements": n, "calls": calls, "ops_add_sr_us": ops_s * 1e6,
                                  "bound_add_sr_us": bound_s * 1e6, "bare_kernel_launch_us": bare_s * 1e6,
                                  "validation_us": (ops_s - bare_s) * 1e6, "gpu_kernel_us": gpu_ms * 1e3}
        print(f"launch overhead, host time with the GPU busy (add_sr, {n} elements, {calls} calls): "
              f"ops.add_sr {ops_s * 1e6:.2f} us/call, bound (ops.bind_add_sr) {bound_s * 1e6:.2f} us, bare "
              f"Kernel.launch {bare_s * 1e6:.2f} us (validation {1e6 * (ops_s - bare_s):.2f} us); GPU time per "
              f"tiny kernel back to back {gpu_ms * 1e3:.2f} us", flush=True)

    # ---- NVRTC -------------------------------------------------------------------------------
    def compile_times(self) -> None:
        arch, ordinal = self.dev.arch, self.dev.ordinal
        env = dict(os.environ)
        env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        with tempfile.TemporaryDirectory(prefix="lowgrad_bench_cache_") as cache:
            env["LOWGRAD_CACHE_DIR"] = cache
            cold = _subprocess_json(_COLD, [arch], env)
            warm_compile = _subprocess_json(_COLD, [arch], env)
            warm = _subprocess_json(_WARM, [str(ordinal)], env)
        self.results["cold_compile_s"] = cold["compile_s"]
        self.results["warm_load_s"] = warm["kernels_s"]
        self.results["compile"] = {"arch": arch, "cold_compile_s": cold["compile_s"], "modules": cold["modules"],
                                   "warm_compile_kernels_s": warm_compile["compile_s"],
                                   "warm_kernels_load_s": warm["kernels_s"], "import_s": cold["import_s"]}
        print(f"NVRTC: cold compile_kernels({arch}) {cold['compile_s']:.3f} s ({cold['modules']} modules); warm "
              f"compile_kernels {warm_compile['compile_s'] * 1e3:.1f} ms; warm device.kernels (cache + "
              f"cuModuleLoadData) {warm['kernels_s'] * 1e3:.1f} ms; import lowgrad {cold['import_s']:.3f} s",
              flush=True)

    # ---- PyTorch -----------------------------------------------------------------------------
    def torch_peer(self, n: int) -> None:
        import torch
        if not torch.cuda.is_available():
            raise RuntimeError("torch has no CUDA")
        self._torch_cases(torch, n)  # its two 2^28-element tensors are freed when it returns
        torch.cuda.empty_cache()

    def _torch_cases(self, torch: Any, n: int) -> None:
        """PyTorch's bf16 add (round to nearest) and an SR add from PyTorch ops, on ``n`` elements."""
        dev = torch.device("cuda", self.dev.ordinal)
        torch.cuda.set_device(dev)
        a = torch.randn(n, device=dev).to(torch.bfloat16)
        b = torch.randn(n, device=dev).to(torch.bfloat16)
        ts = torch.cuda.current_stream(dev)

        def timed(fn: Callable[[], None], reps: int) -> float:
            for _ in range(3):
                fn()
            self.pad(ts.cuda_stream)
            evs = [torch.cuda.Event(enable_timing=True) for _ in range(reps + 1)]
            evs[0].record(ts)
            for i in range(reps):
                fn()
                evs[i + 1].record(ts)
            evs[-1].synchronize()
            return statistics.median(evs[i].elapsed_time(evs[i + 1]) for i in range(reps))

        def sr_add() -> None:  # SR from PyTorch ops: fp32 sum + 16-bit noise, mask, exact convert
            bits = (a.float() + b.float()).view(torch.int32)
            bits.add_(torch.randint(0, 1 << 16, (n,), dtype=torch.int32, device=dev))
            bits.bitwise_and_(-65536)
            a.copy_(bits.view(torch.float32))

        nbytes = 3 * n * 2
        self.case("torch a.add_(b) bf16 2^28", lambda: self.record(
            f"torch a.add_(b) bf16 2^{n.bit_length() - 1}", n, nbytes, timed(lambda: a.add_(b), self.repeats),
            extra={"rounding": "nearest", "torch": torch.__version__}))
        self.case("torch SR ops bf16 2^28", lambda: self.record(
            f"torch SR ops bf16 2^{n.bit_length() - 1}", n, nbytes, timed(sr_add, self.repeats),
            extra={"rounding": "stochastic (torch ops)", "torch": torch.__version__}))

    # ---- summary -----------------------------------------------------------------------------
    def targets(self) -> None:
        rows = []
        print("\ntargets (from the issue):")
        for key, cmp, bound, desc in TARGETS:
            if key in self.results["cases"]:
                v = self.results["cases"][key]["ratio"]
            else:
                v = self.results.get(key)
            ok = None if v is None else (v >= bound if cmp == ">=" else v <= bound)
            rows.append({"target": desc, "key": key, "measured": v, "bound": bound, "cmp": cmp, "met": ok})
            shown = "n/a" if v is None else f"{v:.4g}"
            verdict = "n/a" if ok is None else ("MET" if ok else "MISSED")
            print(f"  {desc:<42} measured {shown:>10}  target {cmp} {bound:<6} {verdict}")
        self.results["targets"] = rows


_COLD = """
import json, sys, time
t0 = time.perf_counter()
import lowgrad
t1 = time.perf_counter()
mods = lowgrad.compile_kernels(sys.argv[1])
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "compile_s": t2 - t1, "modules": len(mods)}))
"""
_WARM = """
import json, sys, time
import lowgrad
dev = lowgrad.Device(int(sys.argv[1]))
dev.mem_info()
t0 = time.perf_counter()
dev.kernels
t1 = time.perf_counter()
print(json.dumps({"kernels_s": t1 - t0}))
"""


def _subprocess_json(code: str, args: list[str], env: dict[str, str]) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=300)
    if out.returncode:
        raise RuntimeError(f"subprocess failed ({out.returncode}): {out.stderr.strip()[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.json = output_path("bench_kernels.json", args.json)
    require_cuda()
    import lowgrad as lg

    if args.device >= lg.device_count():
        raise CannotRun(f"--device {args.device}: {lg.device_count()} GPU(s) visible")

    t_start = time.perf_counter()
    b = Bench(lg, args.device, args.repeats)
    print(f"{b.dev.name} ({b.dev.arch}, {b.dev.sm_count} SMs, L2 {b.l2 / MiB:.0f} MiB); repeats {b.repeats}",
          flush=True)
    b.case("kernels", lambda: b.dev.kernels)  # compile or load before anything is timed
    b.case("copy bandwidth", b.copy_bandwidths)
    print(f"\n{'case':<34} {'elements':>12} {'MiB moved':>10} {'median ms':>10} {'GB/s':>9} {'ratio':>7}")
    bf16, fp32 = lg.bf16, lg.fp32
    for e in (24, 26, 28):
        b.case(f"add_sr bf16 2^{e}", functools.partial(b.add_sr, f"add_sr bf16 2^{e}", 1 << e, bf16))
    b.case("add_sr fp32 b 2^28", lambda: b.add_sr("add_sr bf16+fp32 b 2^28", 1 << 28, fp32))
    b.case("reduce_sr bf16 8 shards", lambda: b.reduce_sr("reduce_sr bf16 8 shards", 1 << 25, 8))
    b.case("reduce_sr bf16 4 shards", lambda: b.reduce_sr("reduce_sr bf16 4 shards", 1 << 25, 4))
    b.case("fill_zero", lambda: b.fill_zero(1 << 28))
    b.case("norm_squared bf16", lambda: b.norm_squared(1 << 28, bf16, fp32))
    b.case("norm_squared fp32", lambda: b.norm_squared(1 << 27, fp32, lg.fp64))
    b.case("add_sr pinned dst 2^26", lambda: b.add_sr("add_sr pinned dst 2^26", 1 << 26, bf16, kind="pinned",
                                                      peer_bw=b.pinned_bw))
    if not args.no_torch:
        try:
            import torch  # noqa: F401
        except Exception as exc:  # noqa: BLE001 - absent, or a broken install
            print(f"PyTorch unavailable ({type(exc).__name__}: {exc}): no peer")
        else:
            b.case("torch peer", lambda: b.torch_peer(1 << 28))
    print("\ngrid-size sweep (add_sr bf16 2^28, dst=a):")
    b.case("grid sweep", lambda: b.grid_sweep(1 << 28))
    print()
    b.case("launch overhead", lambda: b.launch_overhead(args.launches))
    if not args.no_compile:
        b.case("compile times", b.compile_times)
    b.targets()
    b.results["wall_s"] = time.perf_counter() - t_start
    with open(args.json, "w") as f:
        json.dump(b.results, f, indent=2, default=str)
    print(f"\nwrote {args.json} ({b.results['wall_s']:.1f} s)")
    return 1 if b.results["errors"] else 0


if __name__ == "__main__":
    sys.exit(run("bench_kernels", main))
