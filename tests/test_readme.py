"""README.md's engine example runs as printed on the host backend and prints what the README says;
CI runs the README's test command verbatim, and that command installs what the tests import."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## Using it from an engine"


def engine_example() -> tuple[str, str]:
    """The section's first ``python`` block and the ``text`` block after it (its output)."""
    text = (ROOT / "README.md").read_text()
    assert SECTION in text, f"README.md has no {SECTION!r} section"
    section = text[text.index(SECTION):]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code, "no python block in the engine section"
    out = re.search(r"```text\n(.*?)```", section[code.end():], re.S)
    assert out, "no text block with the output after the engine example"
    return code.group(1), out.group(1)


@pytest.mark.timeout(60)
def test_readme_engine_example_runs_and_prints_its_output(tmp_path: Path) -> None:
    code, want = engine_example()
    script = tmp_path / "readme_engine.py"
    script.write_text(code)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.pop("LOWGRAD_TRACE", None)
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=50, env=env,
                         cwd=tmp_path, check=False)
    assert res.returncode == 0, res.stderr
    assert res.stdout == want


def test_readme_example_extraction_finds_the_blocks() -> None:
    code, want = engine_example()
    assert "lg.run_threads(" in code and 'backend="host"' in code
    assert want.count("\n") == 2


# --- the install and test commands at the top of README.md -----------------------------------------

def top_commands() -> list[str]:
    """The lines of README.md's first fenced block: the demo command, then the test command."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```[^\n]*\n(.*?)```", text, re.DOTALL)
    assert block, "README.md has no fenced block"
    return [ln for ln in block.group(1).splitlines() if ln.strip()]


def readme_test_command() -> str:
    """The README's one command that runs the tests."""
    (line,) = [ln for ln in top_commands() if "pytest" in ln]
    return line


def pip_install_args(line: str) -> list[str]:
    """The arguments of the ``pip install`` in a ``cmd && cmd && ...`` line."""
    for part in line.split("&&"):
        words = shlex.split(part)
        if words[:2] == ["pip", "install"]:
            return words[2:]
    raise AssertionError(f"no pip install in {line!r}")


def installs(line: str) -> set[str]:
    """The distributions a README command asks for by name: its requirements and the
    requirements of the extras of ``.[...]`` (from pyproject.toml)."""
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = set()
    for arg in pip_install_args(line):
        if arg.startswith("."):
            m = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", arg)
            assert m, arg
            for extra in filter(None, (m.group(1) or "").split(",")):
                assert extra in extras, f"README installs an extra {extra!r} that pyproject.toml does not define"
                names |= {canonicalize_name(Requirement(r).name) for r in extras[extra]}
        elif not arg.startswith("-"):
            names.add(canonicalize_name(Requirement(arg).name))
    return names


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    """.ci/run's last line is the README's test command, character for character, under `set -euo
    pipefail` (so pytest's own status, 5 for "no tests collected" included, is CI's); the slow
    tests are opted into on that line itself, and nothing else in .ci/run changes what runs (a
    reader of the README runs the tests CI runs)."""
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert "set -euo pipefail" in ci
    line = readme_test_command()
    assert ci[-1] == line, f".ci/run's last line is not the README's test command:\n{line}"
    assert line.startswith("python3 -m venv .venv && . .venv/bin/activate && pip install ")
    assert line.endswith(" && LOWGRAD_SLOW_TESTS=1 python -m pytest -q")
    setup = [ln for ln in ci[:-1] if not ln.lstrip().startswith("#")]
    assert not [ln for ln in setup if "LOWGRAD_" in ln], "a LOWGRAD_ variable set outside the README's line"


def test_the_test_command_installs_what_the_tests_import() -> None:
    """Every package a CPU test file imports or skips without (pytest.importorskip) is installed by
    the README's test command: a test that skips in CI tests nothing there. GPU test files
    (*_gpu.py) run on a GPU machine and may want more (cupy)."""
    wanted = set()
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        if path.stem.endswith("_gpu"):
            continue
        for name in re.findall(r"importorskip\(\s*[\"']([\w.]+)[\"']", path.read_text()):
            top = name.split(".")[0]
            if top not in sys.stdlib_module_names:
                wanted.add(top.replace("_", "-").lower())
    assert {"torch", "transformers"} <= wanted  # the lowgrad.torch tests, test_train_transformer
    missing = wanted - installs(readme_test_command())
    assert not missing, f"the README's test command does not install {sorted(missing)}: those tests would skip in CI"


def test_install_parsing() -> None:
    line = 'python3 -m venv .venv && . .venv/bin/activate && pip install ".[cu13,test]" "torch==2.13.0" x && true'
    assert pip_install_args(line) == [".[cu13,test]", "torch==2.13.0", "x"]
    assert {"pytest", "nvidia-nccl-cu13", "torch", "x"} <= installs(line)
    with pytest.raises(AssertionError, match="does not define"):
        installs('pip install ".[nonesuch]"')
