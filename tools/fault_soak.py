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

With ``--kills K`` it is the kill-and-resume soak instead (no injected faults): the run trains in a
child process that checkpoints every ``--checkpoint-every`` steps (``lowgrad.torch.save_checkpoint``)
and is killed with SIGKILL ``K`` times at points drawn from ``--seed``: in the middle of a step, half
way through writing a rank's file or the manifest of a save, just before a save is published, or
by the parent on a timer. Each new life resumes from ``lowgrad.checkpoint.latest`` (the lives after
the first at ``--resume-world``); at the end every rank's weights, master weights, AdamW state and
manager step must equal, bit for bit, an uninterrupted run (for a resume at another world: the
world-N run up to the checkpoint resumed, then a world-M run from it).

    python3 tools/fault_soak.py --kills 6 --world 2 --steps 24 --checkpoint-every 3
    python3 tools/fault_soak.py --kills 6 --world 2 --resume-world 4 --steps 24

Exit 0: every fault survived and every tensor identical; 1 otherwise; 2: bad arguments, no GPU.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
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

from lowgrad import checkpoint  # noqa: E402
from lowgrad.checkpoint import durable  # noqa: E402
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
        return {"state": final_state(att, opt), "applied": applied, "records": records,
                "skipped_steps": opt.skipped_steps}
    finally:
        opt.close()
        att.close()


def final_state(att: Any, opt: Any) -> dict[str, torch.Tensor]:
    """What the runs are compared on: the module's weights, the master weights, AdamW's state, the
    manager's step."""
    state = {f"param.{n}": p.detach() for n, p in att.model.named_parameters()}
    state |= {f"master.{i}": p.detach() for i, p in enumerate(opt.params)}
    for i, p in enumerate(opt.params):  # exp_avg, exp_avg_sq, step
        state |= {f"adamw.{i}.{k}": torch.as_tensor(v) for k, v in opt.optimizer.state.get(p, {}).items()}
    return {k: v.cpu().clone() for k, v in state.items()} | {"gm.step": torch.tensor(att.gm.step)}


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


# ---- the kill-and-resume soak ---------------------------------------------------------------
#: where a life dies: in a step's backward, half way through a rank's file or the manifest of a save,
#: just before a save is published (the rename), or when the parent's timer runs out
KILL_POINTS = ("step", "save-file", "save-manifest", "save-publish", "timer")


class Kill(NamedTuple):
    point: str
    step: int  # the steps into its life (from the checkpoint it resumed) it dies at; timer: ms after the start


def kill_schedule(a: argparse.Namespace) -> list[Kill]:
    """The kills, from ``--seed``; with ``--resume-world`` the first life dies after its first
    checkpoint (not on a timer), so that the next life resumes a checkpoint of the other world."""
    rng = random.Random(f"{a.seed}/kills")
    kills = [Kill(p, rng.randrange(1000, 12000) if p == "timer" else rng.randrange(2 * a.checkpoint_every))
             for p in (rng.choice(KILL_POINTS) for _ in range(a.kills))]
    if kills and a.resume_world != a.world:
        first = kills[0]
        kills[0] = Kill("step" if first.point == "timer" else first.point,
                        a.checkpoint_every + first.step % a.checkpoint_every)
    return kills


def die() -> None:
    """SIGKILL to this process: no exception, no finally, no flush (as a preemption or OOM kill)."""
    os.kill(os.getpid(), signal.SIGKILL)


def arm_kill(kill: Kill, world: int, steps_done: Callable[[], int]) -> None:
    """Make this life's process die at ``kill`` inside the first save at or after its step: the
    checkpoint's file writes and its publish are wrapped (threads share them)."""
    write, publish = durable.write_file, durable.publish

    def armed() -> bool:
        return steps_done() > kill.step

    def dying_write(path: Path, chunks: list[Any]) -> None:
        target = "manifest.json" if kill.point == "save-manifest" else f"rank-{kill.step % world:05d}.bin"
        if kill.point in ("save-file", "save-manifest") and path.name == target and armed():
            data = b"".join(bytes(c) for c in chunks)
            with open(path, "wb") as fh:  # half of it reaches the disk
                fh.write(data[:len(data) // 2])
                fh.flush()
                os.fsync(fh.fileno())
            die()
        write(path, chunks)

    def dying_publish(tmp: Path, final: Path) -> None:
        if kill.point == "save-publish" and armed():
            die()
        publish(tmp, final)

    durable.write_file, durable.publish = dying_write, dying_publish


def life(comm: Any, a: argparse.Namespace, template: Any, ckdir: Path | None, stop: int,
         kill: Kill | None) -> dict[str, torch.Tensor]:
    """One life of the run: resume from the latest checkpoint in ``ckdir`` (if any), train to step
    ``stop`` saving every ``--checkpoint-every`` steps (and at ``stop``), return the final state."""
    model = copy.deepcopy(template)
    att = lowgrad.torch.attach(model, comm, strategy=a.strategy, seed=a.seed)
    opt = lowgrad.torch.ShardOptimizer(att, torch.optim.AdamW, master_weights=True, lr=1e-3, weight_decay=0.1)
    try:
        last = checkpoint.latest(ckdir) if ckdir is not None else None
        if last is not None:
            lowgrad.torch.load_checkpoint(last, opt)
        for step in range(att.gm.step, stop):
            for m in range(a.micro_steps):
                x, y = batch(a, comm.rank, step, m)
                with att.micro_step(m, a.micro_steps):
                    logits = att.model(input_ids=x).logits
                    (torch.nn.functional.cross_entropy(logits.float().reshape(-1, 256), y.reshape(-1))
                     / a.micro_steps).backward()
                if kill is not None and kill.point == "step" and kill.step == step and comm.rank == 0:
                    die()  # between micro-steps of a step: no save can be under way
            opt.step(max_norm=1.0)
            if ckdir is not None and ((step + 1) % a.checkpoint_every == 0 or step + 1 == stop):
                lowgrad.torch.save_checkpoint(ckdir / f"step-{step + 1:06d}", opt)
        return final_state(att, opt)
    finally:
        opt.close()
        att.close()


def child(a: argparse.Namespace, template: Any) -> int:
    """A life in its own process (``--life``): its final state, once it gets there, to ``--dir``/final."""
    root = Path(a.dir)
    last = checkpoint.latest(root / "ck")
    start = 0 if last is None else checkpoint.read_manifest(last)["manager"]["step"]
    point, _, step = (a.die_at or "").partition(":")
    kill = Kill(point, start + int(step)) if a.die_at else None  # the step of the whole run it dies at
    done = [0]
    if kill is not None:
        arm_kill(kill, a.world, lambda: done[0])

    def job(c: Any) -> dict[str, torch.Tensor]:
        return life(c, a, template, root / "ck", a.steps, kill)
    if kill is not None and kill.point.startswith("save"):  # count the steps done through the saves
        save = lowgrad.torch.save_checkpoint

        def counting(path: Any, opt: Any) -> Path:
            done[0] = opt.attached.gm.step
            return save(path, opt)
        lowgrad.torch.save_checkpoint = counting  # type: ignore[assignment]
    states = lg.run_threads(a.world, job, backend="host", timeout=a.timeout)
    (root / "final").mkdir(exist_ok=True)
    for r, st in enumerate(states):
        torch.save(st, root / "final" / f"rank{r}.pt")
    return 0


def kill_soak(a: argparse.Namespace, template: Any) -> int:
    """The parent: lives in child processes until one finishes, then the comparison."""
    t0 = time.perf_counter()
    root = Path(a.dir or tempfile.mkdtemp(prefix="lowgrad-kill-soak-"))
    (root / "ck").mkdir(parents=True, exist_ok=True)
    passed = [f"--{k.replace('_', '-')}={getattr(a, k)}" for k in ("steps", "micro_steps", "seed", "strategy", "hidden",
                                                                   "layers", "seq", "batch", "timeout",
                                                                   "checkpoint_every")]
    passed += [] if a.group_size is None else [f"--group-size={a.group_size}"]
    lives: list[dict[str, Any]] = []
    for kill in [*kill_schedule(a), None]:
        world = a.world if not lives else a.resume_world
        last = checkpoint.latest(root / "ck")
        start = 0 if last is None else checkpoint.read_manifest(last)["manager"]["step"]
        cmd = [sys.executable, str(Path(__file__).resolve()), *passed, "--life", "--world", str(world),
               "--dir", str(root)]
        if kill is not None and kill.point != "timer":
            cmd += ["--die-at", f"{kill.point}:{kill.step}"]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            out = proc.communicate(timeout=kill.step / 1000 if kill is not None and kill.point == "timer" else None)[0]
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            out = proc.communicate()[0]
        killed = proc.returncode == -signal.SIGKILL
        lives.append({"world": world, "resumed_from": start, "kill": None if kill is None else kill._asdict(),
                      "killed": killed, "rc": proc.returncode,
                      "partial_left": sorted(d.name for d in (root / "ck").iterdir() if d.name.endswith(".partial"))})
        if proc.returncode == 0:
            break
        if not killed:  # a life that crashed (not killed): the soak failed
            print(out.decode(errors="replace"), file=sys.stderr)
            break
    finished = lives[-1]["rc"] == 0
    comparison: list[dict[str, Any]] = []
    if finished:
        switch = next((lv["resumed_from"] for lv in lives[1:]), 0)
        reference = kill_reference(a, template, root, switch if a.resume_world != a.world else a.steps)
        for r, want in enumerate(reference):
            got = torch.load(root / "final" / f"rank{r}.pt", weights_only=True)
            comparison.append({"rank": r, **compare(got, want)})
    ok = finished and bool(comparison) and all(c["identical"] == c["total"] for c in comparison)
    switched = next((lv["resumed_from"] for lv in lives if lv["world"] != a.world), None)
    s = {"ok": ok, "mode": "kill", "world": a.world, "resume_world": a.resume_world, "steps": a.steps,
         "switched_at": switched,
         "checkpoint_every": a.checkpoint_every, "seed": a.seed, "strategy": a.strategy, "dir": str(root),
         "lives": lives, "kills": sum(lv["killed"] for lv in lives),
         "mid_save_kills": sum(bool(lv["killed"] and lv["kill"] and lv["kill"]["point"].startswith("save"))
                               for lv in lives),
         "comparison": comparison, "seconds": round(time.perf_counter() - t0, 2)}
    if ok and a.dir is None:  # its own temporary folder: kept only to look into a failure
        shutil.rmtree(root)
    print(kill_table(s), flush=True)
    path = a.json or (os.path.join(os.environ["OUT"], "fault_soak.json") if os.environ.get("OUT") else None)
    if path:
        with open(path, "w") as fh:
            json.dump(s, fh, indent=1)
    return 0 if ok else 1


def kill_reference(a: argparse.Namespace, template: Any, root: Path, switch: int) -> list[dict[str, torch.Tensor]]:
    """The uninterrupted run: ``--world`` to step ``switch``, then (a resume at another world)
    ``--resume-world`` from that state to the end, handed over through a checkpoint."""
    ref = root / "reference"
    ref.mkdir(parents=True, exist_ok=True)
    states = lg.run_threads(a.world, lambda c: life(c, a, template, ref if switch < a.steps else None, switch, None),
                            backend="host", timeout=a.timeout)
    if switch < a.steps:
        states = lg.run_threads(a.resume_world, lambda c: life(c, a, template, ref, a.steps, None), backend="host",
                                timeout=a.timeout)
    return states


def kill_table(s: dict[str, Any]) -> str:
    lines = [f"kill soak: host backend, world {s['world']} then {s['resume_world']}, {s['strategy']}, {s['steps']} "
             f"steps, a checkpoint every {s['checkpoint_every']}, seed {s['seed']}, {s['seconds']} s"]
    for i, lv in enumerate(s["lives"]):
        k = lv["kill"]
        how = "finished" if lv["rc"] == 0 else f"killed ({k['point']} {k['step']})" if lv["killed"] else \
            f"CRASHED (exit {lv['rc']})"
        lines.append(f"life {i}: world {lv['world']}, resumed from step {lv['resumed_from']}, {how}"
                     + (f"; a cut save left {lv['partial_left']}" if lv["partial_left"] else ""))
    lines.append(f"kills: {s['kills']} ({s['mid_save_kills']} in the middle of a save)"
                 + (f"; world {s['resume_world']} from the world-{s['world']} checkpoint of step {s['switched_at']}"
                    if s["switched_at"] is not None else ""))
    lines += [f"rank {c['rank']}: {c['identical']}/{c['total']} tensors identical to the uninterrupted run, max "
              f"|diff| {c['max_abs_diff']:g}" + (f", differ: {c['mismatched']}" if c["mismatched"] else "")
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
                   help="ranks per node, for a strategy that groups ranks by node (default: the launcher's, else "
                        "one node)")
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a collective may wait")
    p.add_argument("--json", default=None, help="the report as JSON (default: $OUT/fault_soak.json where $OUT is set)")
    p.add_argument("--kills", type=int, default=0, help="the kill-and-resume soak: this many SIGKILLs (host backend)")
    p.add_argument("--checkpoint-every", type=int, default=2, help="kill soak: steps between checkpoints")
    p.add_argument("--resume-world", type=int, default=None, help="kill soak: the world of every life after the first")
    p.add_argument("--dir", default=None, help="kill soak: where the checkpoints go (default: a new temporary dir, "
                                               "removed after a pass)")
    p.add_argument("--life", action="store_true", help=argparse.SUPPRESS)  # a kill soak's child
    p.add_argument("--die-at", default=None, help=argparse.SUPPRESS)
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
                      (a.group_size is None or "group_size" in STRATEGIES[a.strategy].option_names()
                       and a.group_size >= 1,
                       "--group-size applies to a strategy that takes group_size "
                       f"({[n for n, c in STRATEGIES.items() if 'group_size' in c.option_names()]}) and must be >= 1"),
                      (a.kills >= 0 and a.checkpoint_every >= 1, "--kills must be >= 0, --checkpoint-every >= 1"),
                      (a.resume_world is None or a.resume_world >= 1, "--resume-world must be >= 1"),
                      (not (a.kills or a.life) or a.backend in ("auto", "host"), "--kills runs on the host backend")]:
        if not good:
            raise ValueError(msg)
    backend = a.backend
    if a.kills or a.life:  # ranks are threads of one process that the soak kills: the host backend
        backend = "host"
    if backend == "auto":
        backend = "cuda" if torch.cuda.is_available() and lg.device_count() > 0 else "host"
    if backend == "nccl":
        from lowgrad.launch.rendezvous import launcher_env
        env_world = launcher_env()[1]  # ValueError outside torchrun, Open MPI, Slurm
        if a.world not in (None, env_world):
            raise ValueError(f"--world {a.world}, but the launcher started {env_world} ranks")
        a.world = env_world
    a.world = a.world or 1
    a.resume_world = a.resume_world or a.world
    if backend in ("cuda", "nccl"):
        if not torch.cuda.is_available():
            raise lg.CudaUnavailableError(f"--backend {backend}: this PyTorch ({torch.__version__}) sees no GPU")
        from lowgrad.cuda import driver
        driver.driver()  # CudaUnavailableError with lowgrad's reason, before any rank starts
    template = build(a)
    for world in {a.world, a.resume_world}:
        lowgrad.torch.module_layout(template)[0].check_world(world)  # every dim 0 divisible by world
    return a, backend, template


def main(argv: list[str] | None = None) -> int:
    try:
        a, backend, template = setup(argv)
    except (ValueError, TypeError, lg.CudaUnavailableError) as e:
        print(f"fault_soak: error: {e}", file=sys.stderr)
        return 2
    faults, t0, threads = schedule(a, a.world), time.perf_counter(), torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: intra-op threads only add waits (on a shared CPU, 20x slower)
    if a.life:
        return child(a, template)
    if a.kills:
        try:
            return kill_soak(a, template)
        finally:
            torch.set_num_threads(threads)
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
    from _cli import run  # tools/, this script's folder, is on sys.path: ends quietly on a closed pipe

    sys.exit(run("fault_soak", main))
