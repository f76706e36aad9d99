"""The package's folders are its layers; this test holds the import rules.

``base`` < ``buffers`` < ``contracts`` (and ``base`` < ``runtime``), together the bottom (``CORE``) <
(``sr`` | ``diagnostics``) < (``ops`` | ``cuda`` | ``host``) < (``launch`` | ``managers``) <
``checkpoint`` < (``cli`` | ``torch``):
a module may import its own layer and the layers its row allows, nothing else (imports inside
functions and under ``TYPE_CHECKING`` count too), and the module graph has no cycles.
"""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "lowgrad"

CORE = {"base", "buffers", "contracts", "runtime"}  # what was one folder, core/, by what each layer is
ALLOWED: dict[str, set[str]] = {
    "base": {"base"},  # errors, dtypes, integer and timeout rules, trace
    "buffers": {"base", "buffers"},  # memory, tensors, DLPack, release, streams, capture
    "contracts": {"base", "buffers", "contracts"},  # the device, kernel-table and communicator contracts
    "runtime": {"base", "runtime"},  # thread ranks and the watchdog
    "sr": {*CORE, "sr"},
    "ops": {*CORE, "sr"},
    "cuda": {*CORE, "sr", "cuda"},
    "host": {*CORE, "sr", "host"},
    "managers": {*CORE, "sr", "ops", "diagnostics", "managers"},
    "launch": {*CORE, "sr", "cuda", "host", "launch"},  # starting ranks: the one layer that picks a backend
    "diagnostics": {*CORE, "diagnostics"},
    "checkpoint": {*CORE, "managers", "checkpoint"},  # every rank's state on disk (no backend)
    "cli": {*CORE, "sr", "ops", "cuda", "host", "managers", "launch", "diagnostics", "checkpoint", "cli"},
    "torch": {*CORE, "sr", "ops", "managers", "diagnostics", "checkpoint", "torch"},  # the PyTorch adapter
}
TOP = {"__init__", "__main__"}  # the public front: may import anything


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        rel = p.relative_to(PKG).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _layer(mod: str) -> str:
    head = mod.split(".")[0]
    return "top" if head in TOP and "." not in mod else head


def _imports(mod: str, path: Path, known: set[str]) -> set[str]:
    pkg_parts = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg_parts[:len(pkg_parts) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and (node.module == "lowgrad" or node.module.startswith("lowgrad.")):
                target = node.module[len("lowgrad."):] if node.module != "lowgrad" else ""
            else:
                continue
            for a in node.names:
                sub = f"{target}.{a.name}" if target else a.name
                found.add(sub if sub in known else target)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("lowgrad."):
                    found.add(a.name[len("lowgrad."):])
    return {f for f in found if f and f != mod}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {m: {i for i in _imports(m, p, known)} for m, p in mods.items()}


def test_every_module_has_a_layer() -> None:
    for mod in _modules():
        assert _layer(mod) in ALLOWED or _layer(mod) == "top", f"lowgrad.{mod} sits in no layer"


def test_layers_import_only_below() -> None:
    bad = []
    for mod, deps in _graph().items():
        layer = _layer(mod)
        if layer == "top":
            continue
        for d in deps:
            if _layer(d) not in ALLOWED[layer]:
                bad.append(f"lowgrad.{mod} ({layer}) imports lowgrad.{d} ({_layer(d)})")
    assert not bad, "\n".join(bad)


def test_no_import_cycles() -> None:
    graph = _graph()
    # packages' __init__ re-export their modules: an edge into a package is an edge into its
    # __init__ only, so ignore edges from a package to its own children.
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if d.startswith(m + "."):
                continue
            if state.get(d) == 1:
                cycles.append(" -> ".join(stack[stack.index(d):] + [d]))
            elif d in graph and d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state and _layer(m) != "top":
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_rules_catch_a_violation(tmp_path: Path) -> None:
    """The walker itself: a host module importing cuda is reported."""
    p = tmp_path / "x.py"
    p.write_text("from lowgrad.cuda import device\nfrom ..buffers import tensor\n")
    known = {"cuda.device", "buffers.tensor", "host.x"}
    deps = _imports("host.x", p, known)
    assert deps == {"cuda.device", "buffers.tensor"}
    assert _layer("cuda.device") not in ALLOWED["host"]


WHOLE = {"layers", "api", "contract", "one_definition", "gc_storm", "install", "examples", "readme", "docs", "lint"}


def test_test_files_are_named_after_modules() -> None:
    """``tests/test_<module>[_<topic>][_props|_gpu].py`` (``<layer>_<module>`` where two layers
    share a module name; or ``<script>`` for a script of ``tools/`` or ``examples/``), or one of
    the whole-package tests."""
    stems = {m.split(".")[-1] for m in _modules()} | {m.replace(".", "_") for m in _modules()}
    stems |= {p.stem for d in ("tools", "examples") for p in (PKG.parent / d).glob("*.py")}
    bad = []
    for path in sorted((PKG.parent / "tests").glob("test_*.py")):
        name = path.stem[len("test_"):].removesuffix("_gpu").removesuffix("_props")
        if name in WHOLE or any(name == s or name.startswith(s + "_") for s in stems):
            continue
        bad.append(path.name)
    assert not bad, f"test files named after no module: {bad}"

