#!/usr/bin/env python
"""Fault-injection soak for lowgrad.torch: a tiny Qwen2 (transformers, bf16, eager attention) trains
through ``attach`` + ``ShardOptimizer(AdamW, master_weights=True)`` while faults are injected at
random; at the end every rank's weights and optimizer state must equal, bit for bit, a clean run
(fresh model, same seeds) that never ran the steps the faulty run skipped.

Faults, from a seeded schedule that every rank computes alike, each on one rank: ``nonfinite``
the loss times NaN or inf; ``forward`` a decoder layer's forward pre-hook raises; ``backward`` a
gradient hook on a decoder layer's output raises part-way through backward (the block above has
delivered its gradients); ``data`` the "loader" raises between micro-steps, outside the ``with``
(``attached.discard_step()``); ``badarg`` a wrong micro_step call or a bad max_norm, which must be
refused with nothing changed before the right call. The first four skip the step on every rank.

    python3 tools/fault_soak.py --world 2 --steps 200                 (host backend on a CPU)
    python3 tools/fault_soak.py --backend cuda --world 4 --steps 200  (one GPU; world > 1: loopback)
    torchrun --nproc-per-node 2 tools/fault_soak.py --backend nccl    (one process per GPU)

Exit 0: every fault survived and every tensor identical; 1 otherwise; 2: bad arguments, no GPU.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import random
import sys
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

# before any CUDA context: a hardware queue per loopback rank's stream (docs/loopback.md), and
# cuBLAS results that do not depend on the streams in use (the two runs must match bit for bit)
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import lowgrad as lg  # noqa: E402

try:  # the soak trains through lowgrad.torch: without PyTorch and transformers, --help still
    import torch  # answers, and a run says so in one line (setup)
    import transformers  # noqa: F401

    import lowgrad.torch
    _MISSING = ""
except ImportError as _exc:
    _MISSING = f"needs PyTorch and transformers ({_exc}): pip install \".[torch]\" transformers"

from lowgrad.managers import STRATEGIES  # noqa: E402

KINDS = ("nonfinite", "forward", "backward", "data", "badarg")
SKIPPING = KINDS[:4]  # a step with such a fault is skipped on every rank
BAD_CALLS: dict[str, Callable[[int, int], tuple[Any, Any]]] = {
    "micro_step('m', M)": lambda m, M: (str(m), M), "micro_step(float m, M)": lambda m, M: (float(m), M),
    "micro_step(m, float M)": lambda m, M: (m, float(M)), "micro_step(m + 1, M)": lambda m, M: (m + 1, M),
    "micro_step(m, 0)": lambda m, M: (m, 0)}
BAD_NORMS = {"max_norm=-1": -1.0, "max_norm=0": 0.0, "max_norm=nan": math.nan, "max_norm=inf": math.inf,
             "max_norm='1'": "1"}
_TEXT = (REPO / "examples" / "tiny_text.txt").read_bytes()


class InjectedFault(Exception):
    """The soak's own fault: any other exception is a real failure."""


class Fault(NamedTuple):
    step: int
    kind: str
    rank: int
    micro: int
    layer: int  # forward/backward: the decoder layer hooked; -1 otherwise
    variant: str  # nonfinite: "nan"/"inf"; badarg: a key of BAD_CALLS or BAD_NORMS


def schedule(a: argparse.Namespace, world: int) -> dict[int, Fault]:
    """At most one fault per step, from Python's seeded RNG (no torch state: the same on every rank)."""
    rng, out = random.Random(a.seed), {}
    for step in range(a.steps):
        if rng.random() >= a.fault_rate:
            continue
        kind = rng.choice(KINDS)
        pick: dict[str, Callable[[], str]] = {"nonfinite": lambda: rng.choice(("nan", "inf")),
                                              "badarg": lambda: rng.choice([*BAD_CALLS, *BAD_NORMS])}
        variant = pick.get(kind, lambda: "")()
        # backward: below the top block, so that at least one block has delivered when it raises
        layer = rng.randrange(a.layers - (kind == "backward")) if kind in ("forward", "backward") else -1
        out[step] = Fault(step, kind, rng.randrange(world), rng.randrange(a.micro_steps), layer, variant)
    return out


def build(a: argparse.Namespace) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(vocab_size=256, hidden_size=a.hidden, intermediate_size=2 * a.hidden, num_attention_heads=4,
                      num_key_value_heads=2, num_hidden_layers=a.layers, max_position_embeddings=a.seq,
                      tie_word_embeddings=True, attn_implementation="eager")
    with torch.random.fork_rng(devices=[]):  # the caller's RNG is left alone
        torch.manual_seed(a.seed)
        return Qwen2ForCausalLM(cfg).to(torch.bfloat16)


def batch(a: argparse.Namespace, rank: int, step: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s micro-batch ``m`` of ``step`` (text windows): a function of these indices
    only, so the clean run draws the same batches for the steps it runs."""
    rng = random.Random(f"{a.seed}/{step}/{m}/{rank}")
    starts = [rng.randrange(len(_TEXT) - a.seq - 1) for _ in range(a.batch)]
    t = torch.tensor([list(_TEXT[s:s + a.seq + 1]) for s in starts], dtype=torch.long)
    return t[:, :-1], t[:, 1:]


def arm(model: Any, f: Fault) -> list[Any]:
    """The hooks that make fault ``f`` happen in this micro-step's forward or backward."""
    def raiser(what: str) -> Any:
        def hook(*_: Any) -> None:
            raise InjectedFault(what)
        return hook

    def on_output(_m: Any, _i: Any, out: Any) -> None:
        (out[0] if isinstance(out, tuple) else out).register_hook(raiser(f"backward at layer {f.layer}"))
    layer = model.model.layers[f.layer]
    if f.kind == "forward":
        return [layer.register_forward_pre_hook(raiser(f"forward of layer {f.layer}"))]
    return [layer.register_forward_hook(on_output)] if f.kind == "backward" else []


def refused(att: Any, opt: Any, call: Any) -> str | None:
    """The name of the refusal ``call()`` must raise having changed nothing; None otherwise."""
    def probe() -> tuple[Any, ...]:
        return (att.gm.step, att.gm.in_micro_step, att.gm.fetched_layer, opt.skipped_steps, repr(opt.last_norm),
                all(p.grad is None for p in att.model.parameters()))
    before = probe()
    try:
        call()
    except (TypeError, ValueError, lg.ProtocolError) as e:
        return type(e).__name__ if probe() == before else None
    return None


def wrong_micro_step(att: Any, args: tuple[Any, Any]) -> None:
    with att.micro_step(*args):
        raise AssertionError(f"micro_step{args} was accepted")


def spend_step(att: Any) -> None:
    """The clean run's stand-in for a skipped step: no micro-step, but the step number advances as
    the faulty run's discard_step or skipped step advanced it, so later steps draw the same SR noise."""
    att.gm.load_state_dict({**att.gm.state_dict(), "step": att.gm.step + 1})


def faulty_step(att: Any, opt: Any, a: argparse.Namespace, device: torch.device, rank: int, step: int,
                f: Fault | None) -> dict[str, Any]:
    """The micro-steps of ``step`` with fault ``f`` (None: none on this rank), recovered as
    docs/torch.md says; a bad max_norm is tried here, before the caller's ``opt.step(max_norm=1.0)``."""
    M, raised, clean = a.micro_steps, None, True
    for m in range(M):
        here = f if f is not None and f.micro == m else None  # the fault strikes in this micro-step
        try:
            x, y = (t.to(device) for t in batch(a, rank, step, m))
            if here and here.kind == "data":
                raise InjectedFault(f"data loader before micro-step {m}")
            if here and here.variant in BAD_CALLS:
                raised = refused(att, opt, partial(wrong_micro_step, att, BAD_CALLS[here.variant](m, M)))
            with att.micro_step(m, M):
                hooks = arm(att.model, here) if here else []
                try:
                    logits = att.model(input_ids=x).logits
                    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, 256), y.reshape(-1)) / M
                    (loss * float(here.variant) if here and here.kind == "nonfinite" else loss).backward()
                finally:
                    for h in hooks:
                        h.remove()
        except InjectedFault as e:
            raised = str(e)
            if f is not None and f.kind == "data":  # outside the with: ours to discard (a whole step before m 0)
                clean = att.discard_step(total_micro_steps=M) if m == 0 else att.discard_step()
            clean = clean and not att.gm.in_micro_step and all(p.grad is None for p in att.model.parameters())
            break  # the step is discarded: leave its micro-steps, still call opt.step()
    if f is None:
        return {}
    if f.variant in BAD_NORMS:
        raised = refused(att, opt, partial(opt.step, max_norm=BAD_NORMS[f.variant]))
    # the fault must have struck where aimed (nothing raised for a non-finite loss, a refusal for badarg)
    where = {"forward": "forward", "backward": "backward", "data": "data", "badarg": ""}.get(f.kind)
    ok = raised is None if where is None else raised is not None and where in raised
    return {**f._asdict(), "raised": raised, "ok": ok and clean is True}


def train(comm: Any, a: argparse.Namespace, template: Any, device: torch.device, faults: dict[int, Fault],
          skip: set[int] | None) -> dict[str, Any]:
    """The faulty run (``skip`` None: this rank's faults injected) or the clean twin, which never
    runs the steps in ``skip``: the final state, each step's opt.step() result, a record per fault."""
    model = copy.deepcopy(template).to(device)
    options = {} if a.group_size is None else {"group_size": a.group_size}
    att = lowgrad.torch.attach(model, comm, strategy=a.strategy, seed=a.seed, **options)
    opt = lowgrad.torch.ShardOptimizer(att, torch.optim.AdamW, master_weights=True, lr=1e-3, weight_decay=0.1)
    try:  # closed however the run ends: a crashed run must not leave its views and buffers behind
        applied, records = [], []
        for step in range(a.steps):
            if skip is not None and step in skip:
                spend_step(att)
                continue
            f = faults.get(step) if skip is None else None
            f = f if f is not None and f.rank == comm.rank else None
            rec = faulty_step(att, opt, a, device, comm.rank, step, f)
            applied.append(opt.step(max_norm=1.0))  # every rank, every step: False on all for a skipped one
            if f is not None:
                survived = rec["ok"] and applied[-1] == (f.kind == "badarg")
                records.append({**rec, "applied": applied[-1], "survived": survived})
        state = {f"param.{n}": p.detach() for n, p in model.named_parameters()}
        state |= {f"master.{i}": p.detach() for i, p in enumerate(opt.params)}
        for i, p in enumerate(opt.params):  # exp_avg, exp_avg_sq, step
            state |= {f"adamw.{i}.{k}": torch.as_tensor(v) for k, v in opt.optimizer.state.get(p, {}).items()}
        state = {k: v.cpu().clone() for k, v in state.items()} | {"gm.step": torch.tensor(att.gm.step)}
        return {"state": state, "applied": applied, "records": records, "skipped_steps": opt.skipped_steps}
    finally:
        opt.close()
        att.close()


def compare(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Bit-for-bit equality per tensor (NaN payloads and the sign of zero count), the largest |diff|."""
    same, worst, bad = 0, 0.0, []
    for k in sorted(got.keys() | want.keys()):
        a, b = got.get(k), want.get(k)
        if a is not None and b is not None and a.dtype == b.dtype and a.shape == b.shape:
            if torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
                same += 1
                continue
            worst = max(worst, float((a.double() - b.double()).abs().nan_to_num(nan=math.inf).max()))
        else:
            worst = math.inf
        bad.append(k)
    return {"identical": same, "total": len(got.keys() | want.keys()), "max_abs_diff": worst, "mismatched": bad[:8]}


def rank_job(comm: Any, a: argparse.Namespace, template: Any, faults: dict[int, Fault]) -> dict[str, Any]:
    """Rank ``comm.rank``: the faulty run, then the clean twin from the same initial weights."""
    device = torch.device("cpu")
    if getattr(comm.device, "backend", "host") == "cuda":
        device = torch.device("cuda", comm.device.ordinal)
        torch.cuda.set_device(device)
        torch.cuda.set_stream(torch.cuda.Stream(device))  # each rank its own stream (loopback ranks share a GPU)
    faulty = train(comm, a, template, device, faults, None)
    clean = train(comm, a, template, device, faults, {s for s, f in faults.items() if f.kind in SKIPPING})
    return {"rank": comm.rank, "applied": faulty["applied"], "records": faulty["records"],
            "skipped_steps": faulty["skipped_steps"], "clean_skipped_steps": clean["skipped_steps"],
            "comparison": compare(faulty["state"], clean["state"])}


def summarize(a: argparse.Namespace, backend: str, faults: dict[int, Fault], results: list[dict[str, Any]],
              seconds: float) -> dict[str, Any]:
    ranks = [r["rank"] for r in results]
    expected = [not (s in faults and faults[s].kind in SKIPPING) for s in range(a.steps)]
    kinds = {k: {"scheduled": sum(f.kind == k and f.rank in ranks for f in faults.values()),
                 "injected": sum(rec["kind"] == k for r in results for rec in r["records"]),
                 "survived": sum(rec["kind"] == k and rec["survived"] for r in results for rec in r["records"])}
             for k in KINDS}
    steps_ok = all(r["applied"] == expected and r["skipped_steps"] == expected.count(False)
                   and r["clean_skipped_steps"] == 0 for r in results)
    ok = steps_ok and all(v["injected"] == v["scheduled"] == v["survived"] for v in kinds.values()) and \
        all(r["comparison"]["identical"] == r["comparison"]["total"] for r in results)
    return {"ok": ok, "backend": backend, "world": a.world, "ranks": ranks, "steps": a.steps,
            "micro_steps": a.micro_steps, "fault_rate": a.fault_rate, "seed": a.seed, "strategy": a.strategy,
            "group_size": a.group_size,
            "model": {"hidden": a.hidden, "layers": a.layers, "seq": a.seq, "batch": a.batch}, "faults": kinds,
            "applied": expected.count(True), "skipped": expected.count(False), "steps_as_expected": steps_ok,
            "seconds": round(seconds, 2), "comparison": [{"rank": r["rank"], **r["comparison"]} for r in results],
            "records": [rec for r in results for rec in r["records"]]}


def table(s: dict[str, Any]) -> str:
    total = {c: sum(v[c] for v in s["faults"].values()) for c in ("injected", "survived")}
    lines = [(f"fault soak: {s['backend']} backend, world {s['world']} (ranks {s['ranks']}), {s['strategy']}, "
              f"{s['steps']} steps x {s['micro_steps']} micro-steps, fault rate {s['fault_rate']}, "
              f"seed {s['seed']}, {s['seconds']} s"), f"{'fault':<10} {'injected':>8} {'survived':>8}"]
    lines += [f"{k:<10} {v['injected']:>8} {v['survived']:>8}" for k, v in [*s["faults"].items(), ("total", total)]]
    lines.append(f"steps: {s['applied']} applied, {s['skipped']} skipped "
                 f"({'as scheduled on every rank' if s['steps_as_expected'] else 'NOT as scheduled'})")
    lines += [f"rank {c['rank']}: {c['identical']}/{c['total']} tensors identical to the clean run, max |diff| "
              f"{c['max_abs_diff']:g}" + (f", differ: {c['mismatched']}" if c["mismatched"] else "")
              for c in s["comparison"]]
    return "\n".join([*lines, "PASS" if s["ok"] else "FAIL"])


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line (main prints it), no usage block
        raise ValueError(message)


def setup(argv: list[str] | None) -> tuple[argparse.Namespace, str, torch.nn.Module]:
    """The arguments, the backend and the initial model (built here, once: the ranks are threads and
    torch's global RNG is not theirs to share), checked before anything runs (ValueError: exit 2)."""
    p = _Parser(prog="fault_soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=("auto", "host", "cuda", "nccl"), default="auto",
                   help="auto: cuda where a GPU is visible, else host; nccl: one process per GPU under torchrun")
    p.add_argument("--world", type=int, default=None, help="ranks as threads (default 1; nccl: the launcher's)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--micro-steps", type=int, default=3)
    p.add_argument("--fault-rate", type=float, default=0.3, help="probability that a step has a fault")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--strategy", choices=tuple(STRATEGIES), default="scatter_reduce")
    p.add_argument("--group-size", type=int, default=None,
                   help="hierarchical: ranks per node (default: the launcher's, else one node)")
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a collective may wait")
    p.add_argument("--json", default=None, help="the report as JSON (default: $OUT/fault_soak.json where $OUT is set)")
    a = p.parse_args(argv)
    if _MISSING:
        print(f"fault_soak: {_MISSING}", file=sys.stderr)
        sys.exit(2)
    for good, msg in [(a.steps >= 1 and a.micro_steps >= 1, "--steps and --micro-steps must be >= 1"),
                      (0 <= a.fault_rate <= 1, "--fault-rate must be in [0, 1]"),
                      (a.layers >= 2, "--layers must be >= 2"), (a.timeout > 0, "--timeout must be > 0"),
                      (a.hidden >= 8 and a.hidden % 8 == 0, "--hidden must be a positive multiple of 8"),
                      (a.batch >= 1 and 1 <= a.seq < len(_TEXT) // 2, "--batch and --seq must be positive"),
                      (a.world is None or a.world >= 1, "--world must be >= 1"),
                      (a.group_size is None or a.strategy == "hierarchical" and a.group_size >= 1,
                       "--group-size applies to --strategy hierarchical and must be >= 1")]:
        if not good:
            raise ValueError(msg)
    backend = a.backend
    if backend == "auto":
        backend = "cuda" if torch.cuda.is_available() and lg.device_count() > 0 else "host"
    if backend == "nccl":
        from lowgrad.launch.rendezvous import launcher_env
        env_world = launcher_env()[1]  # ValueError outside torchrun, Open MPI, Slurm
        if a.world not in (None, env_world):
            raise ValueError(f"--world {a.world}, but the launcher started {env_world} ranks")
        a.world = env_world
    a.world = a.world or 1
    if backend in ("cuda", "nccl"):
        if not torch.cuda.is_available():
            raise lg.CudaUnavailableError(f"--backend {backend}: this PyTorch ({torch.__version__}) sees no GPU")
        from lowgrad.cuda import driver
        driver.driver()  # CudaUnavailableError with lowgrad's reason, before any rank starts
    template = build(a)
    lowgrad.torch.module_layout(template)[0].check_world(a.world)  # every dim 0 divisible by world
    return a, backend, template


def main(argv: list[str] | None = None) -> int:
    try:
        a, backend, template = setup(argv)
    except (ValueError, TypeError, lg.CudaUnavailableError) as e:
        print(f"fault_soak: error: {e}", file=sys.stderr)
        return 2
    faults, t0, threads = schedule(a, a.world), time.perf_counter(), torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: intra-op threads only add waits (on a shared CPU, 20x slower)
    try:
        if backend == "nccl":
            comm = lg.from_env(timeout=a.timeout)
            try:
                results = [rank_job(comm, a, template, faults)]
            finally:
                comm.close()
        else:
            results = lg.run_threads(a.world, lambda c: rank_job(c, a, template, faults), backend=backend,
                                     share_gpu=backend == "cuda" and a.world > 1, timeout=a.timeout)
    except Exception as e:  # noqa: BLE001 - a fault not survived (or a bug): the soak failed
        traceback.print_exc()
        print(f"fault_soak: FAIL: the run crashed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        torch.set_num_threads(threads)
    s = summarize(a, backend, faults, results, time.perf_counter() - t0)
    print(table(s), flush=True)
    path = a.json or (os.path.join(os.environ["OUT"], "fault_soak.json") if os.environ.get("OUT") else None)
    if path:
        if backend == "nccl" and s["ranks"] != [0]:  # one process per rank: one file each
            path = f"{path}.rank{s['ranks'][0]}"
        with open(path, "w") as fh:
            json.dump(s, fh, indent=1)
    return 0 if s["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
