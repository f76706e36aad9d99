"""A strategy registered at run time is a strategy like the others: ``toy_all_reduce`` (full
gradients on every rank, the engine accumulating into them, one all-reduce per tensor at the
last micro-step; it rounds nothing, shards nothing and offloads nothing) is defined in this file
alone, registered in ``STRATEGIES``, and the shared suites (managers, statistics, faults,
checkpoints, the PyTorch adapter), parametrized over the registry, run over it. What fails there
is a place that names strategies instead of asking the registry or the strategy class.

Loaded as a pytest plugin (``-p test_strategy_registered``) this module registers the strategy
before the suites are collected; as a test module it registers it only inside its own tests."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import lowgrad as lg
from lowgrad.buffers.streams import StreamLike
from lowgrad.managers import STRATEGIES
from lowgrad.managers.strategies.unsharded import Unsharded
from lowgrad.managers.strategy import StatsTarget

ROOT = Path(__file__).resolve().parents[1]
#: the suites parametrized over STRATEGIES (helpers.strategy_configs)
SUITES = ("test_managers.py", "test_manager_stats.py", "test_manager_faults.py", "test_checkpoint.py",
          "test_torch_adapter.py", "test_torch_checkpoint.py", "test_torch_faults.py")


class AllReduce(Unsharded):
    """``unsharded``'s buffers (full gradients of every layer, the engine accumulating into them,
    shards that are views of this rank's rows), another exchange: at the last micro-step each
    tensor is all-reduced (average) in place, and no local statistics are measured."""

    name = "toy_all_reduce"  # not a name lowgrad's own strategies would take

    def stats_kinds(self) -> tuple[bool, str | None]:
        return False, None

    def bind(self, target: StatsTarget | None) -> None:
        pass  # nothing to pack: one all-reduce per tensor

    def notify(self, layer: int, stream: StreamLike) -> None:
        ctx = self.ctx
        if ctx.last and ctx.world > 1:
            ctx.join(stream)
            with ctx.comm.group(ctx.comm_stream, event=ctx.group_done):
                for t in self.tensors[layer]:
                    ctx.comm.all_reduce(t, op="avg", stream=ctx.comm_stream)


def register() -> None:
    STRATEGIES[AllReduce.name] = AllReduce


def pytest_configure(config: pytest.Config) -> None:
    """As a plugin: registered before any suite is collected."""
    register()


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(STRATEGIES, AllReduce.name, AllReduce)


def test_its_shards_are_the_mean_of_every_rank_and_its_state_loads(registered: None) -> None:
    layout = lg.Layout(block=(lg.ParamSpec("w", (8, 4)),), non_block=(lg.ParamSpec("emb", (6, 4)),), num_layers=2)

    def job(comm: Any) -> tuple[np.ndarray, dict[str, Any]]:
        gm = lg.create_gradient_manager(layout, comm, strategy=AllReduce.name, seed=5)
        s = comm.device.stream()
        gm.start_micro_step(s, 0, 1)
        for name in ("emb",):
            t, _ = gm.non_block_full(name, s)
            t.numpy()[...] = 0
            gm.notify_non_block(name, s)
        for layer in (1, 0):
            dw, _ = gm.block_full(layer, s)
            dw["w"].numpy()[...] = np.full((8, 4), comm.rank + layer, np.float32).astype(lg.bf16.np)
            gm.notify_block(layer, s)
        gm.end_micro_step(s)
        shard = gm.block_shard(1, s)["w"].numpy().astype(np.float64)
        state = gm.state_dict()
        again = lg.create_gradient_manager(layout, comm, strategy=AllReduce.name)
        again.load_state_dict(state)  # a strategy that rounds nothing loads its own state
        assert (again.step, again.base_seed, again.rounding) == (1, 5, None)
        again.close()
        gm.close()
        return shard, state

    results = lg.run_threads(2, job, backend="host")
    for shard, state in results:
        assert (shard == 1.5).all()  # the mean of ranks 0 and 1 at layer 1: (1 + 2) / 2
        assert state["strategy"] == AllReduce.name and "rounding" not in state


def test_the_class_answers_what_callers_ask(registered: None) -> None:
    assert (AllReduce.rounds(), AllReduce.sharded, AllReduce.offloads, AllReduce.option_names()) == (
        False, False, False, ())
    with pytest.raises(ValueError, match="keeps full gradients"):
        lg.run_threads(1, lambda c: lg.create_gradient_manager(
            lg.Layout(block=(lg.ParamSpec("w", (8, 4)),), non_block=(), num_layers=1), c, strategy=AllReduce.name,
            offload=True))


def test_the_demo_runs_it(registered: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``lowgrad demo`` reads the registry: its ``--strategy`` choices and its runs hold the new
    strategy, whose shards pass the demo's float64 check."""
    import json

    from lowgrad.cli.main import main

    js = tmp_path / "demo.json"
    assert main(["demo", "--backend", "host", "--world", "2", "--micro-steps", "3", "--steps", "2",
                 "--strategy", AllReduce.name, "--json", str(js)]) == 0, capsys.readouterr().out
    rows = json.loads(js.read_text())
    assert [(r["strategy"], r["offload"], r["passed"]) for r in rows] == [(AllReduce.name, False, True)]


@pytest.mark.timeout(1200)
def test_the_shared_suites_run_over_a_registered_strategy() -> None:
    """Every suite parametrized over the registry, run with this module as a plugin and only
    the registered strategy's cases selected: each passes, and each suite has some."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", Path(__file__).stem,
                          "-k", AllReduce.name, "-rs", *(str(ROOT / "tests" / s) for s in SUITES)],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=1100)
    tail = out.stdout[-6000:] + out.stderr[-2000:]
    assert out.returncode == 0, tail
    passed = re.search(r"(\d+) passed", out.stdout)
    assert passed and int(passed.group(1)) > 0, tail
    # every suite contributed cases (a suite that names its strategies by hand has none of the toy's)
    listed = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                             "-p", Path(__file__).stem, "-k", AllReduce.name,
                             *(str(ROOT / "tests" / s) for s in SUITES)],
                            capture_output=True, text=True, cwd=ROOT, env=env, timeout=300).stdout
    assert all(f"{s}::" in listed for s in SUITES), listed[-3000:]
