"""The installed wheel (the README's `pip install .`) carries the kernel sources, finds them, and
ships ``py.typed``."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lowgrad.cuda.compiler import modules

REPO = Path(__file__).resolve().parent.parent


def test_installed_package_finds_its_kernels_and_subpackages(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["LOWGRAD_CACHE_DIR"] = str(tmp_path / "cache")
    # every module of the source tree must import from the installed wheel
    names = sorted(".".join(("lowgrad", *p.relative_to(REPO / "lowgrad").with_suffix("").parts))
                   .removesuffix(".__init__") for p in (REPO / "lowgrad").rglob("*.py")
                   if p.stem != "__main__" and p.stem != "torch")  # lowgrad.torch needs the torch extra
    code = (f"import importlib; [importlib.import_module(m) for m in {names!r}]; "
            "import lowgrad, lowgrad.cuda.compiler as c; print(lowgrad.__file__); "
            "print(c.kernel_dir()); print(sorted(lowgrad.compile_kernels('sm_90')))")
    code += "; import os; print(os.path.isfile(os.path.join(os.path.dirname(lowgrad.__file__), 'py.typed')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env)
    if out.returncode and "No module named 'lowgrad'" in out.stderr:
        pytest.skip("lowgrad is not installed in this interpreter (run from a source checkout)")
    assert out.returncode == 0, out.stderr
    pkg, kdir, mods, typed = out.stdout.splitlines()
    if Path(pkg).resolve().parent == REPO / "lowgrad":
        pytest.skip("the importable lowgrad is this source checkout (editable install)")
    assert Path(kdir).resolve() == (Path(pkg).parent / "kernels").resolve()
    assert (Path(kdir) / "sr.cuh").is_file()
    assert mods == str(sorted(modules())) and "seed_counter" in modules()
    assert typed == "True"  # PEP 561: type checkers read lowgrad's annotations
