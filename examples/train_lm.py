#!/usr/bin/env python
"""A character-level language model trained by a numpy engine through a lowgrad gradient manager.

The model reads the previous ``K`` characters and predicts the next one::

    x      = concat(embed[c_1], ..., embed[c_K])             (B, K*E)
    h_0    = tanh(x @ w_in.T)                                 (B, H)
    h_l+1  = h_l + tanh(h_l @ w_l.T + b_l)    l = 0 .. L-1    L identical residual blocks
    logits = h_L @ head.T                                     (B, V)

so its :class:`lowgrad.Layout` has block parameters ``w (H, H)``, ``b (H,)`` and non-block ones
``embed (V, E)``, ``w_in (H, K*E)``, ``head (V, H)`` (V, the characters, padded to a multiple of
16 so that every dim 0 shards evenly).

Who does what:

- numpy, the *engine*: forward and backward by hand, on the host. Each gradient goes to the
  manager the moment backward produces it, through the micro-step protocol (docs/protocol.md).
- lowgrad, the *gradient manager*: accumulation over micro-steps, the mean over ranks, sharding
  (``--strategy``), shards in pinned host memory (``--offload``).
- :class:`AdamW`, this file's *optimizer*: fp32 AdamW on the rows of each parameter this rank's
  shards cover, then every rank's rows gathered (``Communicator.host_allgather``).

The engine hands a gradient over through a pinned staging tensor: its ``numpy()`` is a view on
the host and CUDA backends alike, and lowgrad's kernels and copies read it, so
``lg.ops.add_sr`` rounds it into the manager's tensor on stream ``s`` wherever that lives.
``--accum``: ``sr_bf16`` (default) rounds stochastically into bf16 (``t = SR(t + g)``, fresh noise
every add, so the sum is unbiased);
``fp32`` adds exactly (the reference); ``rn_bf16`` adds in bf16 on the host with round-to-nearest,
as ``grad += g`` on a bf16 tensor does in a framework. Only the unsharded manager leaves the
accumulation to the engine, so ``rn_bf16`` needs ``--strategy unsharded``.

Run (from the repository root)::

    python examples/train_lm.py                                            # 1 rank, the CPU
    python examples/train_lm.py --world 2 --strategy all_to_all --offload  # 2 ranks as threads
    python examples/train_lm.py --accum fp32 --json fp32.json              # plot: plot_losses.py
    python examples/train_lm.py --device cuda                              # one GPU per rank
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from _cli import CannotRun, Parser, check_world, int_at_least, require_cuda, run  # first: says why lowgrad is missing

import numpy as np

import lowgrad as lg
from lowgrad.managers import STRATEGIES

DEFAULT_TEXT = Path(__file__).with_name("tiny_text.txt")
ACCUM = ("sr_bf16", "fp32", "rn_bf16")
Key = tuple[int, str]  # (layer, parameter name); layer -1 for the non-block parameters


@dataclass(frozen=True)
class Config:
    device: str = "host"        # lowgrad backend: "host" (threads on the CPU) or "cuda" (a GPU per rank)
    world: int = 1
    strategy: str = ""          # "": scatter_reduce, or unsharded for --accum rn_bf16
    offload: bool = False
    accum: str = "sr_bf16"
    steps: int = 60
    micro_steps: int = 2
    batch: int = 64             # examples per micro-step per rank
    context: int = 8            # K
    embed: int = 16             # E
    hidden: int = 64            # H
    layers: int = 2             # L
    lr: float = 1e-2
    warmup: int = 10            # steps of linear learning-rate warm-up
    weight_decay: float = 0.01
    seed: int = 0
    log_every: int = 10
    text: str = str(DEFAULT_TEXT)
    quiet: bool = False

    def resolved(self) -> Config:
        """The strategy's default filled in; ValueError for options that do not fit together."""
        strategy = self.strategy or ("unsharded" if self.accum == "rn_bf16" else "scatter_reduce")
        if self.device not in ("host", "cuda") or self.accum not in ACCUM or strategy not in STRATEGIES:
            raise ValueError(f"device/accum/strategy must be in {('host', 'cuda')}/{ACCUM}/{list(STRATEGIES)}")
        cls = STRATEGIES[strategy]
        if self.accum == "rn_bf16" and cls.rounds():
            raise ValueError(f"--accum rn_bf16 needs a strategy that rounds nothing (the engine accumulates), "
                             f"one of {[n for n, c in STRATEGIES.items() if not c.rounds()]}; {strategy} "
                             "accumulates with SR")
        if self.offload and not cls.offloads:
            raise ValueError(f"--offload applies to the strategies that offload; {strategy} does not")
        return replace(self, strategy=strategy)

    @property
    def label(self) -> str:
        return (f"{self.device} {self.accum} {self.strategy}{' offload' if self.offload else ''} "
                f"world {self.world}{f' seed {self.seed}' if self.seed else ''}")


class Corpus:
    """Characters of a text as ids; 90 % for training, the rest held out."""

    def __init__(self, text: str, vocab_multiple: int = 16) -> None:
        self.chars = sorted(set(text))
        self.vocab = -(-len(self.chars) // vocab_multiple) * vocab_multiple
        index = {c: i for i, c in enumerate(self.chars)}
        ids = np.array([index[c] for c in text], dtype=np.int64)
        cut = int(0.9 * len(ids))
        self.train, self.val = ids[:cut], ids[cut:]

    @staticmethod
    def batch(data: np.ndarray, rng: np.random.Generator, size: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(contexts (size, k), next characters (size,)) at random positions of ``data``."""
        pos = rng.integers(k, len(data), size)
        return data[pos[:, None] + np.arange(-k, 0)], data[pos]


def layout_of(cfg: Config, vocab: int) -> lg.Layout:
    H = cfg.hidden
    return lg.Layout(block=(lg.ParamSpec("w", (H, H)), lg.ParamSpec("b", (H,))),
                     non_block=(lg.ParamSpec("embed", (vocab, cfg.embed)),
                                lg.ParamSpec("w_in", (H, cfg.context * cfg.embed)),
                                lg.ParamSpec("head", (vocab, H))),
                     num_layers=cfg.layers)


def init_weights(layout: lg.Layout, seed: int) -> dict[Key, np.ndarray]:
    """fp32 weights, the same on every rank (one seed); the head starts small: loss ~ ln V."""
    rng, (V, E), (H, KE) = np.random.default_rng(seed), layout.non_block[0].shape, layout.non_block[1].shape
    w = {(-1, "embed"): rng.standard_normal((V, E)), (-1, "w_in"): rng.standard_normal((H, KE)) / math.sqrt(KE),
         (-1, "head"): rng.standard_normal((V, H)) * 0.02}
    for layer in range(layout.num_layers):
        w[layer, "w"], w[layer, "b"] = rng.standard_normal((H, H)) * 0.5 / math.sqrt(H), np.zeros(H)
    return {k: v.astype(np.float32) for k, v in w.items()}


# ---- the engine: forward and backward in numpy -------------------------------------------------
def forward(w: dict[Key, np.ndarray], layers: int, ctx: np.ndarray) -> tuple[np.ndarray, list[np.ndarray],
                                                                             list[np.ndarray], np.ndarray]:
    """(logits, block inputs h_0..h_L, block outputs z_0..z_L-1, input x)."""
    x = w[-1, "embed"][ctx].reshape(len(ctx), -1)
    h = np.tanh(x @ w[-1, "w_in"].T)
    hs, zs = [h], []
    for layer in range(layers):
        z = np.tanh(h @ w[layer, "w"].T + w[layer, "b"])
        h = h + z
        hs.append(h)
        zs.append(z)
    return h @ w[-1, "head"].T, hs, zs, x


def cross_entropy(logits: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
    """(mean loss, its gradient with respect to the logits)."""
    e = np.exp(logits - logits.max(1, keepdims=True))
    p = e / e.sum(1, keepdims=True)
    loss = -float(np.mean(np.log(p[np.arange(len(y)), y])))
    p[np.arange(len(y)), y] -= 1
    return loss, p / len(y)


def backward(w: dict[Key, np.ndarray], ctx: np.ndarray, hs: list[np.ndarray], zs: list[np.ndarray],
             x: np.ndarray, dlogits: np.ndarray) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
    """The gradients as ``(layer, {name: grad})`` in the order backward produces them: head, blocks
    L-1 .. 0, w_in, embed (layer -1: a non-block one), from :func:`forward`'s values."""
    yield -1, {"head": dlogits.T @ hs[-1]}
    dh = dlogits @ w[-1, "head"]
    for layer in reversed(range(len(zs))):
        dz = dh * (1 - zs[layer] ** 2)
        yield layer, {"w": dz.T @ hs[layer], "b": dz.sum(0)}
        dh = dh + dz @ w[layer, "w"]
    da = dh * (1 - hs[0] ** 2)
    yield -1, {"w_in": da.T @ x}
    dembed = np.zeros_like(w[-1, "embed"])
    np.add.at(dembed, ctx.reshape(-1), (da @ w[-1, "w_in"]).reshape(ctx.size, -1))
    yield -1, {"embed": dembed}


class Handoff:
    """Writes numpy gradients into the manager's tensors on the engine stream ``s``, through one
    pinned staging tensor per parameter (a numpy view on every backend, read by lowgrad's kernels)."""

    def __init__(self, dev: Any, s: Any, accum: str, seed: int) -> None:
        self.dev, self.s, self.accum, self.seed = dev, s, accum, seed
        self.staging: dict[Key, lg.Tensor] = {}

    def write(self, key: Key, t: lg.Tensor, g: np.ndarray, accumulate: bool, seed: int) -> None:
        """``t = g`` or ``t += g``, rounded as ``--accum`` says."""
        if key not in self.staging:
            dtype = t.dtype if self.accum == "rn_bf16" else lg.fp32
            self.staging[key] = self.dev.alloc(t.shape, dtype, kind="pinned", name="engine_staging")
        stage, s = self.staging[key], self.s
        if self.accum == "rn_bf16":  # the engine adds in bf16, round to nearest even (numpy's cast)
            if accumulate:
                lg.ops.copy(stage, t, stream=s)
                s.synchronize()  # the host reads stage next
            v = stage.numpy()
            v[...] = (v.astype(np.float32) + g if accumulate else g).astype(lg.bf16.np)
            lg.ops.copy(t, stage, stream=s)
        else:  # one kernel: SR(t + g), or SR(0.5 (g + g)) = SR(g); exact when t is fp32
            stage.numpy()[...] = g
            lg.ops.add_sr(t, t if accumulate else stage, stage, 1.0 if accumulate else 0.5, seed, stream=s)


def micro_step(gm: lg.GradientManager, hand: Handoff, w: dict[Key, np.ndarray], cfg: Config, ctx: np.ndarray,
               y: np.ndarray, step: int, micro: int) -> float:
    """One micro-step of the protocol: every gradient handed over as backward produces it."""
    s, M = hand.s, cfg.micro_steps
    logits, hs, zs, x = forward(w, cfg.layers, ctx)
    loss, dlogits = cross_entropy(logits, y)
    s.synchronize()  # the previous micro-step's copies and kernels are done with the staging memory
    gm.start_micro_step(s, micro, M)
    for i, (layer, named) in enumerate(backward(w, ctx, hs, zs, x, dlogits / M)):  # sum over micro-steps: mean
        if layer < 0:
            (name, g), = named.items()
            t, accumulate = gm.non_block_full(name, s)
            hand.write((layer, name), t, g, accumulate, lg.use_seed(hand.seed, step, micro, i, 0, 0))
            gm.notify_non_block(name, s)
        else:
            dw, accumulate = gm.block_full(layer, s)  # s waits until this buffer is free again
            for j, (name, g) in enumerate(named.items()):
                hand.write((layer, name), dw[name], g, accumulate, lg.use_seed(hand.seed, step, micro, i, j, 0))
            gm.notify_block(layer, s)  # the exchange is queued on the manager's stream, after s
    gm.end_micro_step(s)
    return loss


# ---- the optimizer: the example's own AdamW on this rank's shards ----------------------------
class AdamW:
    """fp32 AdamW on this rank's rows of each weight (dim 0 split by world, as the manager's
    shards are), then every rank's updated rows gathered into every rank's weights."""

    def __init__(self, w: dict[Key, np.ndarray], comm: Any, cfg: Config, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8) -> None:
        self.w, self.comm, self.cfg, self.betas, self.eps, self.t = w, comm, cfg, betas, eps, 0
        self.rows = {k: np.split(v, comm.world)[comm.rank] for k, v in w.items()}  # views
        self.moments = {k: (np.zeros_like(r), np.zeros_like(r)) for k, r in self.rows.items()}

    def step(self, gm: lg.GradientManager, s: Any) -> None:
        """One update from the completed step's shards (``numpy()``: a host copy of device memory)."""
        grads = {(layer, n): gm.non_block_shard(n, s) if layer < 0 else gm.block_shard(layer, s)[n]
                 for layer, n in self.w}
        self.t += 1
        (b1, b2), lr = self.betas, self.cfg.lr * min(1.0, self.t / max(1, self.cfg.warmup))
        for key, shard in grads.items():
            g, p, (m, v) = shard.numpy().astype(np.float32), self.rows[key], self.moments[key]
            m += (1 - b1) * (g - m)
            v += (1 - b2) * (g * g - v)
            if p.ndim == 2:
                p *= 1 - lr * self.cfg.weight_decay  # decoupled weight decay, matrices only
            p -= (lr / (1 - b1 ** self.t)) * m / (np.sqrt(v / (1 - b2 ** self.t)) + self.eps)
        if self.comm.world > 1:
            for key, full in self.w.items():
                parts = self.comm.host_allgather(self.rows[key].tobytes())
                full[...] = np.frombuffer(b"".join(parts), np.float32).reshape(full.shape)


# ---- training ----------------------------------------------------------------------------------
def evaluate(w: dict[Key, np.ndarray], corpus: Corpus, cfg: Config, size: int = 2048) -> float:
    """Mean loss on fixed held-out positions (forward only)."""
    ctx, y = corpus.batch(corpus.val, np.random.default_rng(12345), size, cfg.context)
    return cross_entropy(forward(w, cfg.layers, ctx)[0], y)[0]


def run_rank(comm: Any, cfg: Config, corpus: Corpus) -> dict[str, Any]:
    """One rank: train, return its loss curve."""
    rank, dev = comm.rank, comm.device
    say: Callable[[str], None] = (lambda line: print(line, flush=True)) if rank == 0 and not cfg.quiet else \
        (lambda line: None)
    layout = layout_of(cfg, corpus.vocab)
    w = init_weights(layout, cfg.seed)
    engine_seed = int(np.random.SeedSequence([cfg.seed, rank, 1]).generate_state(1, np.uint64)[0])  # not gm's
    s = dev.stream()  # the engine stream: every lowgrad call gets it
    with lg.create_gradient_manager(layout, comm, strategy=cfg.strategy, offload=cfg.offload,
                                    dtype=lg.fp32 if cfg.accum == "fp32" else lg.bf16, seed=cfg.seed) as gm:
        hand, opt = Handoff(dev, s, cfg.accum, engine_seed), AdamW(w, comm, cfg)
        val_start, losses, t0 = evaluate(w, corpus, cfg), [], time.perf_counter()
        say(f"{cfg.label}: vocab {corpus.vocab}, {layout.total_numel} parameters, "
            f"{cfg.batch * cfg.micro_steps * comm.world} examples per step; held-out loss {val_start:.3f}")
        for step in range(cfg.steps):
            loss = 0.0
            for micro in range(cfg.micro_steps):
                ctx, y = Corpus.batch(corpus.train, np.random.default_rng([cfg.seed, rank, step, micro]), cfg.batch,
                                      cfg.context)
                loss += micro_step(gm, hand, w, cfg, ctx, y, step, micro) / cfg.micro_steps
            losses.append(loss)
            if cfg.log_every and (step % cfg.log_every == 0 or step == cfg.steps - 1):
                norm = math.sqrt(float(gm.grad_norm_squared(s)))  # a collective: every rank calls it
                ms = 1e3 * (time.perf_counter() - t0) / (step + 1)
                say(f"step {step:4d}  loss {loss:.3f}  |grad| {norm:.3f}  {ms:.1f} ms/step")
            opt.step(gm, s)
        seconds, val_end = time.perf_counter() - t0, evaluate(w, corpus, cfg)
    say(f"held-out loss {val_start:.3f} -> {val_end:.3f} in {seconds:.1f} s")
    return {"loss": losses, "val_start": val_start, "val_end": val_end, "seconds": seconds}


def train(cfg: Config, corpus: Corpus | None = None) -> dict[str, Any]:
    """Train on ``cfg.world`` ranks (threads); the loss curve is the mean over ranks."""
    cfg = cfg.resolved()
    corpus = corpus or Corpus(Path(cfg.text).read_text(encoding="utf-8"))
    results = lg.run_threads(cfg.world, lambda comm: run_rank(comm, cfg, corpus), backend=cfg.device)
    return {"label": cfg.label, "config": asdict(cfg), "loss": np.mean([r["loss"] for r in results], 0).tolist(),
            "val_start": results[0]["val_start"], "val_end": results[0]["val_end"],
            "seconds": max(r["seconds"] for r in results)}


def verdict(run: dict[str, Any]) -> tuple[bool, str]:
    """PASS when every loss is finite and the held-out loss fell: the model learned through
    lowgrad's gradients. The line says what was checked."""
    loss = run["loss"]
    k = max(1, len(loss) // 4)
    finite = all(math.isfinite(x) for x in [*loss, run["val_start"], run["val_end"]])
    fell = run["val_end"] < run["val_start"]
    what = (f"held-out loss {run['val_start']:.3f} -> {run['val_end']:.3f}, training loss {loss[0]:.3f} -> "
            f"{sum(loss[-k:]) / k:.3f} (mean of the last {k} of {len(loss)} steps), {run['label']}")
    if finite and fell:
        return True, f"PASS: the held-out loss fell and every loss is finite: {what}"
    return False, f"FAIL: {'a loss is not finite' if not finite else 'the held-out loss did not fall'}: {what}"


# ---- the command line: it runs, or says why in one line (exit status 2) --------------------------
def parse_args(argv: list[str] | None = None) -> tuple[Config, argparse.Namespace]:
    d = Config()
    p = Parser("train_lm", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("host", "cuda"), default=d.device,
                   help="lowgrad backend: host (the CPU, default) or cuda (one GPU per rank)")
    p.add_argument("--accum", choices=ACCUM, default=d.accum)
    p.add_argument("--strategy", choices=tuple(STRATEGIES), default=None,
                   help="default: scatter_reduce (unsharded for --accum rn_bf16)")
    p.add_argument("--offload", nargs="?", const="on", choices=("off", "on"), default="off",
                   help="shards in pinned host memory (--offload alone is on, as in lowgrad demo)")
    for name in ("world", "steps", "micro_steps", "batch", "context", "embed", "hidden", "layers", "warmup",
                 "seed", "log_every"):
        low = 0 if name in ("warmup", "seed", "log_every") else 1
        p.add_argument("--" + name.replace("_", "-"), type=int_at_least(low), default=getattr(d, name))
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--text", default=d.text, help="training text (default: examples/tiny_text.txt)")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--json", help="write the loss curve (and config) here")
    a = p.parse_args(argv)
    a.offload = a.offload == "on"
    try:
        cfg = Config(**{k: v for k, v in vars(a).items() if k in Config.__dataclass_fields__ and v is not None})
        return cfg.resolved(), a
    except ValueError as exc:
        p.error(str(exc))


def check_setup(cfg: Config, json_out: str | None) -> Corpus:
    """The text, a world the layout shards over, the GPUs, the output folder: :class:`CannotRun`
    before anything is built; returns the corpus."""
    try:
        corpus = Corpus(Path(cfg.text).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise CannotRun(f"--text {cfg.text}: {exc}") from None
    if min(len(corpus.train), len(corpus.val)) <= cfg.context:
        raise CannotRun(f"--text {cfg.text} is too short for --context {cfg.context}")
    check_world(layout_of(cfg, corpus.vocab), cfg.world)
    if cfg.device == "cuda":
        require_cuda(cfg.world, host_hint="--device host (the default) trains on the CPU")
    if json_out and not Path(json_out).resolve().parent.is_dir():
        raise CannotRun(f"--json {json_out}: no such directory")
    return corpus


def main(argv: list[str] | None = None) -> int:
    """Train, write ``--json``, end with the verdict line: exit status 0 on PASS, 1 on FAIL."""
    cfg, a = parse_args(argv)
    run = train(cfg, check_setup(cfg, a.json))
    if a.json:
        Path(a.json).write_text(json.dumps(run, indent=1) + "\n", encoding="utf-8")
    ok, line = verdict(run)
    print(line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(run("train_lm", main))
