"""lowgrad.torch on the CPU (host backend): the adapter's shards equal the manager driven by hand
with the same gradients, bit for bit, at world 1 and 2; within the SR bound of a float64 sum;
misuse raises; the clip coefficient against float64. Skipped without torch."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from helpers import strategy_configs

import lowgrad as lg
from lowgrad.base.errors import ProtocolError
from lowgrad.managers import STRATEGIES

torch = pytest.importorskip("torch")
from lowgrad.torch import attach, module_layout  # noqa: E402

H, FF, V, LAYERS = 8, 16, 12, 3


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm = torch.nn.Parameter(torch.ones(H))
        self.q_proj = torch.nn.Linear(H, H, bias=True)
        self.up_proj = torch.nn.Linear(H, FF, bias=False)
        self.down_proj = torch.nn.Linear(FF, H, bias=False)

    def forward(self, x: Any) -> Any:
        h = x * self.input_layernorm
        h = h + torch.tanh(self.q_proj(h))
        return x + self.down_proj(torch.relu(self.up_proj(h)))


class Tiny(torch.nn.Module):
    def __init__(self, seed: int = 0, skip: int | None = None) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(V, H)
        self.layers = torch.nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = torch.nn.Parameter(torch.ones(H))
        self.lm_head = torch.nn.Linear(H, V, bias=False)
        self.skip = skip  # a block the forward leaves out (misuse)
        gen = torch.Generator().manual_seed(seed)  # not the global RNG: ranks build models in threads
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        self.to(torch.bfloat16)

    def forward(self, tokens: Any) -> Any:
        x = self.embed_tokens(tokens)
        for i, blk in enumerate(self.layers):
            if i != self.skip:
                x = blk(x)
        return self.lm_head(x * self.norm)


def loss(model: Any, rank: int, m: int) -> Any:
    g = torch.Generator().manual_seed(1000 * rank + m)
    tokens = torch.randint(0, V, (4, 5), generator=g).to(next(model.parameters()).device)
    return torch.nn.functional.cross_entropy(model(tokens).float().reshape(-1, V), tokens.reshape(-1))


def grads(model: Any, rank: int, m: int) -> dict[str, np.ndarray]:
    """Plain PyTorch: one micro-batch's gradients (bf16 bits as uint16)."""
    model.zero_grad(set_to_none=True)
    loss(model, rank, m).backward()
    return {n: p.grad.view(torch.int16).cpu().numpy().view(np.uint16).copy() for n, p in model.named_parameters()}


def by_hand(comm: Any, layout: lg.Layout, per_micro: list[dict[str, np.ndarray]], strategy: str) -> dict[str, Any]:
    """The manager driven through its protocol with the given gradients (full names)."""
    gm = lg.create_gradient_manager(layout, comm, strategy=strategy, seed=7)
    M = len(per_micro)
    for m, g in enumerate(per_micro):
        gm.start_micro_step(None, m, M)
        for s in layout.non_block:
            t, acc = gm.non_block_full(s.name, None)
            add(t, g[s.name], acc)
            gm.notify_non_block(s.name, None)
        for layer in reversed(range(layout.num_layers)):
            dw, acc = gm.block_full(layer, None)
            for s in layout.block:
                add(dw[s.name], g[f"layers.{layer}.{s.name}"], acc)
            gm.notify_block(layer, None)
        gm.end_micro_step(None)
    out = shards(gm, layout)
    gm.close()
    return out


def add(t: lg.Tensor, bits: np.ndarray, accumulate: bool) -> None:
    view = t.numpy().reshape(-1).view(np.uint16)
    g = torch.from_numpy(bits.reshape(-1).view(np.int16)).view(torch.bfloat16)
    if accumulate:
        cur = torch.from_numpy(view.view(np.int16).copy()).view(torch.bfloat16)
        g = cur + g
    view[:] = g.view(torch.int16).numpy().view(np.uint16)


def shards(gm: Any, layout: lg.Layout, stream: Any = None) -> dict[str, Any]:
    out = {}
    for layer in range(layout.num_layers):
        c = gm.block_shard(layer, stream)
        for s in layout.block:
            out[f"{layer}.{s.name}"] = c[s.name].numpy().view(np.uint16).copy()
    for s in layout.non_block:
        out[s.name] = gm.non_block_shard(s.name, stream).numpy().view(np.uint16).copy()
    return out


def through_adapter(comm: Any, strategy: str, M: int, steps: int = 1, overlap: bool = True) -> dict[str, Any]:
    model = Tiny()
    att = attach(model, comm, strategy=strategy, seed=7, overlap=overlap)
    for _ in range(steps):
        for m in range(M):
            with att.micro_step(m, M):
                loss(model, comm.rank, m).backward()
    out = shards(att.gm, att.layout)
    assert all(p.grad is None for p in model.parameters())  # the gradients live in lowgrad only
    assert 0 < att.host_seconds < 60  # the adapter's own host time is accounted
    att.close()
    return out


def test_layout_follows_the_module() -> None:
    layout, blocks, non_block = module_layout(Tiny())
    assert layout.num_layers == LAYERS and [s.name for s in layout.block] == [
        "input_layernorm", "q_proj.weight", "q_proj.bias", "up_proj.weight", "down_proj.weight"]
    assert [n for n, _ in non_block] == ["norm", "embed_tokens.weight", "lm_head.weight"]
    assert blocks[2][1][0] == "q_proj.weight" and layout.block[1].shape == (H, H)


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("world", [1, 2, 4])
def test_shards_equal_the_manager_driven_by_hand(world: int, strategy: str, overlap: bool) -> None:
    M = 3

    def job(comm: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        got = through_adapter(comm, strategy, M, overlap=overlap)
        model = Tiny()
        layout = module_layout(model)[0]
        per_micro = [grads(model, comm.rank, m) for m in range(M)]
        return got, by_hand(comm, layout, per_micro, strategy)
    for got, want in lg.run_threads(world, job, backend="host"):
        assert got.keys() == want.keys()
        for k in got:
            assert np.array_equal(got[k], want[k]), k


def test_ranks_whose_hooks_share_one_thread_deliver_at_the_end() -> None:
    """As PyTorch does for ranks on one GPU: every rank's backward (and so its hooks) runs on one
    shared thread, one rank after the other. Ranks whose collectives meet on the host would wait
    there for each other forever; the adapter sees the foreign thread and delivers at the end of
    the micro-step instead, with the same result."""
    import queue
    import threading
    jobs: queue.Queue[Any] = queue.Queue()

    def engine() -> None:  # the one shared "autograd thread"
        while (item := jobs.get()) is not None:
            fn, done = item
            try:
                fn()
            finally:
                done.set()
    worker = threading.Thread(target=engine, daemon=True)
    worker.start()

    def backward_elsewhere(t: Any) -> None:
        done = threading.Event()
        jobs.put((t.backward, done))
        assert done.wait(30)

    def job(comm: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        M, model = 2, Tiny()
        att = attach(model, comm, strategy="scatter_reduce", seed=7)
        for m in range(M):
            with att.micro_step(m, M):
                backward_elsewhere(loss(model, comm.rank, m))
        got = shards(att.gm, att.layout)
        att.close()
        ref = Tiny()
        return got, by_hand(comm, module_layout(ref)[0], [grads(ref, comm.rank, m) for m in range(M)],
                            "scatter_reduce")
    try:
        for got, want in lg.run_threads(2, job, backend="host", timeout=30):
            for k in want:
                assert np.array_equal(got[k], want[k]), k
    finally:
        jobs.put(None)


def test_shards_are_within_the_sr_bound_of_a_float64_sum() -> None:
    M = 8
    got = lg.run_threads(1, lambda c: through_adapter(c, "scatter_reduce", M), backend="host")[0]
    model = Tiny()
    ref: dict[str, np.ndarray] = {}
    for m in range(M):
        for n, bits in grads(model, 0, m).items():
            g = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).double().numpy()
            ref[n] = ref.get(n, 0) + g
    for layer in range(LAYERS):
        for name in ("q_proj.weight", "down_proj.weight"):
            want = ref[f"layers.{layer}.{name}"]
            shard = torch.from_numpy(got[f"{layer}.{name}"].view(np.int16)).view(torch.bfloat16).double().numpy()
            ulp = 2.0 ** (np.floor(np.log2(np.abs(want).max() + 1e-30)) - 7)  # bf16 ulp at the largest sum
            assert np.abs(shard - want).max() <= M * ulp, (layer, name)


def test_misuse_raises() -> None:
    def job(c: Any) -> str:
        model = Tiny(skip=1)  # block 1 produces no gradient
        att = attach(model, c)
        with pytest.raises(ProtocolError, match="expected 1"):
            with att.micro_step(0, 1):
                loss(model, 0, 0).backward()
        att.close()

        model = Tiny()
        att = attach(model, c)
        with pytest.raises(ProtocolError, match="outside"):
            loss(model, 0, 0).backward()
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
        with pytest.raises(ValueError, match="changed after attach"):
            with att.micro_step(0, 1):
                pass
        att.close()

        model = Tiny()
        model.layers[2].q_proj = model.layers[0].q_proj  # shared between blocks
        with pytest.raises(ValueError, match="shared"):
            attach(model, c)

        model = Tiny().float()  # fp32 parameters for bf16 buffers: refused at attach, nothing left behind
        with pytest.raises(TypeError, match="float32"):
            attach(model, c)
        attach(model, c, dtype="fp32").close()

        with pytest.raises(ValueError, match="no transformer blocks"):
            attach(torch.nn.Linear(4, 4), c)
        return "ok"
    assert lg.run_threads(1, job, backend="host") == ["ok"]


def test_clip_coefficient_against_float64() -> None:
    def job(c: Any) -> tuple[Any, ...]:
        model = Tiny()
        att = attach(model, c, strategy="scatter_reduce")
        with att.micro_step(0, 1):
            loss(model, c.rank, 0).backward()
        coef, finite = att.clip_coefficient(0.05)
        total = sum(float((t.double() ** 2).sum()) for layer in range(LAYERS)
                    for t in att.block_shards(layer).values())
        total += sum(float((att.non_block_shard(n).double() ** 2).sum()) for n, _ in module_layout(model)[2])
        big, _ = att.clip_coefficient(1e9)
        with att.micro_step(0, 1):  # a non-finite gradient: reported, coefficient 0
            (loss(model, c.rank, 1) * float("inf")).backward()
        bad, bad_finite = att.clip_coefficient(1.0)
        att.close()
        return float(coef), bool(finite), total, float(big), float(bad), bool(bad_finite)
    results = lg.run_threads(2, job, backend="host")
    total = sum(r[2] for r in results)  # the global norm covers every rank's shards
    want = min(1.0, 0.05 / (np.sqrt(total) + 1e-6))
    assert want < 1.0  # the test clips
    for coef, finite, _, big, bad, bad_finite in results:
        assert finite and abs(coef - want) <= 1e-5 * want and big == 1.0  # the norm is summed in fp32
        assert bad == 0.0 and not bad_finite


@pytest.mark.parametrize("master", [True, False])
def test_shard_optimizer_equals_adamw_on_the_full_parameters(master: bool) -> None:
    """Two steps at world 2 (AdamW over each rank's shards, clipped, then all-gathered): every
    rank ends with the same module, equal to AdamW on the full parameters with the full averaged
    gradients (the ranks' shards put together), elementwise the same arithmetic."""
    from lowgrad.torch import ShardOptimizer
    M, kw = 2, {"lr": 1e-2, "weight_decay": 0.1, "foreach": False}

    def job(c: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        model = Tiny()
        att = attach(model, c, strategy="scatter_reduce", seed=3)
        opt = ShardOptimizer(att, master_weights=master, **kw)
        grads_per_step = []
        for _ in range(2):
            for m in range(M):
                with att.micro_step(m, M):
                    loss(model, c.rank, m).backward()
            grads_per_step.append({f"layers.{layer}.{n}": t.clone() for layer in range(LAYERS)
                                   for n, t in att.block_shards(layer).items()}
                                  | {n: att.non_block_shard(n).clone() for n, _ in module_layout(model)[2]}
                                  | {"coef": att.clip_coefficient(0.5)[0].clone()})
            assert bool(opt.step(max_norm=0.5))
        final = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.close()
        att.close()
        return grads_per_step, final

    results = lg.run_threads(2, job, backend="host")
    assert all(torch.equal(results[0][1][n], results[1][1][n]) for n in results[0][1])  # one model
    ref = Tiny()
    params = dict(ref.named_parameters())
    masters = {n: p.detach().float().clone().requires_grad_() if master else p for n, p in params.items()}
    opt = torch.optim.AdamW(list(masters.values()), **kw)
    for step in range(2):
        full = {n: torch.cat([results[r][0][step][n] for r in range(2)]) for n in params}
        norm = torch.sqrt(sum((g.double() ** 2).sum() for g in full.values()))
        coef = results[0][0][step]["coef"]  # the manager's (fp32 sum of squares, sqrt in float64) ...
        assert coef < 1 and abs(float(coef) - 0.5 / (float(norm) + 1e-6)) <= 1e-5 * float(coef)  # ... = float64
        for n, mp in masters.items():
            g = full[n].float() if master else full[n].clone()
            mp.grad = g.mul_(coef.float())  # the coefficient in float32, one rounding of the product
        opt.step()
        if master:
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(masters[n])
    for n, p in params.items():
        assert torch.equal(results[0][1][n], p.detach()), n  # elementwise AdamW: bit for bit


class Gated(Tiny):
    """Tiny with, in each block, a 0-d gate (when ``gates``) and a zero-size parameter, and
    outside the blocks a 0-d temperature (when ``gates``) and a zero-size one."""

    def __init__(self, gates: bool) -> None:
        super().__init__()
        for i, blk in enumerate(self.layers):
            if gates:
                blk.gate = torch.nn.Parameter(torch.tensor(0.25 * (i + 1), dtype=torch.bfloat16))
            blk.nothing = torch.nn.Parameter(torch.zeros(0, H, dtype=torch.bfloat16))
        if gates:
            self.temperature = torch.nn.Parameter(torch.tensor(1.5, dtype=torch.bfloat16))
        self.none = torch.nn.Parameter(torch.zeros(4, 0, dtype=torch.bfloat16))

    def forward(self, tokens: Any) -> Any:
        x = self.embed_tokens(tokens)
        for blk in self.layers:
            gate = getattr(blk, "gate", None)
            y = blk(x)
            x = (x + (y - x) * gate if gate is not None else y) + blk.nothing.sum()
        t = getattr(self, "temperature", None)
        out = self.lm_head(x * self.norm) + self.none.sum()
        return out / t if t is not None else out


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("strategy,offload", strategy_configs())
def test_zero_d_and_zero_size_parameters_attach_and_train(world: int, strategy: str, offload: bool) -> None:
    """0-d parameters (world 1) and zero-size ones (any world) attach, deliver their gradients
    and are updated by ShardOptimizer exactly as AdamW on the full parameters with the full
    averaged gradients; at world 2 a 0-d parameter is refused at attach, saying why and what to do,
    with the module left unattached."""
    from lowgrad.torch import ShardOptimizer
    M, kw, gates = 2, {"lr": 1e-2, "weight_decay": 0.1, "foreach": False}, world == 1

    def job(c: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        if world > 1:
            refused = Gated(gates=True)
            with pytest.raises(ValueError, match=r"parameter 'gate' is 0-d \(one element\).*freeze it"):
                attach(refused, c, strategy=strategy, offload=offload)
            assert not any(hasattr(p, "_lowgrad_attached") for p in refused.parameters())
        model = Gated(gates)
        att = attach(model, c, strategy=strategy, offload=offload, seed=3)
        opt = ShardOptimizer(att, **kw)
        grads_per_step = []
        for step in range(2):
            for m in range(M):
                with att.micro_step(m, M):
                    loss(model, c.rank, m + 10 * step).backward()
            grads_per_step.append({f"layers.{layer}.{n}": t.clone() for layer in range(LAYERS)
                                   for n, t in att.block_shards(layer).items()}
                                  | {n: att.non_block_shard(n).clone() for n, _ in att.non_block_params})
            assert opt.step(max_norm=1e3) is True
        final = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.close()
        att.close()
        return grads_per_step, final

    results = lg.run_threads(world, job, backend="host")
    ref = Gated(gates)
    params = dict(ref.named_parameters())
    assert results[0][0][0]["none"].shape == (4 // world, 0) and results[0][0][0]["layers.1.nothing"].shape == (0, H)
    if gates:
        assert results[0][0][0]["layers.2.gate"].shape == () and results[0][0][0]["temperature"].shape == ()
        assert float(results[0][0][0]["layers.2.gate"]) != 0  # a gradient arrived
    masters = {n: p.detach().float().clone().requires_grad_() for n, p in params.items()}
    opt = torch.optim.AdamW(list(masters.values()), **kw)
    for step in range(2):
        for n, mp in masters.items():
            parts = [results[r][0][step][n] for r in range(world)]
            mp.grad = (torch.cat(parts) if parts[0].dim() else parts[0]).float()
        opt.step()
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(masters[n])
    for r in range(world):
        for n, p in params.items():
            assert results[r][1][n].shape == p.shape and torch.equal(results[r][1][n], p.detach()), (r, n)
