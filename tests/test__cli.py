"""Every script in tools/ and examples/ runs or says why in one line (the promise tools/_cli.py
keeps for the tools, and the examples keep the same way): each one runs here in a subprocess, with
its default arguments or a documented small size, in a fresh folder with ``OUT`` unset, and either

- succeeds: exit status 0, and an example's last line is its verdict (``PASS: ...``); or
- cannot run here and says why: exit status 2, exactly one line on stderr, no traceback (on a
  machine without a GPU, the GPU-only ones say ``needs an NVIDIA GPU and driver``).

Every script has ``--help``; every script of tools/ and examples/ is in :data:`CASES` (a new one
fails :func:`test_every_script_is_covered` until it is added). On a machine with a GPU the cases
that would run a GPU benchmark or the 0.5B model for minutes are skipped (tools/gpu_session.sh
runs them), and the rest may end either way. Each subprocess takes seconds on a 2-core CPU; the
one slow case (the CPU smoke run of run_transformer_gpu.sh, about 45 s) runs only with
``LOWGRAD_SLOW_TESTS=1``.
"""
from __future__ import annotations

import functools
import importlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import lowgrad as lg

REPO = Path(__file__).resolve().parents[1]
GPU = lg.device_count() > 0
NEEDS_GPU = "needs an NVIDIA GPU and driver (CUDA backend)"

# (script, arguments, what it does here without a GPU, whether it runs for minutes on a GPU):
# "ok" exit 0; "verdict" exit 0 and the last line PASS; "gpu" exit 2 with the one line naming the
# GPU; "why" exit 2 with one line (a setup or arguments it cannot run with).
CASES = [
    ("tools/accuracy.py", ["--micro", "16,64", "--n", "1024"], "ok", False),
    ("tools/accuracy.py", ["--grads", "missing.npy"], "why", False),
    ("tools/accuracy_world.py", ["--worlds", "1,2", "--micro-steps", "4"], "ok", False),
    ("tools/accuracy_bias.py", ["--inputs", "const0.3", "--micro", "4", "--max-n", "4096", "--min-n", "1024",
                                "--worlds", "2", "--world-micro", "2", "--modes", "ldsr,sr"], "ok", False),
    ("tools/accuracy_bias.py", ["--grads", "missing.npy"], "why", False),
    ("tools/accuracy_world.py", ["--worlds", "5"], "why", False),
    ("tools/exchange_bias.py", ["--n", "256", "--seeds", "1", "--inputs", "mean-tie"], "ok", False),
    ("tools/exchange_bias.py", ["--inputs", "nothing"], "why", False),
    ("tools/compressed_hop.py", ["--grads", "missing.npy"], "why", False),
    ("tools/bench_graph.py", [], "gpu", True),
    ("tools/bench_kernels.py", [], "gpu", True),
    ("tools/bench_layer.py", [], "gpu", True),
    ("tools/bench_manager.py", [], "gpu", True),
    ("tools/bench_manager.py", ["--backend", "host"], "ok", False),  # the tiny layout: seconds
    ("tools/bench_manager.py", ["--backend", "host", "--world", "3"], "why", False),
    ("tools/fault_soak.py", [], "verdict", False),
    ("tools/grad_report.py", [], "why", False),
    ("tools/grad_report.py", ["--log", "missing.jsonl"], "why", False),
    ("tools/nccl_bench.py", [], "gpu", True),
    ("tools/predict_scaling.py", [], "ok", False),
    ("tools/predict_scaling.py", ["--bench-layer", "missing.json"], "why", False),
    ("tools/race_hunt.py", [], "gpu", True),
    ("tools/summarize_benchmarks.py", ["--check"], "ok", False),  # without --check it rewrites BENCHMARKS.md
    ("tools/world2_report.py", [], "why", False),
    ("tools/world2_report.py", ["missing"], "why", False),
    ("examples/train_lm.py", [], "verdict", False),
    ("examples/train_lm.py", ["--device", "cuda", "--steps", "3"], "gpu", False),
    ("examples/train_lm.py", ["--world", "3"], "why", False),
    ("examples/train_lm.py", ["--world", "0"], "why", False),
    ("examples/train_transformer.py", [], "verdict", True),  # CPU: the tiny model, 30 steps
    ("examples/train_transformer.py", ["--profile"], "gpu", True),
    ("examples/train_transformer.py", ["--mode", "ddp"], "why", False),  # outside torchrun
    ("examples/train_transformer.py", ["--mode", "torch_bf16", "--world", "2"], "why", False),
    ("examples/plot_losses.py", [], "why", False),
    ("examples/run_gpu.sh", [], "gpu", True),
    ("examples/run_transformer_gpu.sh", [], "gpu", True),
]


# the optional packages a script needs beyond the core (the torch extra and transformers): where
# one is missing (an install of ".[cu12,test]"), the script must still say so in one line, and
# its case is then skipped with that reason instead of failing
NEEDS = {"tools/fault_soak.py": ("torch", "transformers"), "examples/train_transformer.py": ("torch", "transformers")}


@functools.cache
def _missing(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return True
    return False


def _env(**extra: str) -> dict[str, str]:
    """This Python first on PATH (the shell scripts call python3), OUT unset."""
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["PYTHON"] = sys.executable
    env.update(extra)
    return env


def _run(script: str, args: list[str], cwd: Path, timeout: float = 240, **env: str) -> subprocess.CompletedProcess[str]:
    cmd = ["bash"] if script.endswith(".sh") else [sys.executable]
    return subprocess.run([*cmd, str(REPO / script), *args], cwd=cwd, env=_env(**env), capture_output=True,
                          text=True, timeout=timeout, check=False)


def _says_why(proc: subprocess.CompletedProcess[str]) -> str:
    """The one line of a script that cannot run (exit 2, one line on stderr, no traceback)."""
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr[-3000:])
    return lines[0]


@pytest.mark.parametrize("script,args,cpu,long_on_gpu", CASES, ids=[f"{c[0]} {' '.join(c[1])}".strip() for c in CASES])
def test_runs_or_says_why_in_one_line(script: str, args: list[str], cpu: str, long_on_gpu: bool,
                                      tmp_path: Path) -> None:
    if GPU and long_on_gpu:
        pytest.skip("runs for minutes on a GPU: tools/gpu_session.sh and the GPU scripts run it")
    proc = _run(script, args, tmp_path)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    missing = [m for m in NEEDS.get(script, ()) if _missing(m)]
    if missing:
        line = _says_why(proc)
        assert line.startswith(Path(script).stem) and "pip install" in line, line
        pytest.skip(f"needs {' and '.join(missing)}, not installed here ({line})")
    if GPU and proc.returncode == 2:  # a GPU machine may still lack something (CuPy, a CUDA PyTorch)
        _says_why(proc)
        return
    if GPU and cpu == "gpu":
        cpu = "verdict" if script.startswith("examples/") else "ok"
    if cpu in ("ok", "verdict"):
        assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
        if cpu == "verdict":
            assert proc.stdout.splitlines()[-1].startswith("PASS: ") or proc.stdout.splitlines()[-1] == "PASS", \
                proc.stdout[-2000:]
    else:
        line = _says_why(proc)
        name = Path(script).stem
        assert line.startswith(name), line  # the script names itself
        if cpu == "gpu":
            assert NEEDS_GPU in line, line


def test_every_script_is_covered() -> None:
    scripts = {str(p.relative_to(REPO)) for p in [*REPO.glob("tools/*.py"), *REPO.glob("examples/*.py"),
                                                  *REPO.glob("examples/*.sh")] if p.name != "_cli.py"}
    assert scripts <= {c[0] for c in CASES}, f"not run by this test: {sorted(scripts - {c[0] for c in CASES})}"


SCRIPTS = sorted(str(p.relative_to(REPO)) for folder in ("tools", "examples") for ext in ("py", "sh")
                 for p in (REPO / folder).glob(f"*.{ext}") if not p.name.startswith("_"))


@pytest.mark.parametrize("script", SCRIPTS)
def test_help(script: str, tmp_path: Path) -> None:
    """Every script of tools/ and examples/ (found by listing the folders) answers ``--help`` on
    stdout with status 0, whatever extras are installed (the help comes before any import of one)."""
    proc = _run(script, ["--help"], tmp_path, timeout=60)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-3000:]
    assert "usage:" in proc.stdout or script.endswith(".sh") and "bash examples/" in proc.stdout, proc.stdout


# what each script runs with its stdout a closed pipe (``script | head -1``): a quick run that
# prints, or the help where no run fits (world2_report's input is a GPU session's folder)
PIPED: dict[str, list[str]] = {
    "tools/accuracy.py": ["--micro", "16,64", "--n", "1024"],
    "tools/accuracy_bias.py": ["--inputs", "const0.3", "--micro", "4", "--max-n", "4096", "--min-n", "1024",
                               "--worlds", "2", "--world-micro", "2", "--modes", "ldsr,sr"],
    "tools/accuracy_world.py": ["--worlds", "1,2", "--micro-steps", "4"],
    "tools/bench_graph.py": [], "tools/bench_kernels.py": [], "tools/bench_layer.py": [], "tools/nccl_bench.py": [],
    "tools/race_hunt.py": [],
    "tools/bench_manager.py": ["--backend", "host"],
    "tools/fault_soak.py": ["--steps", "3"],
    "tools/grad_report.py": ["--log", "grad.jsonl"],
    "tools/predict_scaling.py": [],
    "tools/exchange_bias.py": ["--n", "256", "--seeds", "1", "--inputs", "mean-tie"],
    "tools/compressed_hop.py": ["--grads", "grads.npy", "--seeds", "1", "--micro-steps", "2"],
    "tools/world2_report.py": ["--help"],
    "tools/summarize_benchmarks.py": ["--help"],  # it prints nothing with --check, and rewrites BENCHMARKS.md without
    "examples/plot_losses.py": ["run.json"],
    "examples/train_lm.py": ["--world", "2", "--steps", "3"],
    "examples/train_transformer.py": ["--steps", "3"],
    "examples/run_gpu.sh": [], "examples/run_transformer_gpu.sh": [],
    "tools/gpu_session.sh": ["--help"], "tools/gpu_session_world2.sh": ["--help"],  # the whole GPU session
}


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_closed_pipe_ends_quietly(script: str, tmp_path: Path) -> None:
    """``script | head -1`` where the reader is gone before the first line (so that the outcome
    does not depend on timing): no traceback, and the status a shell gives a command that SIGPIPE
    ended (141), as ``lowgrad doctor`` does (docs/cli.md); a script that cannot run here says
    why in one line instead (status 2). Every script has a case."""
    assert script in PIPED, f"add {script} to PIPED"
    if GPU and any(c[0] == script and c[3] for c in CASES):
        pytest.skip("runs for minutes on a GPU: tools/gpu_session.sh and the GPU scripts run it")
    if script == "tools/grad_report.py":
        from test_grad_report import write_log
        write_log(tmp_path / "grad.jsonl")
    if script == "tools/compressed_hop.py":  # (micro-steps, n) gradients, as tools/accuracy.py reads them
        np.save(tmp_path / "grads.npy", np.random.default_rng(0).standard_normal((2, 4096)).astype(np.float32))
    if script == "examples/plot_losses.py":
        made = _run("examples/train_lm.py", ["--steps", "3", "--quiet", "--json", "run.json"], tmp_path)
        assert made.returncode == 0, made.stderr
    read, write = os.pipe()
    os.close(read)
    cmd = ["bash"] if script.endswith(".sh") else [sys.executable]
    try:
        proc = subprocess.run([*cmd, str(REPO / script), *PIPED[script]], cwd=tmp_path, env=_env(), stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=240, check=False)
    finally:
        os.close(write)
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr, proc.stderr[-3000:]
    if proc.returncode == 2:  # cannot run here (no GPU, no torch, no matplotlib): one line that says so
        line = proc.stderr.splitlines()
        assert len(line) == 1 and line[0].startswith(Path(script).stem), proc.stderr
        return
    # 141 from Python, or killed by SIGPIPE (a shell script's echo): the same status in a shell;
    # argparse's help ignores a closed pipe itself (0)
    quiet = (141, -signal.SIGPIPE, *((0,) if PIPED[script] == ["--help"] else ()))
    assert proc.returncode in quiet, (proc.returncode, proc.stderr[-3000:])


SHELL = [s for s in SCRIPTS if s.endswith(".sh")]
BAD = [(s, ["--bogus"]) for s in SCRIPTS] + [(s, a) for s in SHELL for a in (["-x"], ["a-folder", "another"])]


@pytest.mark.parametrize("script,args", BAD, ids=[f"{s} {' '.join(a)}" for s, a in BAD])
def test_a_bad_argument_is_one_line_naming_it(script: str, args: list[str], tmp_path: Path) -> None:
    """Every script answers an argument it does not know with one line on stderr that names it
    (not a required one that is missing: grad_report's ``--log``, plot_losses' files), status 2,
    nothing on stdout, nothing written; a shell script takes one folder and no option but
    ``--help``."""
    proc = _run(script, args, tmp_path, timeout=120)
    line = _says_why(proc)
    assert line.startswith(Path(script).stem) and "unrecognized arguments: " in line and args[-1] in line, line
    assert proc.stdout == "" and os.listdir(tmp_path) == [], (proc.stdout, os.listdir(tmp_path))


def test_plot_losses_without_matplotlib_names_the_extra(tmp_path: Path) -> None:
    """A stand-in matplotlib that fails to import, as on an install without the plot extra (the
    README's test command installs none, so the plot itself is not run here)."""
    run = _run("examples/train_lm.py", ["--steps", "3", "--quiet", "--json", "run.json"], tmp_path)
    assert run.returncode == 0 and (tmp_path / "run.json").is_file(), run.stderr
    fake = tmp_path / "fake" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('No module named matplotlib (stand-in)')\n")
    proc = _run("examples/plot_losses.py", ["run.json"], tmp_path, PYTHONPATH=str(fake.parent))
    assert ".[plot]" in _says_why(proc) and not (tmp_path / "losses.png").exists()


def test_accuracy_bias_plot_without_matplotlib_fails_before_the_run(tmp_path: Path) -> None:
    """``--plot`` without matplotlib: the one line naming the extra at once (it ran every row for
    minutes, then failed with a traceback), nothing written."""
    fake = tmp_path / "fake" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('No module named matplotlib (stand-in)')\n")
    proc = _run("tools/accuracy_bias.py", ["--plot", "bias.png"], tmp_path, timeout=60, PYTHONPATH=str(fake.parent))
    line = _says_why(proc)
    assert "--plot needs matplotlib" in line and ".[plot]" in line and proc.stdout == "", line
    assert sorted(os.listdir(tmp_path)) == ["fake"]


def test_bench_manager_prints_a_readable_parameter_count() -> None:
    """Three significant figures in the unit that fits (the tiny layout printed ``0.00B``)."""
    sys.path.insert(0, str(REPO / "tools"))
    try:
        bench_manager = importlib.import_module("bench_manager")
    finally:
        sys.path.remove(str(REPO / "tools"))
    got = {n: bench_manager.count(n) for n in (7, 999, 181_248, 999_999, 494_032_768, 7_615_616_512)}
    assert got == {7: "7", 999: "999", 181_248: "181k", 999_999: "1M", 494_032_768: "494M",
                   7_615_616_512: "7.62B"}


def test_outputs_go_to_out_or_the_current_folder_never_the_repository_root(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    proc = _run("tools/predict_scaling.py", [], tmp_path, OUT=str(out))
    assert proc.returncode == 0 and (out / "predict_scaling.json").is_file(), proc.stderr
    assert proc.stdout.splitlines()[-1] == f"wrote {out / 'predict_scaling.json'}"
    root = _run("tools/predict_scaling.py", [], REPO)
    assert root.returncode == 0, root.stderr
    wrote = Path(root.stdout.splitlines()[-1].removeprefix("wrote "))
    assert wrote.is_file() and REPO not in wrote.resolve().parents, wrote
    missing = _run("tools/accuracy.py", ["--n", "16", "--micro", "2"], tmp_path, OUT=str(tmp_path / "absent"))
    assert "no such directory" in _says_why(missing)


@pytest.mark.parametrize("cwd,out,given,expected", [
    ("tmp", "", "", "runs"),
    ("tmp", "out", "", "out/runs"),
    ("tmp", "out", "mine", "mine"),
    ("repo", "", "", None),  # the temporary folder, not the repository's root
])
def test_shell_scripts_get_the_same_output_rule(cwd: str, out: str, given: str, expected: str | None,
                                                tmp_path: Path) -> None:
    """``_cli.py output-path TOOL NAME [GIVEN]``, what the shell scripts call before they change
    folder: the user's path, else $OUT/NAME, else ./NAME, never the repository's root."""
    (tmp_path / "out").mkdir()
    env = {"OUT": str(tmp_path / out)} if out else {}
    folder = REPO if cwd == "repo" else tmp_path
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "_cli.py"), "output-path", "some.sh", "runs",
                           *([given] if given else [])], cwd=folder, env=_env(**env), capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    got = folder / proc.stdout.strip()
    if expected is None:
        assert got.name == "runs" and REPO not in got.resolve().parents
    else:
        assert got.resolve() == (tmp_path / expected).resolve()


@pytest.mark.skipif(not os.environ.get("LOWGRAD_SLOW_TESTS"), reason="slow (about 45 s on 2 cores): "
                    "set LOWGRAD_SLOW_TESTS=1")
@pytest.mark.skipif(GPU, reason="the CPU smoke run")
def test_run_transformer_gpu_cpu_smoke_run(tmp_path: Path) -> None:
    """The CPU smoke run its header documents: every run passes, the profile is skipped."""
    proc = _run("examples/run_transformer_gpu.sh", [str(tmp_path / "tt")], tmp_path, timeout=600, SIZE="tiny",
                STEPS="2", GRAD_MICRO="8", BATCH="2", SEQ="32")
    assert proc.returncode == 0 and proc.stdout.splitlines()[-1].startswith("PASS: "), proc.stdout[-3000:]
    assert "profile: skipped (no GPU)" in proc.stdout
