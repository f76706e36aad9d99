#!/usr/bin/env python
"""A Qwen2-architecture transformer trained on the Python standard library's source (byte-level),
with PyTorch's own gradients or through lowgrad (lowgrad.torch).

Modes (``--mode``), each with AdamW, fp32 master weights, gradient clipping at ``--clip``:

- ``torch_fp32``: fp32 parameters and gradients, bf16 autocast for the compute;
- ``torch_bf16``: bf16 parameters, gradients accumulated by autograd in bf16 (round to nearest),
  fp32 master weights in the optimizer;
- ``lowgrad``: bf16 parameters, gradients through a lowgrad gradient manager (``--strategy``,
  SR into bf16 shards), :class:`lowgrad.torch.ShardOptimizer` with fp32 master weights.

Under torchrun (one process per GPU, ``torchrun --nproc-per-node N``) the ``lowgrad`` mode takes
its communicator from the launcher (:func:`lowgrad.from_env`), and two more modes run PyTorch's
own data parallelism for comparison: ``ddp`` (``DistributedDataParallel`` over the
``torch_bf16`` setup: bf16 parameters and gradients, fp32 master weights; its all-reduce only at
the last micro-step) and ``fsdp2`` (``fully_shard`` per decoder layer and at the root: fp32
sharded parameters, bf16 compute and gradient reduction, its reduce-scatter only at the last
micro-step). Backend ``nccl`` on GPUs, ``gloo`` on the CPU. Without a launcher ``--world N``
runs lowgrad's ranks as threads (``lowgrad.run_threads``; the host backend on the CPU). Each
rank reads its own micro-batches (seed + rank); rank 0 writes ``--json`` (its own loss).

The model is Qwen2.5-0.5B's architecture (``--size 0.5b``: hidden 896, 24 layers, 14/2 heads,
intermediate 4864) with a 256-symbol byte vocabulary and tied embeddings (0.36B parameters;
random initialisation — nothing is downloaded), or a tiny one for a CPU smoke run (``--size
tiny``). It runs on the GPU when there is one (lowgrad's CUDA backend), else on the CPU (the host
backend); the defaults follow the device (:data:`DEFAULTS`: the 0.5B model for 300 steps on a
GPU, the tiny one for a few seconds of training on the CPU). The loss of every step, the median
step time, PyTorch's peak memory and lowgrad's memory report go to ``--json``. The last line is
the verdict: PASS when every loss is finite and the loss fell (exit status 0), else FAIL (1); a
setup that cannot run (PyTorch or transformers missing, ``--profile`` without a GPU) is one line
on stderr and exit status 2.

``--stats PATH.jsonl`` (lowgrad mode) measures per-tensor gradient statistics inside the
accumulation (``attach(stats=True)``) and logs each step's norms per layer, the gradient noise
scale and the first non-finite value to a JSON-lines file (``lowgrad.diagnostics.StepLog``;
``tools/grad_report.py`` turns it into a table and plots). ``--inject-nan STEP:MICRO:PARAM``
writes one NaN into parameter PARAM's gradient at that micro-step of that step, to see the step
skipped and the report that names it.

    python3 examples/train_transformer.py --mode lowgrad --strategy scatter_reduce --steps 300 --json out.json
"""
from __future__ import annotations

import argparse
import cProfile
import json
import math
import os
import pstats
import statistics
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

try:
    import torch
except ImportError:  # main() says so in one line
    torch = None  # type: ignore[assignment]  # the module or None: main() checks before any use

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
from _cli import CannotRun, Parser, int_at_least, require_cuda, run  # first: says why lowgrad is missing

import lowgrad as lg
from lowgrad.diagnostics import StepLog
from lowgrad.managers import STRATEGIES

if torch is not None:
    import lowgrad.torch  # lowgrad.torch.attach

SIZES = {
    "0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_attention_heads": 14, "num_key_value_heads": 2,
             "num_hidden_layers": 24},
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
             "num_hidden_layers": 2},
}
# Defaults by device: on a GPU the 0.5B model's run of BENCHMARKS.md; on the CPU a tiny run of a
# few seconds, short enough for the test suite (the GPU's step counts and batches take minutes there).
DEFAULTS = {
    "cuda": {"size": "0.5b", "steps": 300, "micro_steps": 4, "batch": 8, "seq": 512, "log_every": 25},
    "host": {"size": "tiny", "steps": 30, "micro_steps": 2, "batch": 4, "seq": 64, "log_every": 10},
}


def corpus(limit: int = 64 << 20) -> torch.Tensor:
    """The standard library's .py files as one byte tensor (uint8 values as int64 tokens)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for p in sorted(root.rglob("*.py")):
        if "site-packages" in p.parts:
            continue
        data = p.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    if not chunks:
        raise FileNotFoundError(f"no .py files under {root}")
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).long()


def batches(text: torch.Tensor, batch: int, seq: int, seed: int) -> Any:
    g = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, text.numel() - seq - 1, (batch,), generator=g)
        window = torch.stack([text[s:s + seq + 1] for s in starts.tolist()])
        yield window[:, :-1], window[:, 1:]


def build(size: str, dtype: torch.dtype, device: torch.device, seed: int) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(vocab_size=256, tie_word_embeddings=True, max_position_embeddings=4096, **SIZES[size])
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg).to(device=device, dtype=dtype)


def train(comm: Any, args: argparse.Namespace) -> dict[str, Any]:
    cuda = getattr(comm.device, "backend", "host") == "cuda"
    device = torch.device("cuda", comm.device.ordinal) if cuda else torch.device("cpu")
    dtype = torch.float32 if args.mode in ("torch_fp32", "fsdp2") else torch.bfloat16
    model: Any = build(args.size, dtype, device, args.seed)  # ddp, fsdp2: wrapped, with their own methods
    params = [p for p in model.parameters() if p.requires_grad]
    kw = {"lr": args.lr, "weight_decay": args.weight_decay, "betas": (0.9, 0.95)}
    attached = masters = None
    opt: Any = None  # lowgrad's ShardOptimizer or torch's AdamW (their step() takes different arguments)
    if args.mode == "lowgrad":
        rounding = args.rounding if STRATEGIES[args.strategy].rounds() else None
        attached = lowgrad.torch.attach(model, comm, strategy=args.strategy, seed=args.seed, rounding=rounding,
                                        overlap=not args.no_overlap, stats=args.stats is not None)
        opt = lowgrad.torch.ShardOptimizer(attached, torch.optim.AdamW, master_weights=True, **kw)
    elif args.mode in ("torch_bf16", "ddp"):
        masters = [p.detach().float().clone().requires_grad_() for p in params]
        opt = torch.optim.AdamW(masters, **kw)
        if args.mode == "ddp":
            from torch.nn.parallel import DistributedDataParallel
            model = DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    elif args.mode == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        params = [p for p in model.parameters() if p.requires_grad]  # the sharded fp32 parameters
        opt = torch.optim.AdamW(params, **kw)
    else:
        opt = torch.optim.AdamW(params, **kw)
    data = batches(corpus(), args.batch, args.seq, args.seed + 1 + comm.rank)
    M, losses, times = args.micro_steps, [], []
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    prof, profiled, cprof = None, None, None
    host_s: list[float] = []  # lowgrad's host time per step (hooks and micro-step bookkeeping)
    phases = Phases(M, cuda)
    log = StepLog(args.stats, rank=comm.rank) if args.stats and attached is not None else None
    skipped: list[int] = []
    reports: list[str] = []
    inject = args.inject_nan
    if inject is not None and inject[2] not in dict(model.named_parameters()):
        raise CannotRun(f"--inject-nan: the model has no parameter {inject[2]!r} (e.g. "
                        f"{next(iter(dict(model.named_parameters())))!r})")
    for step in range(args.steps):
        host0 = attached.host_seconds if attached is not None else 0.0
        if args.profile and step == PROFILE_FROM:
            torch.cuda.synchronize(device) if cuda else None
            # GPU activity only: recording every operator on the host would make the run host-bound
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA if cuda
                                                      else torch.profiler.ProfilerActivity.CPU])
            prof.start()
        if args.cprofile and step == 2:
            cprof = cProfile.Profile()
            cprof.enable()
        t0 = time.perf_counter()
        phases.mark(0)
        total = torch.zeros((), device=device)
        for m in range(M):
            x, y = (t.to(device, non_blocking=True) for t in next(data))
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.mode == "torch_fp32"):
                logits = model(input_ids=x).logits
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, 256), y.reshape(-1)) / M
            phases.mark(1 + 2 * m)
            hook = None
            if inject is not None and (step, m) == inject[:2]:
                hook = dict(model.named_parameters())[inject[2]].register_hook(poison)
            if attached is not None:
                with attached.micro_step(m, M):
                    loss.backward()
            elif args.mode == "ddp" and m < M - 1:
                with model.no_sync():  # DDP's all-reduce at the last micro-step only
                    loss.backward()
            else:
                if args.mode == "fsdp2":
                    model.set_requires_gradient_sync(m == M - 1)
                loss.backward()
            if hook is not None:
                hook.remove()
            phases.mark(2 + 2 * m)
            total += loss.detach()
        if attached is not None:
            # the statistics' copy to the host is queued before the optimizer step, and read after
            # it: the optimizer's norm read has synced past the copy by then, so the reading costs
            # no sync of its own, and building and logging it on the host overlaps the optimizer's
            # kernels on the GPU
            reading = attached.read_stats() if log is not None else None
            if not opt.step(max_norm=args.clip):  # a non-finite gradient norm: nothing changed
                skipped.append(step)
            if log is not None and reading is not None:
                record = log.record(reading.result(), skipped=step in skipped)
                if record["nonfinite"] is not None:
                    reports.append(record["nonfinite"]["message"])
        else:
            torch.nn.utils.clip_grad_norm_(params, args.clip)
            if masters is not None:
                for p, mp in zip(params, masters):
                    assert p.grad is not None  # backward gave every trainable parameter one
                    mp.grad = p.grad.float()
            opt.step()
            if masters is not None:
                with torch.no_grad():
                    for p, mp in zip(params, masters):
                        p.copy_(mp)
                        mp.grad = None
            model.zero_grad(set_to_none=True)
        phases.mark(2 * M + 1)
        losses.append(float(total))  # one host sync per step, in every mode
        phases.collect()
        times.append(time.perf_counter() - t0)
        if attached is not None:
            host_s.append(attached.host_seconds - host0)
        if cprof is not None and step == 1 + args.cprofile:  # started at step 2 when --cprofile is given
            cprof.disable()
            pstats.Stats(cprof).sort_stats("tottime").print_stats(40)
        if prof is not None and step == PROFILE_FROM + PROFILE_STEPS - 1:
            prof.stop()
            profiled, prof = gpu_overlap(prof, PROFILE_STEPS), None
            print(json.dumps(profiled, indent=1), flush=True)
        if args.log_every and comm.rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            # once, by rank 0 (whose --json and verdict these are); its loss is its own micro-batches'
            ranks = f"  (rank 0 of {comm.world})" if comm.world > 1 else ""
            print(f"step {step:5d}  loss {losses[-1]:.4f}  {times[-1] * 1e3:.1f} ms{ranks}", flush=True)
    how = f"/{args.strategy}" + (f"/{attached.gm.rounding}" if attached.gm.rounding else "") if attached else ""
    label = f"{args.mode}{how}{' no-overlap' if attached and args.no_overlap else ''} seed {args.seed}"
    if comm.world > 1:
        label += f" world {comm.world}"
    out = {"label": label, "mode": args.mode, "world": comm.world, "rank": comm.rank,
           "strategy": args.strategy if attached is not None else None,
           "rounding": attached.gm.rounding if attached is not None else None,
           "size": args.size,
           "params": sum(p.numel() for p in params), "seed": args.seed, "micro_steps": M, "batch": args.batch,
           "seq": args.seq, "loss": losses,
           "step_ms_median": 1e3 * statistics.median(times[min(2, len(times) - 1):]),
           "torch_peak_mib": torch.cuda.max_memory_allocated(device) / 2**20 if cuda else None,
           "lowgrad_host_ms_median": 1e3 * statistics.median(host_s[min(2, len(host_s) - 1):]) if host_s else None,
           "lowgrad": attached.gm.memory_report().as_dict() if attached is not None else None,
           "phases": phases.summary(skip=min(2, args.steps - 1)),
           "device": "cuda" if cuda else "cpu", "date": time.strftime("%Y-%m-%d"), "profile": profiled,
           "skipped_steps": skipped, "nonfinite_reports": reports, "stats_log": args.stats if log else None}
    if log is not None:
        log.close()
    if attached is not None:
        opt.close()
        attached.close()
    return out


def poison(grad: torch.Tensor) -> torch.Tensor:
    """The gradient with a NaN in its first element (``--inject-nan``)."""
    grad = grad.clone()
    grad.view(-1)[0] = math.nan
    return grad


PROFILE_FROM, PROFILE_STEPS = 3, 3


class Phases:
    """Where a step's time goes: the host time and the GPU time of each phase (forward of
    micro-step m, its backward with lowgrad's hooks, the optimizer), from a host clock and a CUDA
    event on PyTorch's current stream at the end of each phase. ``lag`` at a phase's end is how
    far the GPU finished it after the host had queued it (the GPU is idle at a step's start, so
    both clocks start together): near 0 the GPU was waiting for the host (host-bound there),
    large it was the GPU that set the pace."""

    def __init__(self, micro_steps: int, cuda: bool) -> None:
        self.names = [f"{what}{m}" for m in range(micro_steps) for what in ("forward", "backward")] + ["optimizer"]
        self.host = [0.0] * (len(self.names) + 1)
        self.events = [torch.cuda.Event(enable_timing=True) for _ in self.host] if cuda else None
        self.rows: list[tuple[list[float], list[float] | None, list[float] | None]] = []

    def mark(self, i: int) -> None:
        self.host[i] = time.perf_counter()
        if self.events is not None:
            self.events[i].record()

    def collect(self) -> None:
        """After the step's host sync: this step's phase times (ms)."""
        h = [1e3 * (b - a) for a, b in zip(self.host, self.host[1:])]
        g = lag = None
        if self.events is not None:
            self.events[-1].synchronize()
            at = [self.events[0].elapsed_time(e) for e in self.events]
            g = [b - a for a, b in zip(at, at[1:])]
            lag = [t - 1e3 * (h_end - self.host[0]) for t, h_end in zip(at[1:], self.host[1:])]
        self.rows.append((h, g, lag))

    def summary(self, skip: int) -> dict[str, Any]:
        """Medians over the steps after the first ``skip``: per phase, and forward/backward summed."""
        rows = self.rows[skip:]
        out: dict[str, Any] = {}
        for k, key in enumerate(("host_ms", "gpu_ms", "lag_ms")):
            if not rows or rows[0][k] is None:
                continue
            med = [statistics.median(r[k][i] for r in rows) for i in range(len(self.names))]  # type: ignore[index]
            out[key] = dict(zip(self.names, med))
            if key != "lag_ms":
                out[key]["forward"] = sum(v for n, v in zip(self.names, med) if n.startswith("forward"))
                out[key]["backward"] = sum(v for n, v in zip(self.names, med) if n.startswith("backward"))
        return out


def gpu_overlap(prof: Any, steps: int) -> dict[str, Any]:
    """From a profiler trace of ``steps`` steps: GPU time per stream (kernels and copies, ms per
    step), and how much of the work on the side streams (lowgrad's: the manager's exchange and
    accumulation) ran while the busiest stream (PyTorch's compute) was also busy — the part of
    the manager's GPU work hidden behind backward."""
    import tempfile
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    spans: dict[int, list[tuple[float, float, str]]] = {}
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e:
            spans.setdefault(int(e.get("args", {}).get("stream", -1)), []).append(
                (float(e["ts"]), float(e["ts"]) + float(e["dur"]), e.get("name", "")))
    if not spans:
        return {"streams": {}}
    busy = {s: sum(b - a for a, b, _ in v) for s, v in spans.items()}
    main = max(busy, key=lambda s: busy[s])
    merged: list[list[float]] = []
    for a, b, _ in sorted(spans[main]):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    starts = [m[0] for m in merged]

    def covered(a: float, b: float) -> float:
        import bisect
        i, got = max(bisect.bisect_right(starts, a) - 1, 0), 0.0
        while i < len(merged) and merged[i][0] < b:
            got += max(0.0, min(b, merged[i][1]) - max(a, merged[i][0]))
            i += 1
        return got
    side = [(a, b, n) for s, v in spans.items() if s != main for a, b, n in v]
    side_total = sum(b - a for a, b, _ in side)
    hidden = sum(covered(a, b) for a, b, _ in side)
    names: dict[str, float] = {}
    for a, b, n in side:
        names[n[:60]] = names.get(n[:60], 0.0) + (b - a)
    lo = min(a for v in spans.values() for a, _, _ in v)
    hi = max(b for v in spans.values() for _, b, _ in v)
    return {"steps": steps, "main_stream": main, "gpu_span_ms_per_step": (hi - lo) / 1e3 / steps,
            "stream_busy_ms_per_step": {str(s): t / 1e3 / steps for s, t in sorted(busy.items())},
            "side_ms_per_step": side_total / 1e3 / steps,
            "side_hidden_fraction": hidden / side_total if side_total else None,
            "side_kernels_ms_per_step": {n: t / 1e3 / steps for n, t in sorted(names.items(), key=lambda x: -x[1])[:8]}}


def save_grads(comm: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Real gradients for tools/accuracy.py: the fp32 gradients of ``--micro-steps`` micro-batches
    of text on the model as initialised (no update between them, as within one step), each scaled
    by 1/M as in training, sampled at ``--save-elems`` fixed positions; saved as (M, n) float32."""
    cuda = getattr(comm.device, "backend", "host") == "cuda"
    device = torch.device("cuda", comm.device.ordinal) if cuda else torch.device("cpu")
    model = build(args.size, torch.float32, device, args.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    total = sum(p.numel() for p in params)
    pick = torch.randperm(total, generator=torch.Generator().manual_seed(args.seed))[:args.save_elems].sort().values
    starts = [0]
    for p in params:
        starts.append(starts[-1] + p.numel())
    per_param = [(p, (pick[(pick >= a) & (pick < b)] - a).to(device)) for p, a, b in zip(params, starts, starts[1:])]
    data, M = batches(corpus(), args.batch, args.seq, args.seed + 1), args.micro_steps
    rows = torch.empty((M, pick.numel()), dtype=torch.float32, device=device)
    for m in range(M):
        x, y = (t.to(device) for t in next(data))
        model.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(input_ids=x).logits.float().reshape(-1, 256), y.reshape(-1))
        (loss / M).backward()
        grads = []
        for p, i in per_param:
            assert p.grad is not None  # backward gave every trainable parameter one
            grads.append(p.grad.reshape(-1)[i])
        torch.cat(grads, out=rows[m])
    import numpy as np
    np.save(args.save_grads, rows.cpu().numpy())
    return {"saved": args.save_grads, "micro_steps": M, "elements": int(pick.numel()), "params": total}


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, str]:
    """The arguments (sizes defaulted by device, :data:`DEFAULTS`) and the lowgrad backend,
    "cuda" where lowgrad sees a GPU, else "host". :class:`CannotRun` for a setup that cannot
    run here; argument errors are one line (exit status 2)."""
    def by_device(key: str) -> str:
        return f"default: {DEFAULTS['cuda'][key]} on a GPU, {DEFAULTS['host'][key]} on the CPU"
    p = Parser("train_transformer",
               description=__doc__.split("\n\n")[0] + " On a GPU when there is one, else on the CPU.")
    p.add_argument("--mode", choices=("torch_fp32", "torch_bf16", "lowgrad", "ddp", "fsdp2"), default="lowgrad",
                   help="ddp, fsdp2: PyTorch's data parallelism, under torchrun")
    p.add_argument("--world", type=int_at_least(1), default=1,
                   help="without a launcher: lowgrad's ranks as threads (run_threads); under torchrun: its world")
    p.add_argument("--timeout", type=float, default=300.0, help="lowgrad's communicator timeout (seconds)")
    p.add_argument("--strategy", choices=tuple(STRATEGIES), default="scatter_reduce")
    p.add_argument("--rounding", choices=tuple(lg.ROUNDINGS), default=lg.DEFAULT_ROUNDING,
                   help="the rounding into the bf16 shards (a strategy that rounds nothing ignores it)")
    p.add_argument("--no-overlap", action="store_true",
                   help="lowgrad: deliver each micro-step's gradients at its end (attach(overlap=False))")
    p.add_argument("--size", choices=tuple(SIZES), help=by_device("size"))
    p.add_argument("--steps", type=int_at_least(1), help=by_device("steps"))
    p.add_argument("--micro-steps", type=int_at_least(1), help=by_device("micro_steps"))
    p.add_argument("--batch", type=int_at_least(1), help=by_device("batch"))
    p.add_argument("--seq", type=int_at_least(1), help=by_device("seq"))
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, help=by_device("log_every") + "; 0: no step lines")
    p.add_argument("--json", default=None)
    p.add_argument("--stats", metavar="PATH.jsonl",
                   help="lowgrad: measure gradient statistics and log each step's to this JSON-lines file")
    p.add_argument("--inject-nan", metavar="STEP:MICRO:PARAM",
                   help="a NaN in parameter PARAM's gradient at micro-step MICRO of step STEP")
    p.add_argument("--profile", action="store_true",
                   help=f"profile steps {PROFILE_FROM}..{PROFILE_FROM + PROFILE_STEPS - 1}: GPU time per stream and "
                        "how much of the side streams' work (lowgrad's) overlaps the compute stream (needs a GPU)")
    p.add_argument("--cprofile", type=int, default=0, metavar="STEPS",
                   help="Python's profiler over STEPS steps from step 2: where the host time goes (every thread "
                        "where the profiler sees them, autograd's hooks included on Python 3.12+)")
    p.add_argument("--save-grads", metavar="PATH.npy",
                   help="instead of training: save --micro-steps micro-batches' fp32 gradients for tools/accuracy.py")
    p.add_argument("--save-elems", type=int_at_least(1), default=65536,
                   help="with --save-grads: sampled gradient elements")
    args = p.parse_args(argv)
    if torch is None:
        raise CannotRun('needs PyTorch: pip install ".[torch]"')
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise CannotRun("needs Hugging Face transformers (the Qwen2 model): pip install transformers") from None
    backend = "cuda" if lg.device_count() > 0 else "host"
    for key, value in DEFAULTS[backend].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.profile and backend != "cuda":  # it measures the GPU's streams
        require_cuda()
    if backend == "cuda" and not torch.cuda.is_available():
        raise CannotRun(f"lowgrad sees {lg.device_count()} GPU(s) but PyTorch has no CUDA (torch {torch.__version__}): "
                        "install a CUDA build of PyTorch")
    if args.profile and args.steps < PROFILE_FROM + PROFILE_STEPS:
        p.error(f"--profile needs --steps >= {PROFILE_FROM + PROFILE_STEPS}")
    if args.stats and args.mode != "lowgrad":
        p.error("--stats measures lowgrad's gradients: it needs --mode lowgrad")
    launched = launched_world()
    if args.mode in ("ddp", "fsdp2") and launched is None:
        raise CannotRun(f"--mode {args.mode} runs under torchrun: torchrun --nproc-per-node N "
                        f"examples/train_transformer.py --mode {args.mode} ...")
    if launched is not None and args.world not in (1, launched):
        p.error(f"--world {args.world}: under torchrun the world is WORLD_SIZE={launched}")
    if launched is not None and args.mode in ("torch_fp32", "torch_bf16") and launched > 1:
        p.error(f"--mode {args.mode} is one process: under torchrun use ddp, fsdp2 or lowgrad")
    if launched is None and args.world > 1 and args.mode != "lowgrad":
        p.error("--world N (ranks as threads) needs --mode lowgrad")
    if launched is not None and launched > 1 and backend == "host" and args.mode == "lowgrad":
        raise CannotRun("lowgrad's host backend runs its ranks as threads of one process: --world N without "
                        "torchrun")
    if args.inject_nan is not None:
        step, micro, name = (args.inject_nan.split(":", 2) + ["", ""])[:3]
        if not (step.isdigit() and micro.isdigit() and name):
            p.error(f"--inject-nan takes STEP:MICRO:PARAM, got {args.inject_nan!r}")
        args.inject_nan = (int(step), int(micro), name)
    for opt, out in (("--json", args.json), ("--save-grads", args.save_grads), ("--stats", args.stats)):
        if out and not os.path.isdir(os.path.dirname(os.path.abspath(out))):
            raise CannotRun(f"{opt} {out}: no such directory")
    return args, backend


def launched_world() -> int | None:
    """WORLD_SIZE under torchrun (one process per rank), else None."""
    return int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ else None


class TorchRank:
    """What :func:`train` reads of a communicator, for PyTorch's own data parallelism (ddp,
    fsdp2): the rank, the world and the device (``backend``, ``ordinal``)."""

    def __init__(self, backend: str) -> None:
        import torch.distributed as dist

        local = int(os.environ["LOCAL_RANK"])
        if backend == "cuda":
            torch.cuda.set_device(local)
        dist.init_process_group("nccl" if backend == "cuda" else "gloo")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = type("TorchDevice", (), {"backend": backend, "ordinal": local})()

    def close(self) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()


def run_ranks(args: argparse.Namespace, backend: str) -> dict[str, Any]:
    """Rank 0's result: one process of torchrun's, or ``--world`` threads."""
    if launched_world() is None:
        return lg.run_threads(args.world, lambda comm: train(comm, args), backend=backend, timeout=args.timeout)[0]
    if args.mode in ("ddp", "fsdp2"):
        ranks = TorchRank(backend)
        try:
            return train(ranks, args)
        finally:
            ranks.close()
    if backend == "host":  # world 1 (checked): one thread
        return lg.run_threads(1, lambda comm: train(comm, args), backend=backend, timeout=args.timeout)[0]
    comm = lg.from_env(timeout=args.timeout)
    try:
        return train(comm, args)
    finally:
        comm.close()


def verdict(result: dict[str, Any]) -> tuple[bool, str]:
    """PASS when every loss is finite and the loss fell: the mean of the last quarter of the steps
    below the first step's. The line says what was checked."""
    loss = result["loss"]
    k = max(1, len(loss) // 4)
    end = sum(loss[-k:]) / k
    finite = all(math.isfinite(x) for x in loss)
    what = (f"loss {loss[0]:.4f} -> {end:.4f} (mean of the last {k} of {len(loss)} steps), {result['label']}, "
            f"size {result['size']} on the {'GPU' if result['device'] == 'cuda' else 'CPU'}")
    if finite and end < loss[0]:
        return True, f"PASS: the loss fell and every loss is finite: {what}"
    return False, f"FAIL: {'a loss is not finite' if not finite else 'the loss did not fall'}: {what}"


def main(argv: list[str] | None = None) -> int:
    """Exit status 0 on PASS, 1 on FAIL, 2 (one line on stderr, nothing run) for a setup that
    cannot run here."""
    args, backend = parse_args(argv)
    if args.save_grads:
        saved = lg.run_threads(1, lambda comm: save_grads(comm, args), backend=backend)[0]
        print(f"wrote {saved.pop('saved')}: {saved}")
        return 0
    if args.profile and backend == "cuda":  # the profiler's CUDA side initialises in the main thread
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]):
            torch.zeros(1, device="cuda").add_(1)
    result = run_ranks(args, backend)
    if result["rank"] != 0:  # rank 0 reports
        return 0 if verdict(result)[0] else 1
    ph = result["phases"]
    for key in ("host_ms", "gpu_ms"):
        if key in ph:
            print(f"  {key[:-3]:>4} ms: forward {ph[key]['forward']:.1f}, backward {ph[key]['backward']:.1f}, "
                  f"optimizer {ph[key]['optimizer']:.1f}")
    if "lag_ms" in ph:
        print("  GPU lag ms at " + ", ".join(f"{n} {v:.1f}" for n, v in ph["lag_ms"].items()))
    print(f"{result['label']}: final loss {result['loss'][-1]:.4f}, "
          f"median step {result['step_ms_median']:.1f} ms")
    if result["skipped_steps"]:
        print(f"skipped steps (non-finite gradient norm): {result['skipped_steps']}")
    for line in result["nonfinite_reports"]:
        print(f"  {line}")
    if result["stats_log"]:
        print(f"gradient statistics: {result['stats_log']} (python3 tools/grad_report.py --log {result['stats_log']})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    ok, line = verdict(result)
    print(line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(run("train_transformer", main))
