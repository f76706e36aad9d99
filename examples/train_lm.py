#!/usr/bin/env python
"""A character-level MLP language model trained through a lowgrad gradient manager.

The model reads the previous ``K`` characters and predicts the next one::

    x      = concat(embed[c_1], ..., embed[c_K])             (B, K*E)
    h_0    = tanh(x @ w_in.T)                                 (B, H)
    h_l+1  = h_l + tanh(h_l @ w_l.T + b_l)    l = 0 .. L-1    L identical residual blocks
    logits = h_L @ head.T                                     (B, V)

which maps onto a :class:`lowgrad.Layout`: block parameters ``w (H, H)`` and ``b (H,)``,
non-block parameters ``embed (V, E)``, ``w_in (H, K*E)`` and ``head (V, H)`` (V is the
character vocabulary padded to a multiple of 16 so that every dim 0 shards evenly).

Who does what:

- this file (the *engine*): forward and backward by hand, and each gradient written into the
  tensor the manager hands out, the moment backward produces it (``--accum`` says how);
- lowgrad (the *gradient manager*): accumulation over micro-steps, the mean over ranks,
  sharding (``--strategy``), optionally pinned-host shards (``--offload``);
- this file again (the *optimizer*): AdamW in fp32 on the shard this rank owns (fp32 master
  weights and moments), then an all-gather of the updated weights.

Streams: each rank has one engine stream ``s = device.stream()``. Every array operation runs on
``s`` (numpy is eager; CuPy and PyTorch are made to run on ``s`` through their ExternalStream),
and every lowgrad call is given ``s``. The manager runs its exchanges on its own communication
stream and orders it against ``s`` with events; no host synchronisation is needed except to
read the loss.

Gradient accumulation (``--accum``):

- ``sr_bf16`` (default): bf16 gradients, and every rounding to bf16 is stochastic: the engine
  writes ``SR(g)`` (or ``SR(t + g)`` when the manager says accumulate) with
  ``lowgrad.ops.add_sr`` from an fp32 scratch tensor, and the manager accumulates the
  micro-steps into the shards with SR. Unbiased.
- ``fp32``: fp32 gradients, written and added in fp32: the reference, no bf16 rounding.
- ``rn_bf16``: bf16 gradients accumulated by the engine with round-to-nearest-even,
  ``t = RN(t + g)``, which is what ``grad += g`` on a bf16 tensor does in a framework.
  Contributions below half an ulp of the running sum are lost, always in the same direction.
  Only the unsharded manager leaves the accumulation to the engine (the sharded ones always
  use SR), so this mode needs ``--strategy unsharded``; at ``--world > 1`` the mean over ranks
  is a bf16 reduce-scatter (round to nearest) too. The bias grows with ``--micro-steps``.

Run (from the repository root)::

    python examples/train_lm.py                                   # numpy, host backend, 1 rank
    python examples/train_lm.py --world 2 --strategy all_to_all   # 2 ranks as threads
    python examples/train_lm.py --accum fp32 --json fp32.json
    python examples/train_lm.py --json sr.json --compare fp32.json --plot losses.png
    python examples/train_lm.py --backend torch                   # GPU 0, PyTorch math
    python examples/train_lm.py --backend cupy --offload          # GPU 0, CuPy math
    python examples/train_lm.py --backend torch --device host     # PyTorch on the CPU (CI)
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, NoReturn

try:
    import numpy as np
    try:
        import lowgrad as lg
    except ImportError:  # run from a checkout without installing: use the package next to examples/
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        import lowgrad as lg
    from lowgrad.sr.seeds import NON_BLOCK_LAYER, use_seed
except ImportError as _exc:  # said in one line, exit status 2 (see main)
    print(f"{Path(sys.argv[0]).name}: needs lowgrad and its dependencies in this Python ({_exc}): "
          'pip install ".[cu12]" from the repository, or run it with the Python lowgrad is installed in',
          file=sys.stderr)
    sys.exit(2)

Array = Any  # a numpy, CuPy or PyTorch array
DEFAULT_TEXT = Path(__file__).with_name("tiny_text.txt")
STRATEGIES = ("unsharded", "scatter_reduce", "all_to_all")
ACCUM = ("sr_bf16", "fp32", "rn_bf16")
BACKENDS = ("numpy", "cupy", "torch")
_ENGINE_SALT = 0xE6E6  # keeps the engine's SR noise independent of the manager's


@dataclass(frozen=True)
class Config:
    backend: str = "numpy"      # array library of forward, backward and optimizer
    device: str = ""            # lowgrad backend, "host" or "cuda" ("": host for numpy, else cuda)
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
        """Fill the defaults that depend on other options and reject impossible combinations."""
        device = self.device or ("host" if self.backend == "numpy" else "cuda")
        strategy = self.strategy or ("unsharded" if self.accum == "rn_bf16" else "scatter_reduce")
        if self.backend not in BACKENDS or self.accum not in ACCUM or strategy not in STRATEGIES:
            raise ValueError(f"backend/accum/strategy must be in {BACKENDS}/{ACCUM}/{STRATEGIES}")
        if device not in ("host", "cuda") or (self.backend, device) in (("numpy", "cuda"), ("cupy", "host")):
            raise ValueError(f"--backend {self.backend} cannot run on --device {device}")
        if self.accum == "rn_bf16" and strategy != "unsharded":
            raise ValueError("--accum rn_bf16 needs --strategy unsharded (the sharded managers accumulate with SR)")
        if self.offload and strategy == "unsharded":
            raise ValueError("--offload applies to the sharded strategies")
        return replace(self, device=device, strategy=strategy)

    @property
    def grad_dtype(self) -> lg.DType:
        return lg.fp32 if self.accum == "fp32" else lg.bf16

    @property
    def label(self) -> str:
        return (f"{self.backend}/{self.device} {self.accum} {self.strategy}{' offload' if self.offload else ''} "
                f"world {self.world}{f' seed {self.seed}' if self.seed else ''}")


# ---- data ----------------------------------------------------------------------------------
class Corpus:
    """Characters of a text as ids; 90 % for training, the rest held out."""

    def __init__(self, text: str, vocab_multiple: int = 16) -> None:
        self.chars = sorted(set(text))
        self.vocab = -(-len(self.chars) // vocab_multiple) * vocab_multiple  # padded: shards evenly
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


# ---- array backends ------------------------------------------------------------------------
class Backend(ABC):
    """The few things the model, the gradient hand-off and the optimizer need from an array
    library. Everything else is written once: ``@``, ``+``, ``*``, indexing and in-place ops mean
    the same in numpy, CuPy and PyTorch."""

    def __init__(self, device: Any) -> None:
        self.device = device  # the lowgrad device

    def on(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """Make the library run on lowgrad ``stream`` inside the ``with`` block."""
        return contextlib.nullcontext()

    @abstractmethod
    def asarray(self, a: np.ndarray) -> Array:
        """A host numpy array on this backend's device (copied on the current stream)."""

    @abstractmethod
    def view32(self, t: lg.Tensor) -> Array:
        """A writable array over the memory of fp32 lowgrad tensor ``t`` (no copy)."""

    @abstractmethod
    def read32(self, t: lg.Tensor) -> Array:
        """The values of fp32 or bf16 tensor ``t`` as an fp32 array (a view for fp32)."""

    @abstractmethod
    def write_bf16_rn(self, t: lg.Tensor, g: Array, accumulate: bool) -> None:
        """``t = RN(t + g)`` (or ``RN(g)``) into bf16 tensor ``t``, round to nearest even."""

    # elementwise math and reductions
    @abstractmethod
    def tanh(self, x: Array) -> Array: ...
    @abstractmethod
    def exp(self, x: Array) -> Array: ...
    @abstractmethod
    def log(self, x: Array) -> Array: ...
    @abstractmethod
    def sqrt(self, x: Array) -> Array: ...
    @abstractmethod
    def sum(self, x: Array, axis: int | None = None, keepdims: bool = False) -> Array: ...
    @abstractmethod
    def amax(self, x: Array, axis: int, keepdims: bool = False) -> Array: ...
    @abstractmethod
    def onehot(self, idx: Array, n: int) -> Array:
        """fp32 (len(idx), n) with ones at ``idx`` (1-D int64)."""


class XpBackend(Backend):
    """numpy and CuPy share one API (``xp``)."""

    xp: Any = np

    def tanh(self, x: Array) -> Array:
        return self.xp.tanh(x)

    def exp(self, x: Array) -> Array:
        return self.xp.exp(x)

    def log(self, x: Array) -> Array:
        return self.xp.log(x)

    def sqrt(self, x: Array) -> Array:
        return self.xp.sqrt(x)

    def sum(self, x: Array, axis: int | None = None, keepdims: bool = False) -> Array:
        return x.sum(axis=axis, keepdims=keepdims)

    def amax(self, x: Array, axis: int, keepdims: bool = False) -> Array:
        return x.max(axis=axis, keepdims=keepdims)

    def onehot(self, idx: Array, n: int) -> Array:
        return (idx[:, None] == self.xp.arange(n)[None, :]).astype(self.xp.float32)


class NumpyBackend(XpBackend):
    """lowgrad's host backend: every tensor's ``numpy()`` is a writable view of its memory."""

    def asarray(self, a: np.ndarray) -> Array:
        return a

    def view32(self, t: lg.Tensor) -> Array:
        return t.numpy()

    def read32(self, t: lg.Tensor) -> Array:
        return t.numpy() if t.dtype is lg.fp32 else t.numpy().astype(np.float32)

    def write_bf16_rn(self, t: lg.Tensor, g: Array, accumulate: bool) -> None:
        v = t.numpy()
        v[...] = (v.astype(np.float32) + g if accumulate else g).astype(lg.bf16.np)  # ml_dtypes: RN-even


def bf16_bits_to_f32(xp: Any, bits: Array) -> Array:
    """bf16 bit patterns (uint16) to fp32 values: the bits are the high half of an fp32."""
    return (bits.astype(xp.uint32) << xp.uint32(16)).view(xp.float32)


def f32_to_bf16_bits_rn(xp: Any, x: Array) -> Array:
    """fp32 values to bf16 bit patterns, round to nearest even (finite values)."""
    u = xp.ascontiguousarray(x, dtype=xp.float32).view(xp.uint32)
    return ((u + (xp.uint32(0x7FFF) + ((u >> xp.uint32(16)) & xp.uint32(1)))) >> xp.uint32(16)).astype(xp.uint16)


class CupyBackend(XpBackend):
    """CuPy on a lowgrad ``Device``. fp32 tensors are viewed through ``__cuda_array_interface__``;
    CuPy has no bf16, so bf16 tensors are viewed as their uint16 bit patterns."""

    def __init__(self, device: Any) -> None:
        super().__init__(device)
        import cupy
        self.xp = cupy

    def on(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        cp, es = self.xp, contextlib.ExitStack()
        es.enter_context(cp.cuda.Device(self.device.ordinal))
        es.enter_context(cp.cuda.ExternalStream(stream.handle))  # CuPy's current stream is now s
        return es

    def asarray(self, a: np.ndarray) -> Array:
        return self.xp.asarray(a)

    def view32(self, t: lg.Tensor) -> Array:
        assert t.dtype is lg.fp32 and t.kind == "device"
        return self.xp.asarray(t)  # zero-copy through __cuda_array_interface__

    def _bits(self, t: lg.Tensor) -> Array:
        """The raw bf16 bits of device tensor ``t`` as a uint16 CuPy array (no copy)."""
        assert t.dtype is lg.bf16 and t.kind == "device"
        cp = self.xp
        mem = cp.cuda.UnownedMemory(t.ptr, t.nbytes, t)  # keeps ``t`` (and its memory) alive
        return cp.ndarray(t.shape, dtype=cp.uint16, memptr=cp.cuda.MemoryPointer(mem, 0))

    def read32(self, t: lg.Tensor) -> Array:
        return self.view32(t) if t.dtype is lg.fp32 else bf16_bits_to_f32(self.xp, self._bits(t))

    def write_bf16_rn(self, t: lg.Tensor, g: Array, accumulate: bool) -> None:
        bits = self._bits(t)
        x = bf16_bits_to_f32(self.xp, bits) + g if accumulate else g
        bits[...] = f32_to_bf16_bits_rn(self.xp, x)


class TorchBackend(Backend):
    """PyTorch on a lowgrad ``Device`` (CUDA tensors) or ``HostDevice`` (CPU tensors): lowgrad
    tensors of both dtypes are viewed without a copy (``torch.from_dlpack`` on the GPU)."""

    def __init__(self, device: Any) -> None:
        super().__init__(device)
        import torch
        self.torch = torch
        self.cuda = device.backend == "cuda"
        self.tdev = torch.device("cuda", device.ordinal) if self.cuda else torch.device("cpu")

    def on(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        if not self.cuda:
            return contextlib.nullcontext()
        self.torch.cuda.set_device(self.tdev)
        ext = self.torch.cuda.ExternalStream(stream.handle, device=self.tdev)
        return self.torch.cuda.stream(ext)  # PyTorch's current stream is now s

    def asarray(self, a: np.ndarray) -> Array:
        return self.torch.from_numpy(a).to(self.tdev)

    def _view(self, t: lg.Tensor) -> Array:
        """A PyTorch tensor over ``t``'s memory (fp32 or bf16, no copy)."""
        if self.cuda:
            return self.torch.from_dlpack(t)
        # host backend: through numpy (its DLPack export names a CUDA device for host tensors)
        if t.dtype is lg.bf16:
            return self.torch.from_numpy(t.numpy().view(np.uint16)).view(self.torch.bfloat16)
        return self.torch.from_numpy(t.numpy())

    def view32(self, t: lg.Tensor) -> Array:
        assert t.dtype is lg.fp32
        return self._view(t)

    def read32(self, t: lg.Tensor) -> Array:
        return self._view(t).float()  # fp32: the view itself; bf16: a converted copy

    def write_bf16_rn(self, t: lg.Tensor, g: Array, accumulate: bool) -> None:
        v = self._view(t)  # a bf16 view
        v.copy_(v.float() + g if accumulate else g)  # fp32 -> bf16 conversion rounds to nearest even

    def tanh(self, x: Array) -> Array:
        return self.torch.tanh(x)

    def exp(self, x: Array) -> Array:
        return self.torch.exp(x)

    def log(self, x: Array) -> Array:
        return self.torch.log(x)

    def sqrt(self, x: Array) -> Array:
        return self.torch.sqrt(x)

    def sum(self, x: Array, axis: int | None = None, keepdims: bool = False) -> Array:
        return x.sum() if axis is None else x.sum(dim=axis, keepdim=keepdims)

    def amax(self, x: Array, axis: int, keepdims: bool = False) -> Array:
        return x.amax(dim=axis, keepdim=keepdims)

    def onehot(self, idx: Array, n: int) -> Array:
        return self.torch.nn.functional.one_hot(idx, n).to(self.torch.float32)


def make_backend(name: str, device: Any) -> Backend:
    backends: dict[str, type[Backend]] = {"numpy": NumpyBackend, "cupy": CupyBackend, "torch": TorchBackend}
    return backends[name](device)


# ---- the model -----------------------------------------------------------------------------
class Model:
    """fp32 weights in lowgrad memory (the same on every rank), and backend views of them."""

    def __init__(self, be: Backend, cfg: Config, layout: lg.Layout) -> None:
        rng = np.random.default_rng(cfg.seed)  # same initial weights on every rank
        dev, H, K, E = be.device, cfg.hidden, cfg.context, cfg.embed
        init: dict[str, np.ndarray] = {
            "embed": rng.standard_normal(layout.non_block[0].shape),
            "w_in": rng.standard_normal(layout.non_block[1].shape) / math.sqrt(K * E),
            "head": rng.standard_normal(layout.non_block[2].shape) * 0.02,  # starts at loss ~ ln V
        }
        blocks = [{"w": rng.standard_normal((H, H)) * 0.5 / math.sqrt(H), "b": np.zeros(H)}
                  for _ in range(cfg.layers)]

        def f32(a: np.ndarray, n: str) -> lg.Tensor:
            return lg.from_numpy(a.astype(np.float32), dev, name=f"weight.{n}")

        self.non_block = {n: f32(a, n) for n, a in init.items()}                  # lowgrad tensors
        self.blocks = [{n: f32(a, n) for n, a in b.items()} for b in blocks]
        self.nb = {n: be.view32(t) for n, t in self.non_block.items()}             # backend views
        self.bl = [{n: be.view32(t) for n, t in b.items()} for b in self.blocks]


class Handoff:
    """Hands each gradient to the manager as soon as backward produced it. Every call is on the
    engine stream ``s``; the manager's exchanges run on its own stream, after ``s`` (events)."""

    def __init__(self, gm: Any, layout: lg.Layout, be: Backend, stream: Any, mode: str, seed: int,
                 rank: int) -> None:
        self.gm, self.layout, self.be, self.s, self.mode = gm, layout, be, stream, mode
        words = np.random.SeedSequence([seed, rank, _ENGINE_SALT]).generate_state(2, np.uint32)
        self.seed = int(words[0]) | int(words[1]) << 32  # per rank: independent noise on each rank
        self.step = self.micro = 0
        self._scratch: dict[tuple[int, ...], tuple[lg.Tensor, Array]] = {}

    def start(self, step: int, micro: int, total: int) -> None:
        self.step, self.micro = step, micro
        self.gm.start_micro_step(self.s, micro, total)

    def non_block(self, name: str, g: Array) -> None:
        t, accumulate = self.gm.non_block_full(name, self.s)  # zero_init tensors zeroed on s
        self.write(t, g, accumulate, NON_BLOCK_LAYER, self.layout.non_block_index(name))
        self.gm.notify_non_block(name, self.s)

    def block(self, layer: int, grads: dict[str, Array]) -> None:
        dw, accumulate = self.gm.block_full(layer, self.s)  # s waits until this buffer is free again
        for i, spec in enumerate(self.layout.block):
            self.write(dw[spec.name], grads[spec.name], accumulate or spec.zero_init, layer, i)
        self.gm.notify_block(layer, self.s)  # the exchange is queued on the manager's stream, after s

    def end(self) -> None:
        self.gm.end_micro_step(self.s)  # s waits for all of this micro-step's gradient traffic

    def write(self, t: lg.Tensor, g: Array, accumulate: bool, layer: int, index: int) -> None:
        """``t = g`` or ``t += g`` (fp32 ``g``) into gradient tensor ``t``, as ``--accum`` says."""
        be, s = self.be, self.s
        if t.dtype is lg.fp32:  # --accum fp32: exact
            v = be.view32(t)
            if accumulate:
                v += g
            else:
                v[...] = g
        elif self.mode == "rn_bf16":
            be.write_bf16_rn(t, g, accumulate)
        else:  # sr_bf16: g goes through an fp32 lowgrad scratch tensor into add_sr, all on s
            scratch, view = self._scratch_for(t.shape)
            view[...] = g
            seed = use_seed(self.seed, self.step, self.micro, layer, index, 0)
            if accumulate:
                lg.ops.add_sr(t, t, scratch, scale=1.0, seed=seed, stream=s)  # t = SR(t + g)
            else:
                lg.ops.add_sr(t, scratch, scratch, scale=0.5, seed=seed, stream=s)  # t = SR(g): 0.5(g+g) is g

    def _scratch_for(self, shape: tuple[int, ...]) -> tuple[lg.Tensor, Array]:
        if shape not in self._scratch:
            t = self.be.device.alloc(shape, lg.fp32, name="engine_scratch")
            self._scratch[shape] = (t, self.be.view32(t))
        return self._scratch[shape]


def forward(be: Backend, m: Model, ctx: Array) -> tuple[Array, list[Array], list[Array], Array]:
    """(logits, block inputs h_0..h_L, block outputs z_0..z_L-1, input x)."""
    B, K = ctx.shape
    x = m.nb["embed"][ctx].reshape(B, K * m.nb["embed"].shape[1])
    h = be.tanh(x @ m.nb["w_in"].T)
    hs, zs = [h], []
    for blk in m.bl:
        z = be.tanh(h @ blk["w"].T + blk["b"])
        h = h + z
        hs.append(h)
        zs.append(z)
    return h @ m.nb["head"].T, hs, zs, x


def cross_entropy(be: Backend, logits: Array, y: Array) -> tuple[Array, Array]:
    """(mean loss, its gradient with respect to the logits)."""
    B, V = logits.shape
    top = be.amax(logits, 1, keepdims=True)
    e = be.exp(logits - top)
    total = be.sum(e, 1, keepdims=True)
    onehot = be.onehot(y, V)
    loss = be.sum(be.log(total) + top - be.sum(logits * onehot, 1, keepdims=True)) / B
    return loss, (e / total - onehot) / B


def train_micro_step(be: Backend, m: Model, hand: Handoff, ctx: Array, y: Array, scale: float) -> Array:
    """Forward, loss, and backward; gradients (of ``scale`` x the mean loss) go to ``hand`` in the
    order backward produces them: head, blocks L-1 .. 0, w_in, embed."""
    logits, hs, zs, x = forward(be, m, ctx)
    loss, dlogits = cross_entropy(be, logits, y)
    dlogits = dlogits * scale
    hand.non_block("head", dlogits.T @ hs[-1])
    dh = dlogits @ m.nb["head"]
    for layer in reversed(range(len(m.bl))):
        dz = dh * (1 - zs[layer] * zs[layer])
        hand.block(layer, {"w": dz.T @ hs[layer], "b": be.sum(dz, 0)})
        dh = dh + dz @ m.bl[layer]["w"]
    da = dh * (1 - hs[0] * hs[0])
    hand.non_block("w_in", da.T @ x)
    B, K = ctx.shape
    dx = (da @ m.nb["w_in"]).reshape(B * K, -1)
    hand.non_block("embed", be.onehot(ctx.reshape(-1), m.nb["embed"].shape[0]).T @ dx)
    return loss


# ---- the optimizer -------------------------------------------------------------------------
class ShardedAdamW:
    """AdamW on the rows of each parameter this rank owns (``shard_view(w, rank, world)``: the fp32
    master copy), with fp32 moments of the shard's shape in lowgrad memory on the same device.
    After the update the full weights are all-gathered in place (world 1: nothing to gather)."""

    def __init__(self, be: Backend, comm: Any, m: Model, stream: Any, cfg: Config,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8) -> None:
        self.be, self.comm, self.model, self.s, self.cfg = be, comm, m, stream, cfg
        self.betas, self.eps, self.t = betas, eps, 0
        dev, self.dev = be.device, be.device
        self.params: dict[tuple[int, str], tuple[lg.Tensor, Array, Array, Array]] = {}
        self._staging: dict[tuple[int, str], lg.Tensor] = {}
        named = [((-1, n), w) for n, w in m.non_block.items()]
        named += [((l, n), w) for l, b in enumerate(m.blocks) for n, w in b.items()]
        for key, w in named:
            master = lg.shard_view(w, comm.rank, comm.world)
            mom = [dev.alloc(master.shape, lg.fp32, name="adam_moments") for _ in range(2)]
            for t in mom:
                lg.ops.fill_zero(t, stream=stream)
            self.params[key] = (w, be.view32(master), be.view32(mom[0]), be.view32(mom[1]))

    def step(self, gm: Any) -> None:
        """One update from the manager's shards; everything is queued on ``s``."""
        self.t += 1
        for layer in range(self.cfg.layers):
            shards = gm.block_shard(layer, self.s)  # s waits until layer's shards are final
            for name, g in shards.items():
                self._update((layer, name), g)
        for name in self.model.non_block:
            self._update((-1, name), gm.non_block_shard(name, self.s))  # s waits for the reduce-scatter
        if self.comm.world > 1:
            for w, *_ in self.params.values():
                self.comm.all_gather(w, stream=self.s)  # in place: every rank's updated rows

    def _update(self, key: tuple[int, str], grad: lg.Tensor) -> None:
        (b1, b2), wd = self.betas, self.cfg.weight_decay
        lr = self.cfg.lr * min(1.0, self.t / max(1, self.cfg.warmup))
        w, p, m, v = self.params[key]
        g = self.be.read32(self._device_copy(key, grad))
        m *= b1
        m += (1 - b1) * g
        v *= b2
        v += (1 - b2) * (g * g)
        if w.ndim == 2:
            p *= 1 - lr * wd  # decoupled weight decay, matrices only
        p -= (lr / (1 - b1 ** self.t)) * m / (self.be.sqrt(v / (1 - b2 ** self.t)) + self.eps)

    def _device_copy(self, key: tuple[int, str], grad: lg.Tensor) -> lg.Tensor:
        """Offloaded shards live in pinned host memory: copy them to the GPU first (on ``s``)."""
        if grad.kind == "device" or self.dev.backend != "cuda":
            return grad
        if key not in self._staging:
            self._staging[key] = self.dev.alloc(grad.shape, grad.dtype, name="grad_staging")
        lg.ops.copy(self._staging[key], grad, stream=self.s)
        return self._staging[key]


# ---- training ------------------------------------------------------------------------------
def evaluate(be: Backend, m: Model, corpus: Corpus, cfg: Config, size: int = 2048) -> float:
    """Mean loss on fixed held-out positions (forward only)."""
    ctx, y = corpus.batch(corpus.val, np.random.default_rng(12345), size, cfg.context)
    total = 0.0
    for i in range(0, size, 512):
        logits, *_ = forward(be, m, be.asarray(ctx[i:i + 512]))
        total += float(cross_entropy(be, logits, be.asarray(y[i:i + 512]))[0]) * len(y[i:i + 512])
    return total / size


def run_rank(comm: Any, cfg: Config, corpus: Corpus) -> dict[str, Any]:
    """One rank: build everything on ``comm.device``, train, return the loss curve."""
    be = make_backend(cfg.backend, comm.device)
    dev, rank, M = comm.device, comm.rank, cfg.micro_steps
    s = dev.stream()  # the engine stream
    say: Callable[..., None] = (lambda *a: print(*a, flush=True)) if rank == 0 and not cfg.quiet else (lambda *a: None)
    with be.on(s):
        layout = layout_of(cfg, corpus.vocab)
        model = Model(be, cfg, layout)
        gm = lg.create_gradient_manager(layout, comm, strategy=cfg.strategy, offload=cfg.offload,
                                        dtype=cfg.grad_dtype, seed=cfg.seed)
        hand = Handoff(gm, layout, be, s, cfg.accum, cfg.seed, rank)
        opt = ShardedAdamW(be, comm, model, s, cfg)
        dev.synchronize()  # the synchronous weight uploads are complete before s uses them
        val_start = evaluate(be, model, corpus, cfg)
        say(f"{cfg.label}: vocab {corpus.vocab}, {layout.total_numel} parameters, "
            f"{cfg.batch * M * comm.world} examples per step; held-out loss {val_start:.3f}")
        losses: list[float] = []
        t0 = time.perf_counter()
        for step in range(cfg.steps):
            loss = 0.0
            for micro in range(M):
                rng = np.random.default_rng([cfg.seed, rank, step, micro])
                ctx, y = Corpus.batch(corpus.train, rng, cfg.batch, cfg.context)
                hand.start(step, micro, M)
                loss = loss + train_micro_step(be, model, hand, be.asarray(ctx), be.asarray(y), 1.0 / M)
                hand.end()
            log = cfg.log_every > 0 and (step % cfg.log_every == 0 or step == cfg.steps - 1)
            if log:  # a collective: every rank calls it
                norm = math.sqrt(float(gm.grad_norm_squared(s).numpy()[0]))
            opt.step(gm)
            losses.append(float(loss) / M)  # reads the loss: synchronises s
            if log:
                ms = 1e3 * (time.perf_counter() - t0) / (step + 1)
                say(f"step {step:4d}  loss {losses[-1]:.3f}  |grad| {norm:.3f}  {ms:.1f} ms/step")
        seconds = time.perf_counter() - t0
        val_end = evaluate(be, model, corpus, cfg)
        s.synchronize()
        say(f"held-out loss {val_start:.3f} -> {val_end:.3f} in {seconds:.1f} s")
        gm.close()
    return {"loss": losses, "val_start": val_start, "val_end": val_end, "seconds": seconds}


def train(cfg: Config) -> dict[str, Any]:
    """Train on ``cfg.world`` ranks (threads); the loss curve is the mean over ranks."""
    cfg = cfg.resolved()
    corpus = Corpus(Path(cfg.text).read_text(encoding="utf-8"))
    results = lg.run_threads(cfg.world, lambda comm: run_rank(comm, cfg, corpus), backend=cfg.device)
    curve = np.mean([r["loss"] for r in results], axis=0).tolist()
    return {"label": cfg.label, "config": asdict(cfg), "loss": curve, "val_start": results[0]["val_start"],
            "val_end": results[0]["val_end"], "seconds": max(r["seconds"] for r in results)}


def plot_curves(runs: list[dict[str, Any]], out: str) -> bool:
    """Loss against step for every run (dicts with ``label`` and ``loss``); False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no plot written ({NEEDS_MATPLOTLIB})", file=sys.stderr)
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in runs:
        ax.plot(range(len(r["loss"])), r["loss"], label=r["label"])
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/char)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return True


# ---- the command line: it runs, or says why in one line (exit status 2) ----------------------
NEEDS_MATPLOTLIB = 'needs matplotlib: pip install ".[plot]" (or pip install matplotlib)'


class CannotRun(Exception):
    """This setup cannot run (no GPU, a missing library, options that do not fit together): the
    message is the one line the user reads."""


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line, ``prog: error: MESSAGE (see --help)``, exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see --help)\n")


def cannot_run(prog: str, exc: BaseException) -> int:
    """Print ``prog: <why>`` as one line on stderr; exit status 2."""
    print(f"{prog}: {' '.join(str(exc).split())}", file=sys.stderr, flush=True)
    return 2


def missing_gpus(gpus: int = 1) -> str | None:
    """Why lowgrad's CUDA backend cannot run ``gpus`` ranks here (one per GPU), or None."""
    count = lg.device_count()
    if count == 0:
        try:
            lg.Device(0)  # raises with the reason: no driver, no GPU
        except lg.CudaUnavailableError as exc:
            return f"needs an NVIDIA GPU and driver (CUDA backend): {exc}"
        return "needs an NVIDIA GPU and driver (CUDA backend): no GPU visible"
    return f"needs {gpus} GPUs (one per rank), {count} visible" if count < gpus else None


def check_setup(cfg: Config, a: argparse.Namespace) -> Corpus:
    """Everything this run needs, checked before anything is built: the text, a world the layout
    shards over, the GPUs and array library of ``--backend``/``--device``, matplotlib for
    ``--plot``, the output folder. :class:`CannotRun` says what is missing; returns the corpus."""
    try:
        corpus = Corpus(Path(cfg.text).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise CannotRun(f"--text {cfg.text}: {exc}") from None
    if min(len(corpus.train), len(corpus.val)) <= cfg.context:
        raise CannotRun(f"--text {cfg.text} is too short for --context {cfg.context}")
    try:
        layout_of(cfg, corpus.vocab).check_world(cfg.world)
    except ValueError as exc:
        raise CannotRun(f"--world {cfg.world}: {exc} (--hidden and the vocabulary padded to a multiple of 16 "
                        "must divide by the world)") from None
    if cfg.device == "cuda":
        why = missing_gpus(cfg.world)
        if why:
            raise CannotRun(f"--backend {cfg.backend} --device cuda {why}; on the CPU: --backend numpy (the "
                            "default) or --backend torch --device host")
    if cfg.backend == "torch":
        try:
            import torch
        except ImportError:
            raise CannotRun('--backend torch needs PyTorch: pip install ".[torch]"') from None
        if cfg.device == "cuda" and not torch.cuda.is_available():
            raise CannotRun(f"--backend torch --device cuda needs a CUDA build of PyTorch (torch {torch.__version__} "
                            "has no CUDA); --device host runs it on the CPU")
    if cfg.backend == "cupy":
        try:
            import cupy  # noqa: F401
        except ImportError:
            raise CannotRun("--backend cupy needs CuPy: pip install cupy-cuda12x (cupy-cuda13x for CUDA 13)") from None
    if a.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise CannotRun(f"--plot {NEEDS_MATPLOTLIB}") from None
    for f in a.compare:
        try:
            json.loads(Path(f).read_text(encoding="utf-8"))["loss"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CannotRun(f"--compare {f}: not a --json file of this example ({type(exc).__name__}: {exc})") from None
    for opt, out in (("--json", a.json), ("--plot", a.plot)):
        if out and not Path(out).resolve().parent.is_dir():
            raise CannotRun(f"{opt} {out}: no such directory")
    return corpus


def verdict(run: dict[str, Any]) -> tuple[bool, str]:
    """PASS when every loss is finite and the held-out loss (fixed positions, forward only) fell:
    the model learned through lowgrad's gradients. The line says what was checked."""
    loss = run["loss"]
    k = max(1, len(loss) // 4)
    end = sum(loss[-k:]) / k
    finite = all(math.isfinite(x) for x in [*loss, run["val_start"], run["val_end"]])
    fell = run["val_end"] < run["val_start"]
    what = (f"held-out loss {run['val_start']:.3f} -> {run['val_end']:.3f}, training loss {loss[0]:.3f} -> "
            f"{end:.3f} (mean of the last {k} of {len(loss)} steps), {run['label']}")
    if finite and fell:
        return True, f"PASS: the held-out loss fell and every loss is finite: {what}"
    why = "a loss is not finite" if not finite else "the held-out loss did not fall"
    return False, f"FAIL: {why}: {what}"


def _int_at_least(low: int) -> Any:
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {v}")
        return v
    return parse


def parse_args(argv: list[str] | None = None) -> tuple[Config, argparse.Namespace]:
    d = Config()
    p = OneLineParser(description=__doc__.split("\n\n")[0] + " Runs on the CPU (numpy, the default; or "
                      "--backend torch --device host); --backend torch|cupy on the GPU.")
    p.add_argument("--backend", choices=BACKENDS, default=d.backend)
    p.add_argument("--device", choices=("host", "cuda"), default=None,
                   help="lowgrad backend (default: host for numpy, cuda for cupy and torch)")
    p.add_argument("--accum", choices=ACCUM, default=d.accum)
    p.add_argument("--strategy", choices=STRATEGIES, default=None,
                   help="default: scatter_reduce (unsharded for --accum rn_bf16)")
    p.add_argument("--offload", action="store_true", help="block shards in pinned host memory")
    for name in ("world", "steps", "micro_steps", "batch", "context", "embed", "hidden", "layers", "warmup",
                 "seed", "log_every"):
        low = 0 if name in ("warmup", "seed", "log_every") else 1
        p.add_argument("--" + name.replace("_", "-"), type=_int_at_least(low), default=getattr(d, name))
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--text", default=d.text, help="training text (default: examples/tiny_text.txt)")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--json", help="write the loss curve (and config) here")
    p.add_argument("--compare", nargs="+", default=[], metavar="JSON", help="other runs' --json files to plot")
    p.add_argument("--plot", metavar="PNG", help="plot this run and the --compare runs (needs matplotlib)")
    a = p.parse_args(argv)
    fields = {k: v for k, v in vars(a).items() if k in Config.__dataclass_fields__ and v is not None}
    try:
        cfg = Config(**fields).resolved()
    except ValueError as exc:
        p.error(str(exc))
    return cfg, a


def main(argv: list[str] | None = None) -> int:
    """Train, write what was asked for, end with a verdict line: 0 on PASS, 1 on FAIL, 2 (one line
    on stderr, nothing run) for arguments or a setup this machine cannot run."""
    cfg, a = parse_args(argv)
    try:
        check_setup(cfg, a)
    except CannotRun as exc:
        return cannot_run("train_lm.py", exc)
    run = train(cfg)
    if a.json:
        Path(a.json).write_text(json.dumps(run, indent=1) + "\n", encoding="utf-8")
    if a.plot:
        runs = [run] + [json.loads(Path(f).read_text(encoding="utf-8")) for f in a.compare]
        if plot_curves(runs, a.plot):
            print(f"wrote {a.plot}")
    ok, line = verdict(run)
    print(line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
