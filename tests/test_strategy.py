"""The strategy interface (lowgrad/managers/strategy.py) holds: every strategy lives in its own
file of lowgrad/managers/strategies/, is registered there, and reaches the manager only through
its StrategyContext: no file of a strategy reads or writes a private member (``x._name``) of
anything but itself, and none imports the manager."""
from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Any

import pytest

import lowgrad as lg
from lowgrad.managers import STRATEGIES
from lowgrad.managers.strategy import Strategy

FOLDER = Path(__file__).resolve().parents[1] / "lowgrad" / "managers" / "strategies"


def private_access(path: Path) -> list[str]:
    """Each ``x._name`` in ``path`` (dunders aside) but ``self._name`` where the file assigns
    ``self._name`` itself, and each import of the manager module: ``file:line: what``."""
    tree = ast.parse(path.read_text())
    own = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
           and isinstance(n.value, ast.Name) and n.value.id == "self"}
    bad = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__"):
            mine = isinstance(n.value, ast.Name) and n.value.id == "self" and n.attr in own
            if not mine:
                bad.append(f"{path.name}:{n.lineno}: {ast.unparse(n)}")
        if isinstance(n, ast.ImportFrom) and n.module is not None and n.module.startswith("lowgrad.managers.manager"):
            bad.append(f"{path.name}:{n.lineno}: imports {n.module}")
    return bad


def test_no_strategy_touches_a_private_member_of_the_manager() -> None:
    files = sorted(FOLDER.glob("*.py"))
    assert len(files) > len(STRATEGIES) - 1
    bad = [b for f in files for b in private_access(f)]
    assert not bad, f"strategies reach past their StrategyContext: {bad}"


def test_the_check_sees_a_private_access(tmp_path: Path) -> None:
    """The walk above finds what it looks for (the old strategies, subclasses of the manager,
    failed it: ``self._protocol``, ``self._join``, ``self._reduce_scatter_all``...)."""
    f = tmp_path / "s.py"
    f.write_text("from lowgrad.managers.manager import GradientManager\n"
                 "class S:\n    def __init__(self, ctx):\n        self._mine = ctx\n"
                 "    def notify(self):\n        self._mine.run()\n        self._protocol.micro\n"
                 "        self.ctx._wait(1)\n")
    assert [b.split(": ", 1)[1] for b in private_access(f)] == [
        "imports lowgrad.managers.manager", "self._protocol", "self.ctx._wait"]


def test_one_file_per_strategy_registered_by_name() -> None:
    for name, cls in STRATEGIES.items():
        assert issubclass(cls, Strategy) and cls.name == name
        assert Path(__import__(cls.__module__, fromlist=["_"]).__file__).parent == FOLDER
    assert len({c.__module__ for c in STRATEGIES.values()}) == len(STRATEGIES)


@pytest.mark.parametrize("strategy", [n for n, cls in STRATEGIES.items() if not cls.option_names()])
def test_a_strategy_without_options_refuses_one_before_allocating(strategy: str) -> None:
    layout = lg.Layout(block=(lg.ParamSpec("w", (8, 4)),), non_block=(lg.ParamSpec("emb", (6, 4)),), num_layers=2)

    def create(comm: lg.HostCommunicator) -> None:
        before = comm.device.memory_report().as_dict()
        with pytest.raises(TypeError, match=f"the {strategy} strategy takes no options; got \\['group_size'\\]"):
            lg.create_gradient_manager(layout, comm, strategy=strategy, group_size=2)
        assert comm.device.memory_report().as_dict() == before
        lg.create_gradient_manager(layout, comm, strategy=strategy).close()
    lg.run_threads(1, create)


def _side(filename: str) -> str | None:
    path = Path(filename)
    if path == FOLDER.parent / "manager.py":
        return "manager"
    if path == FOLDER.parent / "strategy.py" or path.parent == FOLDER:
        return "strategy"
    return None


def crossings(strategy: str, world: int = 2, M: int = 3) -> list[str]:
    """The calls between manager.py and the strategy's code (strategy.py, strategies/) while
    rank 0 hands over one middle layer in a middle micro-step (``block_full`` and
    ``notify_block``): ``caller->callee:function`` each."""
    layout = lg.Layout(block=(lg.ParamSpec("w", (8, 4)), lg.ParamSpec("b", (8,))), non_block=(), num_layers=3)

    def job(comm: Any) -> list[str]:
        gm = lg.create_gradient_manager(layout, comm, strategy=strategy)
        s = comm.device.stream()
        seen: list[str] = []

        def profile(frame: Any, event: str, arg: Any) -> None:
            if event == "call" and frame.f_back is not None:
                a, b = _side(frame.f_back.f_code.co_filename), _side(frame.f_code.co_filename)
                if a and b and a != b:
                    seen.append(f"{a}->{b}:{frame.f_code.co_name}")
        for m in range(M):
            gm.start_micro_step(s, m, M)
            for layer in reversed(range(layout.num_layers)):
                watched = comm.rank == 0 and m == 1 and layer == 1
                if watched:
                    sys.setprofile(profile)
                try:
                    dw, _ = gm.block_full(layer, s)
                    for t in dw.tensors():
                        lg.ops.fill_zero(t, s)  # (no strategy code: not counted)
                    gm.notify_block(layer, s)
                finally:
                    if watched:
                        sys.setprofile(None)
            gm.end_micro_step(s)
        gm.close()
        return seen
    return lg.run_threads(world, job, backend="host")[0]


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_layer_crosses_into_its_strategy_twice_and_never_back(strategy: str) -> None:
    """The narrow contract, counted: one layer of one micro-step calls the strategy's
    ``block_full`` and ``notify`` and nothing else of it, and the strategy calls nothing of
    manager.py (its context's verbs reach the capture and the protocol state directly). Before
    issue 41 scatter_reduce crossed 6 times (4 back up through callbacks: wait, join, the
    protocol state, record)."""
    assert crossings(strategy) == ["manager->strategy:block_full", "manager->strategy:notify"]
