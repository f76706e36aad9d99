"""Checkpoint and resume through lowgrad.torch on the CPU (host backend): ShardOptimizer's state
dict holds master weights, moments, step counts, skipped steps, hyper-parameters and the manager's
state; a resume at the same world is the uninterrupted run bit for bit (every strategy, with and
without offload; through save_checkpoint, torch.save and torch.distributed.checkpoint); a
checkpoint saved at world N loads at world M with every rank's rows equal to the saved ones and
then runs as a world-M run given that state; model weights loaded after the optimizer exists take
effect (the master weights follow) and a reload of the same weights keeps the float32 master;
foreign and mismatched states are refused with nothing changed."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from helpers import strategy_configs

import lowgrad as lg

torch = pytest.importorskip("torch")
import lowgrad.torch as lt  # noqa: E402

H, FF, V, LAYERS, M = 12, 24, 12, 2, 2  # every dim 0 divisible by worlds 1 to 4
ROOT = Path(__file__).resolve().parents[1]


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.Parameter(torch.ones(H))
        self.up = torch.nn.Linear(H, FF, bias=True)
        self.down = torch.nn.Linear(FF, H, bias=False)

    def forward(self, x: Any) -> Any:
        return x + self.down(torch.relu(self.up(x * self.norm)))


class Net(torch.nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(V, H)
        self.layers = torch.nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = torch.nn.Linear(H, V, bias=False)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        self.to(torch.bfloat16)

    def forward(self, tokens: Any) -> Any:
        x = self.embed(tokens)
        for blk in self.layers:
            x = blk(x)
        return self.head(x)


def micro_batches(att: Any, model: Any, step: int) -> None:
    for m in range(M):
        with att.micro_step(m, M):
            g = torch.Generator().manual_seed(10_000 * step + 100 * att.gm.rank + m)
            tokens = torch.randint(0, V, (3, 4), generator=g).to(next(model.parameters()).device)
            torch.nn.functional.cross_entropy(model(tokens).float().reshape(-1, V), tokens.reshape(-1)).backward()


class Run:
    """A rank's model, manager and ShardOptimizer(AdamW)."""

    def __init__(self, comm: Any, strategy: str = "scatter_reduce", offload: bool = False, seed: int = 0,
                 master_weights: bool = True, optimizer: Any = None, device: str = "cpu",
                 opt_kw: dict[str, Any] | None = None, stats: bool = False) -> None:
        self.model = Net(seed).to(device)
        self.att = lt.attach(self.model, comm, strategy=strategy, offload=offload, seed=7, stats=stats)
        self.opt = lt.ShardOptimizer(self.att, optimizer, master_weights=master_weights,
                                     **(opt_kw or {"lr": 1e-2, "weight_decay": 0.1}))

    def train(self, steps: range, max_norm: float | None = 1.0) -> None:
        for s in steps:
            micro_batches(self.att, self.model, s)
            self.opt.step(max_norm=max_norm)

    def snapshot(self) -> dict[str, Any]:
        """Every tensor lowgrad and the module hold, and the last step's shards."""
        out = {f"param.{n}": p.detach().cpu().clone() for n, p in self.model.named_parameters()}
        for k, v in self.opt.state_dict().items():
            out[k] = lt._local(v).cpu().clone() if isinstance(v, torch.Tensor) else v
        try:  # the SR noise of the last step
            out["shards"] = torch.cat([t.float().reshape(-1).cpu() for l in range(LAYERS)
                                       for t in self.att.block_shards(l).values()])
        except lg.ProtocolError:  # no step completed since the manager was made or loaded
            out["shards"] = None
        out["skipped"] = self.opt.skipped_steps
        return out

    def close(self) -> None:
        self.opt.close()
        self.att.close()


def same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k].view(-1).view(torch.uint8) if a[k].dim() else a[k],
                                                            b[k].view(-1).view(torch.uint8) if b[k].dim() else b[k]), k
        else:
            assert a[k] == b[k], k


def threads(world: int, job: Any) -> list[Any]:
    return lg.run_threads(world, job, backend="host", timeout=60)


def uninterrupted(world: int, steps: int = 4, **kw: Any) -> list[dict[str, Any]]:
    def job(c: Any) -> dict[str, Any]:
        r = Run(c, **kw)
        r.train(range(steps))
        out = r.snapshot()
        r.close()
        return out
    return threads(world, job)


def resumes_bit_for_bit(world: int, save: Any, load: Any, **kw: Any) -> None:
    """A run of two steps ends with ``save(run, comm)``; a fresh run (other initial weights: the
    checkpoint must carry them) starts with ``load(run, comm)`` and runs two more: equal, bit for
    bit, to four uninterrupted steps (every tensor, the shards of the last step)."""
    def first(c: Any) -> None:
        r = Run(c, **kw)
        r.train(range(2))
        save(r, c)
        r.close()

    def second(c: Any) -> dict[str, Any]:
        r = Run(c, **{**kw, "seed": 1})
        load(r, c)
        r.train(range(2, 4))
        out = r.snapshot()
        r.close()
        return out

    threads(world, first)
    for a, b in zip(uninterrupted(world, **kw), threads(world, second)):
        same(a, b)


CONFIGS = strategy_configs()


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize(("strategy", "offload"), CONFIGS)
def test_save_checkpoint_resumes_bit_for_bit(tmp_path: Path, world: int, strategy: str, offload: bool) -> None:
    resumes_bit_for_bit(world, lambda r, c: lt.save_checkpoint(tmp_path / "ck", r.opt),
                        lambda r, c: lt.load_checkpoint(tmp_path / "ck", r.opt), strategy=strategy, offload=offload)


@pytest.mark.parametrize(("saved", "resumed"), [(2, 3), (3, 2), (4, 1), (1, 4), (2, 4), (4, 3)])
def test_save_checkpoint_loads_at_another_world(tmp_path: Path, saved: int, resumed: int) -> None:
    strategy, offload = CONFIGS[(saved + resumed) % len(CONFIGS)]

    def first(c: Any) -> dict[str, Any]:
        r = Run(c, strategy, offload)
        r.train(range(2))
        lt.save_checkpoint(tmp_path / "ck", r.opt)
        out = r.snapshot()
        r.close()
        return out

    snaps = threads(saved, first)
    full = {k: torch.cat([s[k] for s in snaps]) for k in snaps[0]
            if isinstance(snaps[0][k], torch.Tensor) and (k.startswith("master.") or k.endswith(".exp_avg")
                                                          or k.endswith(".exp_avg_sq"))}

    def mine(r: Run, k: str) -> torch.Tensor:
        per = full[k].shape[0] // r.opt.world
        return full[k][r.opt.rank * per:(r.opt.rank + 1) * per]

    def from_checkpoint(c: Any) -> dict[str, Any]:
        r = Run(c, strategy, offload, seed=1)
        lt.load_checkpoint(tmp_path / "ck", r.opt)
        state = r.opt.state_dict()
        for k in full:
            assert torch.equal(lt._local(state[k]), mine(r, k)), k
        for n, p in r.model.named_parameters():  # the module holds the saved weights, whole, on every rank
            assert torch.equal(p.detach(), snaps[0][f"param.{n}"]), n
        assert r.att.gm.step == 2 and r.opt.skipped_steps == snaps[0]["skipped"]
        r.train(range(2, 4))
        out = r.snapshot()
        r.close()
        return out

    def by_hand(c: Any) -> dict[str, Any]:
        r = Run(c, strategy, offload, seed=1)
        state = {k: lt.ShardRows(mine(r, k), full[k].shape, r.opt.rank * (full[k].shape[0] // r.opt.world))
                 if k in full else v for k, v in snaps[0].items()
                 if k.startswith(("master.", "state.")) or k in ("manager", "optimizer")}
        r.opt.load_state_dict(state)
        r.train(range(2, 4))
        out = r.snapshot()
        r.close()
        return out

    for a, b in zip(threads(resumed, from_checkpoint), threads(resumed, by_hand)):
        same(a, b)


def test_without_master_weights_a_resume_is_bit_for_bit(tmp_path: Path) -> None:
    """master_weights=False: the checkpoint's weights are the module's bf16 rows."""
    resumes_bit_for_bit(2, lambda r, c: lt.save_checkpoint(tmp_path / "ck", r.opt),
                        lambda r, c: lt.load_checkpoint(tmp_path / "ck", r.opt), master_weights=False)


def test_torch_save_of_the_state_dict_resumes_bit_for_bit_and_is_this_ranks(tmp_path: Path) -> None:
    """docs/torch.md's route as written (torch.load's default weights_only=True), and a copy made
    with clone() (the docstring's advice) keeps where its rows belong: another rank's is refused."""
    def save(r: Run, c: Any) -> None:
        torch.save(r.opt.state_dict(), tmp_path / f"rank{c.rank}.pt")
        cloned = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in r.opt.state_dict().items()}
        deep = copy.deepcopy(r.opt.state_dict())
        for kept in (cloned["master.head.weight"], deep["master.head.weight"]):
            assert isinstance(kept, lt.ShardRows) and kept.start == r.opt.rank * (V // 2), kept
        torch.save(cloned, tmp_path / f"clone{c.rank}.pt")

    def load(r: Run, c: Any) -> None:
        before = r.snapshot()
        for other in (torch.load(tmp_path / f"rank{1 - c.rank}.pt"), torch.load(tmp_path / f"clone{1 - c.rank}.pt")):
            with pytest.raises(lg.CheckpointError, match="this rank's are from"):
                r.opt.load_state_dict(other)  # another rank's rows: refused, nothing changed
            same(r.snapshot(), before)
        r.opt.load_state_dict(torch.load(tmp_path / f"rank{c.rank}.pt"))

    resumes_bit_for_bit(2, save, load)


def test_a_bad_param_group_value_is_refused_with_nothing_changed_and_a_retry_resumes(tmp_path: Path) -> None:
    """Each param-group value is checked against this optimizer's before anything changes
    (CheckpointError naming the key); a key the saved group lacks (another torch version's
    option) keeps this optimizer's value; the corrected retry resumes bit for bit."""
    def load(r: Run, c: Any) -> None:
        sd = torch.load(tmp_path / f"rank{c.rank}.pt")
        before = r.snapshot()

        def with_group(**change: Any) -> dict[str, Any]:
            g = json.loads(sd["optimizer"]["param_groups"])
            g[0].update(change)
            return {**sd, "optimizer": {**sd["optimizer"], "param_groups": json.dumps([{k: v for k, v in g[0].items()
                                                                                        if v != "drop"}])}}
        for bad, needle in [(with_group(lr="oops"), "param group 0 'lr' is 'oops'"),
                            (with_group(betas=[0.9]), "'betas' is \\[0.9\\]"),
                            (with_group(weight_decay=True), "'weight_decay' is True"),
                            (with_group(amsgrad=0.5), "'amsgrad' is 0.5"),
                            (with_group(eps=float("nan")), "'eps' is nan"),
                            (with_group(lr=1e-2, nesterov=True), "has \\['nesterov'\\], which this AdamW does not")]:
            with pytest.raises(lg.CheckpointError, match=needle):
                r.opt.load_state_dict(bad)
            same(r.snapshot(), before)
            assert r.att.gm.step == 0
        r.opt.optimizer.param_groups[0]["maximize"] = False
        r.opt.load_state_dict(with_group(maximize="drop"))  # missing from the saved group: this one's kept
        assert r.opt.optimizer.param_groups[0]["maximize"] is False

    resumes_bit_for_bit(2, lambda r, c: torch.save(r.opt.state_dict(), tmp_path / f"rank{c.rank}.pt"), load)


@pytest.mark.parametrize(("cls", "kw"), [(torch.optim.NAdam, {"lr": 1e-2}), (torch.optim.Rprop, {"lr": 1e-2}),
                                         (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "dampening": 0.5}),
                                         (torch.optim.AdamW, {"lr": 1e-2})])
def test_a_state_dict_before_the_first_step_changes_nothing_and_resumes(tmp_path: Path, cls: Any,
                                                                        kw: dict[str, Any]) -> None:
    """state_dict() before the optimizer's first step (a template for dcp.load) leaves the run
    bit for bit the run that never called it (the optimizer's state is made by its own first
    step: NAdam's mu_product 1, Rprop's step_size lr, SGD's undampened first momentum), and a
    state saved then resumes bit for bit."""
    def job(call: bool, c: Any) -> dict[str, Any]:
        r = Run(c, optimizer=cls, opt_kw=kw)
        if call:
            sd = r.opt.state_dict()
            assert sd["optimizer"]["has_state"] is False and any(k.startswith("state.") for k in sd)
        r.train(range(3))
        out = r.snapshot()
        r.close()
        return out

    for a, b in zip(threads(2, partial(job, False)), threads(2, partial(job, True))):
        same(a, b)
    resumes_bit_for_bit(2, lambda r, c: lt.save_checkpoint(tmp_path / "ck", r.opt),
                        lambda r, c: lt.load_checkpoint(tmp_path / "ck", r.opt), optimizer=cls, opt_kw=kw)


def test_a_state_saved_before_the_first_step_resumes_bit_for_bit(tmp_path: Path) -> None:
    """has_state False: loading it leaves the optimizer without state, as the saving run's (a
    NAdam run loaded over one that had stepped then trains as the fresh run)."""
    kw = {"lr": 1e-2}

    def saved_fresh(c: Any) -> None:
        r = Run(c, optimizer=torch.optim.NAdam, opt_kw=kw)
        lt.save_checkpoint(tmp_path / "ck0", r.opt)
        r.close()

    def resumed(c: Any) -> dict[str, Any]:
        r = Run(c, optimizer=torch.optim.NAdam, opt_kw=kw)
        r.train(range(2))  # state made, then replaced by the fresh checkpoint's
        lt.load_checkpoint(tmp_path / "ck0", r.opt)
        assert not r.opt.optimizer.state and r.att.gm.step == 0
        r.train(range(3))
        out = r.snapshot()
        r.close()
        return out

    def straight(c: Any) -> dict[str, Any]:
        r = Run(c, optimizer=torch.optim.NAdam, opt_kw=kw)
        r.train(range(3))
        out = r.snapshot()
        r.close()
        return out

    threads(2, saved_fresh)
    for a, b in zip(threads(2, straight), threads(2, resumed)):
        same(a, b)


def test_weights_loaded_into_the_model_before_a_save_are_saved(tmp_path: Path) -> None:
    """model.load_state_dict after the optimizer was built, then a save before any step: the saved
    master weights are the loaded ones (state_dict and save_checkpoint follow the module first)."""
    pretrained = {k: v.clone() for k, v in Net(seed=5).state_dict().items()}

    def save(c: Any) -> None:
        r = Run(c)
        r.model.load_state_dict(pretrained)
        lt.save_checkpoint(tmp_path / "ck", r.opt)
        torch.save(r.opt.state_dict(), tmp_path / f"rank{c.rank}.pt")
        r.close()

    def load(native: bool, c: Any) -> None:
        r = Run(c, seed=1)
        if native:
            lt.load_checkpoint(tmp_path / "ck", r.opt)
        else:
            r.opt.load_state_dict(torch.load(tmp_path / f"rank{c.rank}.pt"))
        for n, p in r.model.named_parameters():
            assert torch.equal(p.detach(), pretrained[n]), n
        r.close()

    threads(2, save)
    threads(2, partial(load, True))
    threads(2, partial(load, False))


def test_model_weights_loaded_after_the_optimizer_take_effect(tmp_path: Path) -> None:
    """The usual order (build, attach, ShardOptimizer, then model.load_state_dict) trains from the
    loaded weights: the same as loading them before the optimizer was built."""
    pretrained = {k: v.clone() for k, v in Net(seed=5).state_dict().items()}

    def before(c: Any) -> dict[str, Any]:
        model = Net(seed=0)
        model.load_state_dict(pretrained)
        att = lt.attach(model, c, strategy="scatter_reduce", seed=7)
        opt = lt.ShardOptimizer(att, lr=1e-2, weight_decay=0.1)
        r = Run.__new__(Run)
        r.model, r.att, r.opt = model, att, opt
        r.train(range(3))
        out = r.snapshot()
        r.close()
        return out

    def after(c: Any) -> dict[str, Any]:
        r = Run(c, seed=0)
        r.model.load_state_dict(pretrained)
        r.train(range(3))
        out = r.snapshot()
        r.close()
        return out

    got = threads(2, after)
    for a, b in zip(threads(2, before), got):
        same(a, b)
    moved = max(float((got[0][f"param.{n}"].float() - v.float()).abs().max()) for n, v in pretrained.items())
    assert 0 < moved < 0.1  # trained from the loaded weights, not from seed 0's


def test_reloading_the_same_weights_after_a_checkpoint_keeps_the_master(tmp_path: Path) -> None:
    """load_checkpoint, then model.load_state_dict of the module saved with it (either order):
    the float32 master weights are kept, so the resume is still bit for bit."""
    def save(order: str, r: Run, c: Any) -> None:
        lt.save_checkpoint(tmp_path / f"ck-{order}", r.opt)
        if c.rank == 0:
            torch.save(r.model.state_dict(), tmp_path / f"model-{order}.pt")

    def load(order: str, r: Run, c: Any) -> None:
        weights = torch.load(tmp_path / f"model-{order}.pt")
        if order == "model first":
            r.model.load_state_dict(weights)
        lt.load_checkpoint(tmp_path / f"ck-{order}", r.opt)
        if order == "model last":
            r.model.load_state_dict(weights)

    for order in ("model first", "model last"):
        resumes_bit_for_bit(2, partial(save, order), partial(load, order))


def test_foreign_states_are_refused_with_nothing_changed(tmp_path: Path) -> None:
    def first(c: Any) -> None:
        r = Run(c)
        r.train(range(2))
        lt.save_checkpoint(tmp_path / "ck", r.opt)
        torch.save(r.opt.state_dict(), tmp_path / "sd.pt")
        r.close()

    def check(make: Any, needle: str) -> None:
        def job(c: Any) -> None:
            r = make(c)
            before = r.snapshot()
            with pytest.raises(lg.CheckpointError, match=needle):
                lt.load_checkpoint(tmp_path / "ck", r.opt)
            same(r.snapshot(), before)
            assert r.att.gm.step == 0
            r.close()
        threads(1, job)

    threads(1, first)
    check(lambda c: Run(c, "all_to_all"), "strategy 'scatter_reduce' does not match this manager's 'all_to_all'")
    check(lambda c: Run(c, master_weights=False), "master_weights=True")
    check(lambda c: Run(c, optimizer=torch.optim.Adam), "saved from AdamW")
    sd = torch.load(tmp_path / "sd.pt", weights_only=False)
    head = sd["master.head.weight"]

    def job(c: Any) -> None:
        r = Run(c)
        before = r.snapshot()
        for bad, needle in [({k: v for k, v in sd.items() if k != "master.head.weight"}, "keys missing"),
                            ({**sd, "master.head.weight": lt.ShardRows(head.local[:6], head.global_shape, 0)},
                             "this rank's is"),
                            ({**sd, "master.head.weight": head.local.clone()}, "not the ShardRows"),
                            ({**sd, "manager": {**sd["manager"], "strategy": "unsharded"}}, "'unsharded' does not"),
                            ({**sd, "optimizer": {**sd["optimizer"], "skipped_steps": -1}}, "skipped_steps")]:
            with pytest.raises(lg.CheckpointError, match=needle):
                r.opt.load_state_dict(bad)
            same(r.snapshot(), before)
        r.close()
    threads(1, job)


def test_a_state_refused_on_one_rank_is_refused_on_all(tmp_path: Path) -> None:
    """Rank 1 is handed a broken state, rank 0 a good one: both raise (no rank is left in the
    all-gather), nothing changed, and the corrected retry loads."""
    def load(r: Run, c: Any) -> None:
        before = r.snapshot()
        sd = torch.load(tmp_path / f"rank{c.rank}.pt", weights_only=False)
        bad = {**sd, "optimizer": {**sd["optimizer"], "class": "SGD"}} if c.rank == 1 else sd
        with pytest.raises(lg.CheckpointError, match="rank 1: .*saved from SGD"):
            r.opt.load_state_dict(bad)
        same(r.snapshot(), before)
        r.opt.load_state_dict(sd)

    resumes_bit_for_bit(2, lambda r, c: torch.save(r.opt.state_dict(), tmp_path / f"rank{c.rank}.pt"), load)


def test_a_state_dict_waits_for_step() -> None:
    def job(c: Any) -> None:
        r = Run(c)
        micro_batches(r.att, r.model, 0)
        with pytest.raises(lg.ProtocolError, match="call step"):
            r.opt.state_dict()
        r.opt.step()
        assert "manager" in r.opt.state_dict()
        r.close()
    threads(2, job)


def test_dcp_save_and_load_in_one_process_resume_bit_for_bit(tmp_path: Path) -> None:
    """dcp.save / dcp.load of {"model": ..., "lowgrad": optimizer} (a Stateful) at world 1."""
    import torch.distributed.checkpoint as dcp

    def save(r: Run, c: Any) -> None:
        dcp.save({"model": r.model.state_dict(), "lowgrad": r.opt}, checkpoint_id=tmp_path / "dcp", no_dist=True)

    def load(r: Run, c: Any) -> None:
        dcp.load({"model": r.model.state_dict(), "lowgrad": r.opt}, checkpoint_id=tmp_path / "dcp", no_dist=True)

    with pytest.warns(UserWarning, match="single process"):
        resumes_bit_for_bit(1, save, load)


def test_checks_that_fail_on_one_rank_are_refused_on_all(tmp_path: Path) -> None:
    """A manifest only rank 1 cannot read, a state only rank 1 is handed that is no dict: both
    ranks raise CheckpointError naming rank 1 (neither waits in a collective), nothing changed,
    and the corrected call loads."""
    def first(c: Any) -> None:
        r = Run(c)
        r.train(range(2))
        lt.save_checkpoint(tmp_path / "ck", r.opt)
        torch.save(r.opt.state_dict(), tmp_path / f"rank{c.rank}.pt")
        r.close()

    def job(c: Any) -> None:
        r = Run(c, seed=1)
        before = r.snapshot()
        with pytest.raises(lg.CheckpointError, match="rank 1: CheckpointError: .*manifest.json is missing"):
            lt.load_checkpoint(tmp_path / ("ck" if c.rank == 0 else "nowhere"), r.opt)
        with pytest.raises(lg.CheckpointError, match="rank 1: TypeError: .*must be a dict"):
            r.opt.load_state_dict(torch.load(tmp_path / f"rank{c.rank}.pt") if c.rank == 0 else [1])
        same(r.snapshot(), before)
        lt.load_checkpoint(tmp_path / "ck", r.opt)
        assert r.att.gm.step == 2
        r.close()

    threads(2, first)
    lg.run_threads(2, job, backend="host", timeout=20)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_without_a_process_group_is_refused_at_world_2(tmp_path: Path) -> None:
    """Without a torch.distributed process group every rank would write the same file and
    .metadata (the last writer wins) and a load would fill every rank from it: dcp.save and
    dcp.load refuse, naming what is needed, and nothing is written or changed."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    def job(c: Any) -> None:
        r = Run(c)
        r.train(range(2))
        before = r.snapshot()
        with pytest.raises(CheckpointException, match="needs a torch.distributed process group"):
            dcp.save({"lowgrad": r.opt}, checkpoint_id=tmp_path / f"dcp{c.rank}")
        assert not (tmp_path / f"dcp{c.rank}" / ".metadata").exists()
        with pytest.raises(CheckpointException, match="needs a torch.distributed process group"):
            dcp.load({"lowgrad": r.opt}, checkpoint_id=tmp_path / "one")
        same(r.snapshot(), before)
        r.close()

    def one(c: Any) -> None:
        r = Run(c)
        r.train(range(2))
        dcp.save({"lowgrad": r.opt}, checkpoint_id=tmp_path / "one", no_dist=True)
        r.close()

    threads(1, one)
    threads(2, job)


def test_dcp_with_a_process_group_of_another_rank_or_world_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rows must be the group's rank's part: rank 0's rows under a group's rank 1, or under a
    world of 3, are refused; a group of their world and rank describes them; whole rows need none."""
    import torch.distributed as dist
    rows = lt.ShardRows(torch.zeros(3, 4), (6, 4), 0)  # rank 0 of 2
    group: list[int] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: bool(group))
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: group[0])
    monkeypatch.setattr(dist, "get_rank", lambda *a, **k: group[1])
    for world, rank, found in [(2, 1, "found rank 1 of 2"), (3, 0, "found rank 0 of 3")]:
        group[:] = [world, rank]
        with pytest.raises(RuntimeError, match=f"rank 0 of 2\\) needs a torch.distributed process group.*{found}"):
            rows.__create_chunk_list__()
    group[:] = [2, 0]
    assert rows.__create_chunk_list__()[0].offsets == torch.Size([0, 0])
    group[:] = []
    assert lt.ShardRows(torch.zeros(6, 4), (6, 4), 0).__create_chunk_list__()[0].sizes == torch.Size([6, 4])


def test_a_refused_dcp_load_changes_nothing_and_a_retry_resumes(tmp_path: Path) -> None:
    """dcp.load fills copies (state_dict() hands out no live tensor) and load_state_dict checks them
    before it copies them in: a checkpoint of another strategy is refused with the master weights,
    moments and manager untouched, and the right one then resumes bit for bit."""
    import torch.distributed.checkpoint as dcp

    def save(r: Run, c: Any) -> None:
        dcp.save({"lowgrad": r.opt}, checkpoint_id=tmp_path / "dcp", no_dist=True)
        r2 = Run(c, "all_to_all")
        r2.train(range(3))
        dcp.save({"lowgrad": r2.opt}, checkpoint_id=tmp_path / "foreign", no_dist=True)
        r2.close()

    def load(r: Run, c: Any) -> None:
        r.train(range(1))
        micro_batches(r.att, r.model, 1)
        r.opt.step()
        before = r.snapshot()
        with pytest.raises(lg.CheckpointError, match="strategy 'all_to_all' does not match"):
            dcp.load({"lowgrad": r.opt}, checkpoint_id=tmp_path / "foreign", no_dist=True)
        same(r.snapshot(), before)
        dcp.load({"lowgrad": r.opt}, checkpoint_id=tmp_path / "dcp", no_dist=True)

    with pytest.warns(UserWarning, match="single process"):
        resumes_bit_for_bit(1, save, load)


_DCP_RANK = textwrap.dedent("""
    import sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
    sys.path.insert(0, {root!r})
    import lowgrad.torch
    rank, world, mode, where, files = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    dist.init_process_group("gloo", init_method="file://" + files + "/rendezvous", rank=rank, world_size=world)
    state = torch.load(f"{{files}}/rank{{rank}}.pt", weights_only=False)
    (dcp.save if mode == "save" else dcp.load)({{"lowgrad": state}}, checkpoint_id=where)
    if mode == "load":
        torch.save(state, f"{{files}}/rank{{rank}}.pt")
    dist.destroy_process_group()
""")


def _dcp_processes(world: int, mode: str, where: Path, files: Path) -> None:
    """``dcp.save`` or ``dcp.load`` of each rank's state dict in ``world`` processes (gloo)."""
    script = _DCP_RANK.format(root=str(ROOT))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", script, str(r), str(world), mode, str(where), str(files)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env) for r in range(world)]
    outs = [p.communicate(timeout=120)[0].decode() for p in procs]
    assert all(p.returncode == 0 for p in procs), outs


@pytest.mark.timeout(300)
@pytest.mark.skipif(not os.environ.get("LOWGRAD_SLOW_TESTS"), reason="slow (about 20 s each on 2 cores: torch "
                    "imported in 5 processes): set LOWGRAD_SLOW_TESTS=1")
@pytest.mark.parametrize(("saved", "resumed"), [(2, 3), (3, 2)])
def test_dcp_reshards_lowgrad_state_across_worlds(tmp_path: Path, saved: int, resumed: int) -> None:
    """Each of ``saved`` processes dcp.saves its rank's state dict; ``resumed`` processes dcp.load
    into their ranks' state dicts (templates from a world-``resumed`` run); loaded into that run,
    every rank's rows equal the saved ones, and it then equals the same run resumed through
    lowgrad's own format."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()

    def first(c: Any) -> None:
        r = Run(c)
        r.train(range(2))
        torch.save(r.opt.state_dict(), tmp_path / "a" / f"rank{c.rank}.pt")
        lt.save_checkpoint(tmp_path / "native", r.opt)
        r.close()

    def template(c: Any) -> None:
        r = Run(c, seed=1)
        torch.save(r.opt.state_dict(), tmp_path / "b" / f"rank{c.rank}.pt")
        r.close()

    def resume(native: bool, c: Any) -> dict[str, Any]:
        r = Run(c, seed=1)
        if native:
            lt.load_checkpoint(tmp_path / "native", r.opt)
        else:
            r.opt.load_state_dict(torch.load(tmp_path / "b" / f"rank{c.rank}.pt", weights_only=False))
        r.train(range(2, 3))
        out = r.snapshot()
        r.close()
        return out

    threads(saved, first)
    _dcp_processes(saved, "save", tmp_path / "dcp", tmp_path / "a")
    threads(resumed, template)
    _dcp_processes(resumed, "load", tmp_path / "dcp", tmp_path / "b")
    for a, b in zip(threads(resumed, lambda c: resume(True, c)), threads(resumed, lambda c: resume(False, c))):
        same(a, b)
