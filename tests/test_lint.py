"""The tree is clean under the project's linters, run as a contributor runs them from the
repository's root: ``python -m ruff check .`` and ``python -m mypy``, with the settings of
pyproject.toml's [tool.ruff] and [tool.mypy] (docs/contributing.md). Both come with the ``test``
extra, which the README's test command (CI's) installs: a missing one fails here, it does not skip.

Neither writes into the checkout: ruff runs without its cache, mypy keeps its cache in the
temporary directory (a warm run takes about a second, a cold one about 10 s)."""
from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"
# one cache per checkout and Python: two checkouts would otherwise keep invalidating each other's
MYPY_CACHE = Path(tempfile.gettempdir()) / "lowgrad-mypy" / hashlib.sha256(
    f"{ROOT}|{sys.version}".encode()).hexdigest()[:16]


def _tool(name: str, *args: str, cwd: Path = ROOT, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``python -m NAME ARGS`` in ``cwd``; fails (not skips) when NAME is not installed."""
    if importlib.util.find_spec(name) is None:
        pytest.fail(f"{name} is not installed in this Python: it comes with the test extra "
                    f"(pip install \".[test]\")", pytrace=False)
    env = {k: v for k, v in os.environ.items() if k not in ("MYPYPATH", "RUFF_CACHE_DIR")}
    return subprocess.run([sys.executable, "-m", name, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=env, check=False)


def _mypy(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return _tool("mypy", "--config-file", str(PYPROJECT), "--cache-dir", str(MYPY_CACHE), *args,
                 cwd=cwd, timeout=240)


def test_ruff_finds_nothing() -> None:
    res = _tool("ruff", "check", "--no-cache", "--output-format", "concise", ".")
    assert res.returncode == 0, f"ruff check . found:\n{res.stdout}{res.stderr}"


@pytest.mark.timeout(300)
def test_mypy_finds_nothing() -> None:
    # lowgrad/torch/, tools/fault_soak.py and examples/train_transformer.py are checked against
    # torch's own annotations (CI installs the torch it pins), and their imports must resolve: with
    # the test extra alone, mypy reports those imports missing (and the `type: ignore`s that torch's
    # annotations need unused), so the check needs the torch extra and transformers
    for module in ("torch", "transformers"):
        pytest.importorskip(module, reason=f"mypy checks the PyTorch adapter and the scripts that import {module} "
                                           f"against its annotations: pip install \".[torch]\" transformers")
    res = _mypy()
    assert res.returncode == 0, f"mypy found:\n{res.stdout}{res.stderr}"
    # every file named by [tool.mypy] files was checked (the config was read, and no file was lost)
    files = [p for d in ("lowgrad", "tools", "examples") for p in (ROOT / d).rglob("*.py")]
    m = re.search(r"no issues found in (\d+) source files", res.stdout)
    assert m and int(m.group(1)) == len(files), res.stdout


def test_the_settings_are_in_force(tmp_path: Path) -> None:
    """The checks above would pass vacuously if the settings were not read: a file with an unused
    import, a blind except and an unannotated function fails both, under the project's settings."""
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n\n\ndef f(x):\n    try:\n        return x\n    except Exception:\n        return None\n")
    res = _tool("ruff", "check", "--no-cache", "--config", str(PYPROJECT), "--output-format", "concise", str(bad),
                cwd=tmp_path)
    assert res.returncode == 1 and "F401" in res.stdout and "BLE001" in res.stdout, res.stdout + res.stderr
    res = _mypy(str(bad), cwd=tmp_path)
    assert res.returncode == 1 and "[no-untyped-def]" in res.stdout, res.stdout + res.stderr


def test_the_test_extra_brings_the_linters() -> None:
    """CI installs ruff and mypy through the test extra of the README's test command."""
    from test_readme import installs, readme_test_command

    assert {"ruff", "mypy"} <= installs(readme_test_command())
