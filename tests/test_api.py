"""The public face of the package: what ``import lowgrad`` shows (``dir``, ``help``, ``__all__``),
one exception tree, the version defined once, ``device_count`` without a driver, and the
packaging metadata that ships ``py.typed``, the license and the examples."""
from __future__ import annotations

import importlib.util
import inspect
import pkgutil
import pydoc
import re
from pathlib import Path

import pytest

import lowgrad
from lowgrad.base.version import __version__

ROOT = Path(__file__).resolve().parents[1]


def _modules() -> list[object]:
    # lowgrad.torch and its modules import PyTorch, an extra
    optional = () if importlib.util.find_spec("torch") else ("lowgrad.torch",)
    names = [m.name for m in pkgutil.walk_packages(lowgrad.__path__, "lowgrad.")
             if m.name != "lowgrad.__main__" and not any(m.name == o or m.name.startswith(o + ".") for o in optional)]
    return [lowgrad, *(importlib.import_module(n) for n in names)]


def test_every_lowgrad_exception_sits_under_lowgrad_error_and_is_exported() -> None:
    found = {cls for mod in _modules() for _, cls in inspect.getmembers(mod, inspect.isclass)
             if issubclass(cls, BaseException) and cls.__module__.startswith("lowgrad")}
    assert {c.__name__ for c in found} >= {"LowgradError", "ProtocolError", "NcclLibraryError", "CudaError"}
    for cls in found:
        assert issubclass(cls, lowgrad.LowgradError), f"{cls.__module__}.{cls.__name__} is outside LowgradError"
        assert getattr(lowgrad, cls.__name__, None) is cls and cls.__name__ in lowgrad.__all__, cls.__name__
    assert issubclass(lowgrad.ProtocolError, ValueError)  # a misuse is also a bad argument


def test_public_names_are_visible_to_dir_help_and_star_import() -> None:
    names = {"create_gradient_manager", "run_threads", "from_env", "Layout", "ParamSpec", "llama_layout", "Graph",
             "Device", "HostDevice", "Tensor", "GradientManager", "device_count", "ops", "LowgradError"}
    assert names <= set(dir(lowgrad)) and names <= set(lowgrad.__all__)
    assert all(hasattr(lowgrad, n) for n in lowgrad.__all__)
    assert len(set(lowgrad.__all__)) == len(lowgrad.__all__)
    assert "annotations" not in dir(lowgrad)  # no __future__ feature leaks into the namespace
    text = pydoc.render_doc(lowgrad, renderer=pydoc.plaintext)  # type: ignore[attr-defined]
    for n in ("create_gradient_manager", "run_threads", "Layout", "Graph", "ProtocolError"):
        assert n in text
    namespace: dict[str, object] = {}
    exec("from lowgrad import *", namespace)
    assert names <= set(namespace)


def test_version_is_defined_once() -> None:
    assert lowgrad.__version__ == __version__ and re.fullmatch(r"\d+\.\d+\.\d+\S*", __version__)
    text = (ROOT / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in text and 'version = {attr = "lowgrad.base.version.__version__"}' in text
    assert not re.search(r'^version\s*=\s*"', text, re.MULTILINE)  # no second copy in the metadata


def test_device_count_is_zero_without_a_driver() -> None:
    from lowgrad.cuda import driver

    n = lowgrad.device_count()
    assert isinstance(n, int)
    assert n == 0 if not driver.available() else n >= 1


def test_packaging_metadata() -> None:
    tomllib = pytest.importorskip("tomllib")
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    project = meta["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]  # SPDX, PEP 639
    assert (ROOT / "LICENSE").is_file() and (ROOT / "CHANGELOG.md").is_file()
    assert "Typing :: Typed" in project["classifiers"]
    assert not any(c.startswith("License ::") for c in project["classifiers"])  # superseded by the SPDX string
    assert any(r.startswith("setuptools>=77") for r in meta["build-system"]["requires"])
    assert project["scripts"]["lowgrad"] == "lowgrad.cli.main:main"
    assert "py.typed" in meta["tool"]["setuptools"]["package-data"]["lowgrad"]
    assert (ROOT / "lowgrad" / "py.typed").is_file()
    manifest = (ROOT / "MANIFEST.in").read_text().split("\n")
    for folder in ("examples", "tests", "docs"):  # tests/test_examples.py needs examples/ in the sdist
        assert f"graft {folder}" in manifest


def test_main_module_is_the_cli_entry() -> None:
    import lowgrad.__main__ as entry  # importing it runs nothing
    from lowgrad.cli.main import main

    assert entry.main is main


# --- each public module's __all__ is its documented list, both ways ---------------------------------

def _doc(name: str) -> str:
    return (ROOT / "docs" / name).read_text()


def _names_after(text: str, marker: str) -> set[str]:
    """The bare backticked names of the paragraph that ``marker`` starts, after the marker."""
    para = text[text.index(marker) + len(marker):].split("\n\n")[0]
    return set(re.findall(r"`([A-Za-z]\w*)`", para))


def documented_lowgrad(design: str) -> set[str]:
    """design.md's stable names: the first name of each backticked span of the section (``lowgrad.``
    dropped) that ``lowgrad`` has (its lazy names and its non-module globals; prose such as
    ``device.alloc`` names nothing of it), plus the exceptions it lists as "LowgradError and its
    subclasses" (read from the code)."""
    section = design[design.index("These names are stable"):design.index("- Command line:")]
    has = set(lowgrad._LAZY) | {n for n, v in vars(lowgrad).items()
                                 if not n.startswith("_") and not inspect.ismodule(v)}
    heads = set(re.findall(r"`(?:lowgrad\.)?([A-Za-z_]\w*)", section))
    exceptions = {n for n in has if isinstance(getattr(lowgrad, n), type)
                  and issubclass(getattr(lowgrad, n), lowgrad.LowgradError)}
    return (heads & has) | exceptions


def documented_ops(design: str) -> set[str]:
    """design.md's Kernels section: one ``- `name(...)`` entry per call, then the sentence naming
    the rest of ``lowgrad.ops.__all__``."""
    section = design[design.index("## Kernels"):]
    section = section[:section.index("\n## ")]
    calls = set(re.findall(r"^- `(\w+)\(", section, re.MULTILINE))
    return calls | _names_after(section, "`lowgrad.ops.__all__` holds exactly:")


DOCUMENTED = {
    "lowgrad": lambda: documented_lowgrad(_doc("design.md")),
    "lowgrad.ops": lambda: documented_ops(_doc("design.md")),
    "lowgrad.diagnostics": lambda: _names_after(_doc("diagnostics.md"), "`lowgrad.diagnostics.__all__` is exactly:"),
    "lowgrad.torch": lambda: _names_after(_doc("torch.md"), "`lowgrad.torch.__all__` is exactly:"),
}


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_all_is_the_documented_list(name: str) -> None:
    """Each public module's ``__all__`` is exactly the list its page documents: a name added to,
    or dropped from, one side alone fails here (test_the_comparison_sees_one_sided_changes)."""
    if name == "lowgrad.torch":
        pytest.importorskip("torch", reason="lowgrad.torch imports PyTorch (the torch extra)")
    module = importlib.import_module(name)
    exported, documented = set(module.__all__), DOCUMENTED[name]()
    assert len(module.__all__) == len(exported), f"{name}.__all__ names something twice"
    assert all(hasattr(module, n) for n in exported)
    assert exported == documented, (f"{name}: in __all__ only {sorted(exported - documented)}, "
                                    f"documented only {sorted(documented - exported)}")


def test_the_comparison_sees_one_sided_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A call dropped from the docs' list alone, or a name added to or dropped from ``__all__``
    alone, makes the sets differ."""
    import lowgrad.diagnostics
    from lowgrad import ops

    design = _doc("design.md")
    entry = re.search(r"^- `scale_sr\(.*?(?=^- `)", design, re.MULTILINE | re.DOTALL)
    assert entry
    assert documented_ops(design.replace(entry.group(0), "")) == set(ops.__all__) - {"scale_sr"}
    assert "HostDevice" not in documented_lowgrad(design.replace("`HostDevice()`, ", ""))
    assert "norm_squared" in documented_ops(design)
    monkeypatch.setattr(ops, "__all__", [n for n in ops.__all__ if n != "copy"])
    assert set(ops.__all__) != documented_ops(design)
    monkeypatch.setattr(lowgrad.diagnostics, "__all__", [*lowgrad.diagnostics.__all__, "report"])
    assert set(lowgrad.diagnostics.__all__) != DOCUMENTED["lowgrad.diagnostics"]()
    monkeypatch.setattr(lowgrad, "__all__", [n for n in lowgrad.__all__ if n != "Graph"])
    assert set(lowgrad.__all__) != documented_lowgrad(design)  # Graph is still lowgrad's, and documented


def test_import_loads_no_backend_manager_or_launcher() -> None:
    import subprocess
    import sys
    code = ("import sys, lowgrad; print(sorted({m.split('.')[1] for m in sys.modules if m.startswith('lowgrad.')}), "
            "'cuda.bindings' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['base', 'buffers'] False", out
