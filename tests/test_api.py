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
from lowgrad.core.version import __version__

ROOT = Path(__file__).resolve().parents[1]


def _modules() -> list[object]:
    optional = set() if importlib.util.find_spec("torch") else {"lowgrad.torch"}  # imports PyTorch, an extra
    names = [m.name for m in pkgutil.walk_packages(lowgrad.__path__, "lowgrad.")
             if m.name != "lowgrad.__main__" and m.name not in optional]
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
    assert 'dynamic = ["version"]' in text and 'version = {attr = "lowgrad.core.version.__version__"}' in text
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


def test_all_is_the_stable_list_of_the_design_doc() -> None:
    text = (ROOT / "docs" / "design.md").read_text()
    section = text[text.index("These names are stable"):text.index("- Command line:")]
    heads = set(re.findall(r"`(?:lowgrad\.)?([A-Za-z_]\w*)", section))
    documented = {h for h in heads if h in lowgrad.__all__ or h[0].isupper()}
    exceptions = {n for n in lowgrad.__all__ if isinstance(getattr(lowgrad, n), type)
                  and issubclass(getattr(lowgrad, n), BaseException)}
    assert documented | exceptions == set(lowgrad.__all__), (documented ^ set(lowgrad.__all__)) - exceptions


def test_import_loads_no_backend_manager_or_launcher() -> None:
    import subprocess
    import sys
    code = ("import sys, lowgrad; print(sorted({m.split('.')[1] for m in sys.modules if m.startswith('lowgrad.')}), "
            "'cuda.bindings' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['core'] False", out
