"""One error kind per promise on the PyTorch side: CheckpointError (an Exception) on every rank for
any failed save_checkpoint / load_checkpoint (one rank's failure included) and for any failed
dcp_save / dcp_load (DCP's own CheckpointException is a BaseException: ``except Exception`` misses
it); the gradient log's running state saved and restored with the checkpoint."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import lowgrad as lg

torch = pytest.importorskip("torch")
from test_torch_checkpoint import Run, resumes_bit_for_bit, same, threads  # noqa: E402

import lowgrad.torch as lt  # noqa: E402
from lowgrad.diagnostics import StepLog, read_log  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_dcp_refusals_are_an_exception_on_every_rank(tmp_path: Path) -> None:
    """At world 2 without a process group: dcp_save and dcp_load raise CheckpointError on every rank
    before DCP runs (``except Exception`` catches it), nothing written or changed; a state dict's
    copy (ShardRows in a plain dict) is refused too."""
    def job(c: Any) -> list[str]:
        r = Run(c)
        r.train(range(2))
        before = r.snapshot()
        said = []
        for call in (lambda: lt.dcp_save({"lowgrad": r.opt}, tmp_path / "dcp"),
                     lambda: lt.dcp_load({"lowgrad": r.opt}, tmp_path / "dcp"),
                     lambda: lt.dcp_save({"lowgrad": r.opt.state_dict()}, tmp_path / "copy")):
            try:
                call()
            except Exception as e:  # noqa: BLE001 - what a user writes around a save
                assert isinstance(e, lg.CheckpointError), type(e)
                said.append(str(e))
        same(r.snapshot(), before)
        r.close()
        return said
    for said in threads(2, job):
        assert len(said) == 3 and all("needs a torch.distributed process group" in m and "found none" in m
                                      for m in said), said
    assert not (tmp_path / "dcp").exists() and not (tmp_path / "copy").exists()


def test_dcp_save_and_load_resume_bit_for_bit(tmp_path: Path) -> None:
    resumes_bit_for_bit(1, lambda r, c: lt.dcp_save({"model": r.model.state_dict(), "lowgrad": r.opt},
                                                    tmp_path / "dcp", no_dist=True),
                        lambda r, c: lt.dcp_load({"model": r.model.state_dict(), "lowgrad": r.opt},
                                                 tmp_path / "dcp", no_dist=True))


def test_dcp_own_failures_are_checkpoint_errors(tmp_path: Path) -> None:
    """A failure inside DCP (no checkpoint there: its CheckpointException, or its own error) is a
    CheckpointError naming the checkpoint; a refused load's own CheckpointError stays as it is."""
    def job(c: Any) -> None:
        r = Run(c)
        r.train(range(1))
        lt.dcp_save({"lowgrad": r.opt}, tmp_path / "dcp", no_dist=True)
        other = Run(c, "all_to_all")
        before = other.snapshot()
        with pytest.raises(lg.CheckpointError, match="dcp_load .*nowhere: rank 0: .*No such file or directory") as info:
            lt.dcp_load({"lowgrad": other.opt}, tmp_path / "nowhere", no_dist=True)
        assert type(info.value.__cause__).__name__ == "CheckpointException"  # DCP's, a BaseException
        with pytest.raises(lg.CheckpointError, match="strategy 'scatter_reduce' does not match"):
            lt.dcp_load({"lowgrad": other.opt}, tmp_path / "dcp", no_dist=True)
        same(other.snapshot(), before)
        with pytest.raises(lg.CheckpointError, match="the state dict is a list"):
            lt.dcp_save([r.opt], tmp_path / "x")  # type: ignore[arg-type]
        other.close()
        r.close()
    threads(1, job)


def _bad_group(r: Run, bad: bool) -> None:
    """A param-group value JSON cannot hold (state_dict() raises TypeError), on this rank only."""
    if bad:
        r.opt.optimizer.param_groups[0]["note"] = object()
    else:
        r.opt.optimizer.param_groups[0].pop("note", None)


def test_one_ranks_failure_in_save_or_load_checkpoint_is_every_ranks(tmp_path: Path) -> None:
    """Rank 1's state that cannot be saved (a TypeError there; rank 0 was left in a collective and
    got CommAbortedError): CheckpointError on both, naming rank 1, nothing written or changed; the
    corrected calls succeed."""
    def job(c: Any) -> list[str]:
        r = Run(c)
        r.train(range(2))
        said = []
        _bad_group(r, c.rank == 1)
        before = r.snapshot() if c.rank == 0 else None
        with pytest.raises(lg.CheckpointError) as info:
            lt.save_checkpoint(tmp_path / "ck", r.opt)
        said.append(str(info.value))
        _bad_group(r, False)
        lt.save_checkpoint(tmp_path / "ck", r.opt)
        r.train(range(2, 3))
        _bad_group(r, c.rank == 1)
        with pytest.raises(lg.CheckpointError) as info:
            lt.load_checkpoint(tmp_path / "ck", r.opt)
        said.append(str(info.value))
        _bad_group(r, False)
        if before is not None:
            assert r.att.gm.step == 3
        lt.load_checkpoint(tmp_path / "ck", r.opt)
        assert r.att.gm.step == 2
        r.close()
        return said
    first, second = threads(2, job)
    assert first == second
    assert "save " in first[0] and "rank 1: TypeError: a param group value of type object" in first[0]
    assert "load " in first[1] and "rank 1: TypeError: a param group value of type object" in first[1]
    assert "rank 0" not in first[0] + first[1]


def _stats_run(c: Any, path: Path, root: Path, stop: int, resume: bool) -> None:
    r = Run(c, stats=True)
    log = StepLog(path, rank=c.rank)
    last = lg.checkpoint.latest(root, verify=True) if resume else None
    if last is not None:
        lt.load_checkpoint(last, r.opt, log=log)
    for s in range(r.att.gm.step, stop):
        r.train(range(s, s + 1))
        log.record(r.att.step_stats(), skipped=False)
        if (s + 1) % 2 == 0:
            lt.save_checkpoint(root / f"step-{s + 1:06d}", r.opt, log=log)
    r.close()


def test_the_log_resumes_with_save_checkpoint(tmp_path: Path) -> None:
    """save_checkpoint(..., log=log) / load_checkpoint(..., log=log): a run stopped a step after its
    checkpoint and resumed on the same log reads back as the uninterrupted run's log."""
    threads(2, lambda c: _stats_run(c, tmp_path / "straight.jsonl", tmp_path / "a", 5, False))
    threads(2, lambda c: _stats_run(c, tmp_path / "grad.jsonl", tmp_path / "b", 3, False))  # saved at 2, ran 3
    threads(2, lambda c: _stats_run(c, tmp_path / "grad.jsonl", tmp_path / "b", 5, True))
    straight = read_log(tmp_path / "straight.jsonl")
    assert [r["step"] for r in straight] == [0, 1, 2, 3, 4] and straight[-1]["global"]["noise"]["ema"]
    assert read_log(tmp_path / "grad.jsonl") == straight


def test_a_log_state_that_cannot_load_changes_nothing(tmp_path: Path) -> None:
    """A checkpoint without a log's state, or one kept with another ema_decay: CheckpointError on
    every rank, the optimizer, manager and log unchanged."""
    def job(c: Any) -> None:
        r = Run(c)
        r.train(range(1))
        lt.save_checkpoint(tmp_path / "plain", r.opt)
        lt.save_checkpoint(tmp_path / "logged", r.opt, log=StepLog(tmp_path / "g.jsonl", rank=c.rank))
        r.train(range(1, 2))
        before = r.snapshot()
        log = StepLog(tmp_path / "g2.jsonl", rank=c.rank, ema_decay=0.5)
        with pytest.raises(lg.CheckpointError, match="plain: holds no gradient log state"):
            lt.load_checkpoint(tmp_path / "plain", r.opt, log=log)
        with pytest.raises(lg.CheckpointError, match="logged: the gradient log's state: .*decay 0.9, this one's "
                                                     "is 0.5"):
            lt.load_checkpoint(tmp_path / "logged", r.opt, log=log)
        same(r.snapshot(), before)
        assert log.state_dict() == {"ema": {"decay": 0.5, "sums": []}, "step": None}
        lt.load_checkpoint(tmp_path / "logged", r.opt, log=StepLog(tmp_path / "g3.jsonl", rank=c.rank))
        r.close()
    threads(2, job)
