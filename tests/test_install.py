"""The installed wheel (the README's `pip install .`) carries the kernel sources, finds them, and
ships ``py.typed``; pyproject.toml's extras fit together (one CUDA stack per install, none for a
CPU-only one)."""
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
    # every module of the source tree must import from the installed wheel (lowgrad.torch's need the torch extra)
    names = sorted(".".join(("lowgrad", *p.relative_to(REPO / "lowgrad").with_suffix("").parts))
                   .removesuffix(".__init__") for p in (REPO / "lowgrad").rglob("*.py")
                   if p.stem != "__main__" and p.relative_to(REPO / "lowgrad").parts[0] != "torch")
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


# --- the extras fit together (pyproject.toml) ---------------------------------------------------------

def _project() -> dict:
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _reqs(specs: list[str]) -> dict:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    out: dict = {}
    for s in specs:
        r = Requirement(s)
        name = canonicalize_name(r.name)
        assert name not in out, f"{name} named twice in {specs}"
        out[name] = r
    return out


def _admits(reqs: list, version: str) -> bool:
    return all(r.specifier.contains(version, prereleases=True) for r in reqs)


CUDA_PYTHON = [f"{major}.{minor}.0" for major in (12, 13, 14) for minor in range(10)]


def test_a_cpu_only_install_gets_no_cuda_wheels() -> None:
    """`pip install .` (the host backend) brings numpy, ml_dtypes and cuda-python (bindings only):
    the NVRTC and NCCL wheels come from an extra or with PyTorch, never from the core."""
    core = _reqs(_project()["dependencies"])
    assert set(core) == {"numpy", "ml-dtypes", "cuda-python"}
    assert not any(n.startswith("nvidia-") for n in core)


def test_cuda_extras_are_one_stack_each() -> None:
    """cu12 and cu13: cuda-python of that major, with the NVRTC and NCCL wheels of the same major."""
    extras = _project()["optional-dependencies"]
    core = _reqs(_project()["dependencies"])["cuda-python"]
    for major, nvrtc, nccl in ((12, "nvidia-cuda-nvrtc-cu12", "nvidia-nccl-cu12"),
                               (13, "nvidia-cuda-nvrtc", "nvidia-nccl-cu13")):
        r = _reqs(extras[f"cu{major}"])
        assert set(r) == {"cuda-python", nvrtc, nccl}, (major, set(r))
        ok = [v for v in CUDA_PYTHON if _admits([core, r["cuda-python"]], v)]
        assert ok and {v.split(".")[0] for v in ok} == {str(major)}, (major, ok)
        if nvrtc == "nvidia-cuda-nvrtc":  # one name for every major from 13 on: the range says which
            assert r[nvrtc].specifier.contains("13.0.88") and not r[nvrtc].specifier.contains("14.0.0")


def test_the_torch_extra_goes_with_cu13_and_refuses_cu12() -> None:
    """PyTorch >= 2.11 on Linux requires cuda-bindings 13 and the CUDA 13 NVRTC and NCCL wheels:
    the torch extra asks for such a torch and for cuda-python 13, so `.[torch]` and `.[cu13,torch]`
    resolve to one CUDA stack, and `.[cu12,torch]` is a conflict pip reports at once (no version
    of cuda-python satisfies both) rather than a silent downgrade of torch to its last CUDA 12
    release."""
    extras = _project()["optional-dependencies"]
    core = _reqs(_project()["dependencies"])["cuda-python"]
    torch = _reqs(extras["torch"])
    assert set(torch) == {"torch", "cuda-python"}
    assert not torch["torch"].specifier.contains("2.10.0") and torch["torch"].specifier.contains("2.11.0")
    assert torch["torch"].specifier.contains("2.13.0+cpu")  # the CPU build CI installs
    cu12 = _reqs(extras["cu12"])["cuda-python"]
    cu13 = _reqs(extras["cu13"])["cuda-python"]
    assert not [v for v in CUDA_PYTHON if _admits([core, cu12, torch["cuda-python"]], v)]
    assert [v for v in CUDA_PYTHON if _admits([core, cu13, torch["cuda-python"]], v)]
    assert [v for v in CUDA_PYTHON if _admits([core, torch["cuda-python"]], v)]


def test_test_and_plot_extras() -> None:
    extras = _project()["optional-dependencies"]
    assert set(_reqs(extras["test"])) == {"pytest", "hypothesis", "pytest-timeout",  # timeout = in [tool.pytest]
                                          "ruff", "mypy"}  # tests/test_lint.py
    assert set(_reqs(extras["plot"])) == {"matplotlib"}  # examples/plot_losses.py
    assert set(extras) == {"cu12", "cu13", "test", "torch", "plot"}  # a new extra: README's table names it
