"""README.md's engine example runs as printed on the host backend and prints what the README says."""
from __future__ import annotations

import os
import re
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
