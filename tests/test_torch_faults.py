"""lowgrad.torch under the faults a training loop meets (host backend, world 1 and 2): a
non-finite step skipped with nothing changed; an exception inside a micro-step (forward, part-way
through backward, on one rank) leaves adapter and manager usable, p.grad clean, and the next
steps equal a run that skipped that step; stale gradients refused; a second backward in one
micro-step refused with overlap=True, accumulated as plain PyTorch with overlap=False; a second
attach refused; dtypes checked at attach; a torch.compile'd module attaches; bad arguments change
nothing. Skipped without torch."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import lowgrad as lg
from lowgrad.base.errors import NonFiniteGradientError, ProtocolError
from lowgrad.managers import STRATEGIES

torch = pytest.importorskip("torch")
from test_torch_adapter import Tiny, by_hand, loss, shards  # noqa: E402

from lowgrad.torch import ShardOptimizer, attach, module_layout  # noqa: E402

KW = {"lr": 1e-2, "weight_decay": 0.1, "foreach": False}


class Boom(Exception):
    """The user's own exception (an OOM, a data error)."""


def state(model: Any, opt: Any) -> dict[str, Any]:
    """Every tensor a step may change: module parameters, master weights, optimizer state."""
    out = {f"p.{n}": p.detach().clone() for n, p in model.named_parameters()}
    out |= {f"m.{i}": p.detach().clone() for i, p in enumerate(opt.params)}
    for i, p in enumerate(opt.params):
        for k, v in opt.optimizer.state.get(p, {}).items():
            out[f"s.{i}.{k}"] = v.clone() if isinstance(v, torch.Tensor) else torch.tensor(v)
    return out


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.uint8) if a[k].dtype == torch.bfloat16 else a[k],
                                                     b[k].view(torch.uint8) if b[k].dtype == torch.bfloat16 else b[k])
                                        for k in a)


def raise_in_backward_of(block: Any) -> Any:
    """A forward hook on ``block`` whose output's gradient hook raises: backward stops part-way,
    after the blocks above it delivered their gradients."""
    def fwd(_m: Any, _i: Any, out: Any) -> None:
        out.register_hook(lambda g: (_ for _ in ()).throw(Boom("backward")))
    return block.register_forward_hook(fwd)


def on_device(c: Any) -> Any:
    """This rank's torch device: the GPU for the CUDA backend (each rank thread on its own torch
    stream, as ranks sharing a GPU need), else the CPU."""
    if getattr(c.device, "ordinal", None) is None:
        return "cpu"
    torch.cuda.set_stream(torch.cuda.Stream())
    return "cuda"


def run(world: int, fault: str | None, fault_rank: int = 0, steps: int = 3, M: int = 3,
        strategy: str = "scatter_reduce", overlap: bool = True,
        **threads: Any) -> list[tuple[dict[str, Any], list[bool], int]]:
    """``steps`` optimizer steps; in step 1, micro-step 1, rank ``fault_rank`` meets ``fault``;
    ``fault="skip"``: the clean run, which skips step 1 without running it. ``threads``: for
    :func:`lowgrad.run_threads` (the host backend by default)."""
    def job(c: Any) -> tuple[dict[str, Any], list[bool], int]:
        model = Tiny().to(on_device(c))
        att = attach(model, c, strategy=strategy, seed=3, overlap=overlap)
        opt = ShardOptimizer(att, **KW)
        applied = []
        for step in range(steps):
            if step == 1 and fault == "skip":  # the clean twin: step 1's batches never used
                att.gm.load_state_dict({**att.gm.state_dict(), "step": att.gm.step + 1})
                continue
            for m in range(M):
                hit = step == 1 and m == 1 and c.rank == fault_rank
                try:
                    if hit and fault == "data":
                        raise Boom("data loader")
                    with att.micro_step(m, M):
                        if hit and fault == "forward":
                            raise Boom("forward")
                        handle = raise_in_backward_of(model.layers[1]) if hit and fault == "backward" else None
                        try:
                            out = loss(model, 10 * step + c.rank, m)
                            if hit and fault == "nan":
                                out = out * float("nan")
                            out.backward()
                        finally:
                            if handle is not None:
                                handle.remove()
                except Boom:
                    assert all(p.grad is None for p in model.parameters())  # nothing left in p.grad
                    if fault == "data":
                        assert att.discard_step() is True
                    assert not att.gm.in_micro_step
                    break
            applied.append(opt.step(max_norm=0.5))
        out = {k: v.cpu() for k, v in state(model, opt).items()}
        result = (out, applied, att.gm.step)
        opt.close()
        att.close()
        return result
    return lg.run_threads(world, job, **({"backend": "host"} | threads))


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("fault", ["nan", "forward", "backward", "data"])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_faulted_step_is_skipped_on_every_rank_and_leaves_no_trace(world: int, fault: str, strategy: str) -> None:
    check_skipped(world, run(world, fault, fault_rank=world - 1, strategy=strategy),
                  run(world, "skip", strategy=strategy))


def check_skipped(world: int, faulted: list[Any], clean: list[Any]) -> None:
    for rank in range(world):
        got, applied, step = faulted[rank]
        want, want_applied, want_step = clean[rank]
        assert applied == [True, False, True], (rank, applied)  # every rank skips the same step
        assert want_applied == [True, True] and step == want_step == 3
        assert same(got, want), (rank, [k for k in got if not torch.equal(got[k], want[k])][:5])


def test_non_finite_step_changes_nothing_and_raise_policy() -> None:
    def job(c: Any) -> None:
        model = Tiny()
        att = attach(model, c, strategy="all_to_all")
        for policy in ("skip", "raise"):
            opt = ShardOptimizer(att, nonfinite=policy, **KW)
            with att.micro_step(0, 1):
                loss(model, c.rank, 0).backward()
            assert opt.step() is True and opt.skipped_steps == 0
            before = state(model, opt)
            with att.micro_step(0, 1):
                (loss(model, c.rank, 1) * float("inf")).backward()
            if policy == "raise":
                with pytest.raises(NonFiniteGradientError, match="norm"):
                    opt.step(max_norm=1.0)
            else:
                assert opt.step(max_norm=1.0) is False
            assert opt.skipped_steps == 1 and not np.isfinite(opt.last_norm)
            assert same(state(model, opt), before)  # parameters, masters, moments and step count
            with pytest.raises(ValueError, match="max_norm"):  # checked before anything is read
                opt.step(max_norm=float("nan"))
            with att.micro_step(0, 1):
                loss(model, c.rank, 2).backward()
            assert opt.step(max_norm=1.0) is True and np.isfinite(opt.last_norm)
            after = state(model, opt)
            with pytest.raises(ProtocolError, match="no step has completed"):  # twice: refused, nothing changed
                opt.step(max_norm=1.0)
            assert same(state(model, opt), after)
            opt.close()
        with pytest.raises(ValueError, match="nonfinite"):
            ShardOptimizer(att, nonfinite="ignore")
        att.close()
    lg.run_threads(2, job, backend="host")


BAD_EPS: list[tuple[Any, type[Exception]]] = [(0.0, ValueError), (0, ValueError), (-1.0, ValueError),
                                              (float("nan"), ValueError), (float("inf"), ValueError),
                                              (True, TypeError), ("1e-6", TypeError), (None, TypeError)]


def test_bad_eps_and_max_norm_are_refused_before_the_step_is_counted() -> None:
    """eps=0 with an all-zero gradient divided by zero after the step was counted; eps=nan turned
    clipping off; eps=-1 flipped the update. Each bad eps (and a bool/str max_norm) is refused
    with nothing changed, in step() and clip_coefficient(); the corrected call then applies the
    step, counted once."""
    def job(c: Any) -> None:
        model = Tiny()
        att = attach(model, c)
        opt = ShardOptimizer(att, **KW)
        with att.micro_step(0, 1):
            (loss(model, c.rank, 0) * 0.0).backward()  # an all-zero gradient: norm 0
        assert float(att.grad_norm_squared()) == 0.0
        before = state(model, opt)
        for eps, exc in BAD_EPS:
            with pytest.raises(exc, match="eps"):
                opt.step(max_norm=1.0, eps=eps)
            with pytest.raises(exc, match="eps"):
                att.clip_coefficient(1.0, eps=eps)
        for bad in (True, "1", None):
            with pytest.raises(TypeError, match="max_norm"):
                att.clip_coefficient(bad)
        for bad in (True, "1"):
            with pytest.raises(TypeError, match="max_norm"):
                opt.step(max_norm=bad)
        assert same(state(model, opt), before) and opt.skipped_steps == 0 and np.isnan(opt.last_norm)
        assert opt.step(max_norm=1.0, eps=1e-6) is True  # the corrected retry: the step was not counted
        assert opt.last_norm == 0.0 and opt.optimizer.state[opt.params[0]]["step"].item() == 1
        with pytest.raises(ProtocolError, match="no step has completed"):
            opt.step(max_norm=1.0)
        with att.micro_step(0, 1):
            loss(model, c.rank, 1).backward()
        coef, finite = att.clip_coefficient(1e-3, eps=1e-6)
        assert bool(finite) and 0 < float(coef) < 1  # clipping on: a NaN eps can no longer turn it off
        opt.close()
        att.close()
    lg.run_threads(1, job, backend="host")


def test_stale_gradients_are_refused_and_a_refused_backward_leaves_nothing() -> None:
    def job(c: Any) -> None:
        model = Tiny()
        loss(model, 0, 0).backward()  # a plain backward before attach
        att = attach(model, c)
        with pytest.raises(ProtocolError, match="zero_grad"):
            with att.micro_step(0, 1):
                pass
        assert not att.gm.in_micro_step  # refused before the manager moved
        model.zero_grad(set_to_none=True)
        with pytest.raises(ProtocolError, match="outside"):
            loss(model, 0, 1).backward()  # refused: leaves no gradient behind
        assert all(p.grad is None for p in model.parameters())
        with att.micro_step(0, 1):
            loss(model, 0, 2).backward()
        att.close()
    lg.run_threads(1, job, backend="host")


def by_hand_two_backwards(c: Any, M: int) -> dict[str, Any]:
    """Plain PyTorch accumulates two backward passes per micro-step in p.grad; the manager fed
    those sums by hand."""
    model = Tiny()
    model_grads = []
    for m in range(M):
        model.zero_grad(set_to_none=True)
        loss(model, c.rank, m).backward()
        loss(model, c.rank, m + 50).backward()
        model_grads.append({n: p.grad.view(torch.int16).numpy().view(np.uint16).copy()
                            for n, p in model.named_parameters()})
    return by_hand(c, module_layout(model)[0], model_grads, "scatter_reduce")


def test_several_backwards_in_one_micro_step() -> None:
    M = 2

    def job(c: Any) -> None:
        model = Tiny()
        att = attach(model, c, strategy="scatter_reduce", seed=7)
        with pytest.raises(ProtocolError, match="second backward"):
            with att.micro_step(0, M):
                loss(model, c.rank, 0).backward()
                loss(model, c.rank, 50).backward()
        assert all(p.grad is None for p in model.parameters()) and not att.gm.in_micro_step
        att.close()

        model = Tiny()
        att = attach(model, c, strategy="scatter_reduce", seed=7, overlap=False)
        for m in range(M):
            with att.micro_step(m, M):
                loss(model, c.rank, m).backward()
                loss(model, c.rank, m + 50).backward()
        got = shards(att.gm, att.layout)
        att.close()
        want = by_hand_two_backwards(c, M)
        assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)
    lg.run_threads(2, job, backend="host")


def test_attach_twice_refused_until_closed_and_compiled_modules_attach() -> None:
    def job(c: Any) -> None:
        model = Tiny()
        att = attach(model, c)
        with pytest.raises(ValueError, match="already attached"):
            attach(model, c)
        with pytest.raises(ValueError, match="already attached"):
            attach(torch.compile(model, backend="eager"), c)
        att.close()
        att = attach(torch.compile(model, backend="eager"), c, seed=7)
        compiled = att.model
        assert compiled is model  # the wrapped module, same parameters
        cm = torch.compile(model, backend="eager")
        for m in range(2):
            with att.micro_step(m, 2):
                torch.nn.functional.cross_entropy(cm(torch.arange(10).reshape(2, 5) % 12).float().reshape(-1, 12),
                                                  torch.arange(10) % 12).backward()
        assert np.isfinite(float(att.grad_norm_squared()))
        att.close()
    lg.run_threads(1, job, backend="host")


def test_bad_micro_step_arguments_change_nothing() -> None:
    def job(c: Any, bad_first: bool) -> dict[str, Any]:
        model = Tiny()
        att = attach(model, c, seed=7)
        for bad in (("0", 2), (0, 2.0), (1, 2), (0, 0), (True, 2)) if bad_first else ():
            with pytest.raises((TypeError, ValueError)):
                with att.micro_step(*bad):  # type: ignore[arg-type]
                    raise AssertionError("the body must not run")
            assert not att.gm.in_micro_step and att.gm.step == 0
        for m in range(2):
            with att.micro_step(m, 2):
                loss(model, c.rank, m).backward()
        out = shards(att.gm, att.layout)
        att.close()
        return out
    got = lg.run_threads(2, lambda c: job(c, True), backend="host")
    want = lg.run_threads(2, lambda c: job(c, False), backend="host")
    for g, w in zip(got, want):
        assert all(np.array_equal(g[k], w[k]) for k in w)
