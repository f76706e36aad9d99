"""The command line: ``lowgrad``/``python -m lowgrad`` with ``--version``, ``doctor`` (text and
``--json``; with and without the GPU stack, and with a broken one) and ``demo`` (verdict, legend)
end to end (host backend where there is no GPU)."""
from __future__ import annotations

import ctypes.util
import importlib.metadata as md
import json
import os
import site
import subprocess
import sys
import venv
from pathlib import Path

import pytest
from helpers import strategy_configs

import lowgrad
from lowgrad.cli import demo_report
from lowgrad.cli.demo_report import Result
from lowgrad.cli.main import main, prog_name

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str, cache: Path | None = None, python: str = sys.executable,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ) if env is None else env
    if cache is not None:
        env["LOWGRAD_CACHE_DIR"] = str(cache)
    return subprocess.run([python, "-m", "lowgrad", *args], check=False, capture_output=True, text=True,
                          cwd=ROOT, timeout=300, env=env)


def installed(*dists: str) -> bool:
    """Whether any of the distributions is installed in this interpreter."""
    for d in dists:
        try:
            md.version(d)
            return True
        except md.PackageNotFoundError:
            pass
    return False


NVRTC_WHEELS = ("nvidia-cuda-nvrtc-cu12", "nvidia-cuda-nvrtc")
NCCL_WHEELS = ("nvidia-nccl-cu12", "nvidia-nccl-cu13")
TOP = ["lowgrad", "packages", "cuda-bindings", "NVRTC", "kernel cache", "NCCL library", "CUDA driver"]


def statuses(stdout: str) -> dict[str, str]:
    """{check name: status} of doctor's text output; fails on a line that is not a check line
    (a blank line, a stray message) other than the closing note of a machine without a driver."""
    out = {}
    lines = stdout.splitlines()
    assert stdout.endswith("\n") and "" not in lines, f"a blank line in doctor's output:\n{stdout}"
    for ln in lines:
        if ln.startswith("no usable NVIDIA driver/GPU"):
            continue
        assert ln[:1] == "[" and ln[7:9] == "] ", f"not a check line: {ln!r}"
        status, rest = ln[1:7].strip(), ln[9:]
        out[rest[:22].rstrip()] = status
    return out


def test_doctor_reports_every_library(tmp_path: Path) -> None:
    """Here: every check is ok or absent, and a library whose wheel is installed is ok."""
    out = run("doctor", cache=tmp_path / "cache")
    assert out.returncode == 0, out.stdout + out.stderr
    got = statuses(out.stdout)
    assert list(got)[:7] == TOP
    assert set(got.values()) <= {"ok", "absent"}, out.stdout
    assert got["lowgrad"] == got["packages"] == got["cuda-bindings"] == got["kernel cache"] == "ok"
    assert "private, writable" in out.stdout
    if installed(*NVRTC_WHEELS):  # the test command's cu13 extra: CI has them, so they must load
        assert got["NVRTC"] == "ok", out.stdout
    if installed(*NCCL_WHEELS):
        assert got["NCCL library"] == "ok", out.stdout
    assert got["CUDA driver"] in ("ok", "absent")


def without_nvidia_wheels(tmp_path: Path, fake: tuple[str, ...] = ()) -> str:
    """The python of a fresh virtual environment that has every package of this one except the
    NVIDIA wheels (``nvidia/`` and ``nvidia_*``: no NVRTC, no NCCL), by symbolic links; each path
    in ``fake`` (under site-packages) becomes a file that is not a library. Returns its python."""
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False, symlinks=True).create(env_dir)
    target = env_dir / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    assert target.is_dir(), target
    sources = [Path(p) for p in [*site.getsitepackages(), *sys.path] if p.endswith(("site-packages", "dist-packages"))]
    for src in dict.fromkeys(s for s in sources if s.is_dir()):
        for entry in src.iterdir():
            if not entry.name.lower().startswith("nvidia") and not (target / entry.name).exists():
                (target / entry.name).symlink_to(entry)
    for rel in fake:
        (target / rel).parent.mkdir(parents=True, exist_ok=True)
        (target / rel).write_bytes(b"not a shared library\n")
    return str(env_dir / "bin" / "python")


def bare_env(tmp_path: Path) -> dict[str, str]:
    """The environment without anything that points lowgrad or cuda-bindings at a CUDA install."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "LOWGRAD_NCCL_LIBRARY", "CUDA_PATH", "CUDA_HOME", "CONDA_PREFIX",
                        "LOWGRAD_TRACE")}
    env["LOWGRAD_CACHE_DIR"] = str(tmp_path / "cache")
    return env


def test_doctor_without_the_gpu_stack_says_absent_and_exits_0(tmp_path: Path) -> None:
    """A CPU-only install (`pip install .`: no NVIDIA wheels) is not broken: NVRTC, NCCL and the
    driver are absent, the exit status is 0, and --json says the same in one document."""
    python, env = without_nvidia_wheels(tmp_path), bare_env(tmp_path)
    out = run("doctor", python=python, env=env)
    got = statuses(out.stdout)
    assert list(got)[:7] == TOP and "FAILED" not in [got[name] for name in TOP], out.stdout
    if got["CUDA driver"] == "absent":  # CI: nothing more runs, and absent is no failure
        assert list(got) == TOP and out.returncode == 0, out.stdout + out.stderr
    # (with a driver the kernel and NCCL checks that follow need NVRTC and NCCL: they fail, rightly)
    if ctypes.util.find_library("nvrtc") is None:  # no CUDA toolkit on this machine's loader path
        assert got["NVRTC"] == "absent", out.stdout
    if ctypes.util.find_library("nccl") is None:
        assert got["NCCL library"] == "absent", out.stdout
    assert "nvidia-" not in next(ln for ln in out.stdout.splitlines() if "] packages" in ln)
    js = run("doctor", "--json", python=python, env=env)
    assert js.returncode == out.returncode, js.stdout + js.stderr
    doc = json.loads(js.stdout)
    assert doc["failed"] is (out.returncode == 1)
    assert {c["name"]: c["status"] for c in doc["checks"]} == got


def test_doctor_fails_on_a_library_that_is_there_but_does_not_load(tmp_path: Path) -> None:
    """Broken, not absent: a libnvrtc and a libnccl where the wheels put them that do not load."""
    fake = ("nvidia/nccl/lib/libnccl.so.2", "nvidia/cu13/lib/libnvrtc.so.13", "nvidia/cuda_nvrtc/lib/libnvrtc.so.12")
    python, env = without_nvidia_wheels(tmp_path, fake), bare_env(tmp_path)
    out = run("doctor", python=python, env=env)
    assert out.returncode == 1, out.stdout + out.stderr
    got = statuses(out.stdout)
    assert got["NVRTC"] == "FAILED" and got["NCCL library"] == "FAILED", out.stdout
    assert got["kernel cache"] == "ok"  # the other lines still ran


def test_doctor_fails_on_a_named_nccl_that_does_not_load(tmp_path: Path) -> None:
    env = {**os.environ, "LOWGRAD_NCCL_LIBRARY": str(tmp_path / "libnccl.so.2")}
    out = run("doctor", cache=tmp_path / "cache", env=env)
    assert out.returncode == 1, out.stdout + out.stderr
    assert statuses(out.stdout)["NCCL library"] == "FAILED" and "LOWGRAD_NCCL_LIBRARY" in out.stdout


@pytest.mark.parametrize("problem", ["world-writable", "not a directory"])
def test_doctor_fails_on_an_unusable_kernel_cache(tmp_path: Path, problem: str) -> None:
    cache = tmp_path / "cache"
    if problem == "world-writable":
        cache.mkdir()
        os.chmod(cache, 0o777)
    else:
        cache.write_text("a file where the cache directory should be")
    out = run("doctor", cache=cache)
    assert out.returncode == 1, out.stdout + out.stderr
    (line,) = [ln for ln in out.stdout.splitlines() if "kernel cache" in ln]
    assert line.startswith("[FAILED]") and str(cache) in line
    assert statuses(out.stdout)["NVRTC"] in ("ok", "absent")  # the other lines still ran


@pytest.mark.parametrize("world", [1, 2])
def test_demo_on_the_host_backend_checks_against_float64(tmp_path: Path, world: int) -> None:
    js = tmp_path / "demo.json"
    out = run("demo", "--backend", "host", "--world", str(world), "--micro-steps", "3", "--steps", "2",
              "--json", str(js))
    assert out.returncode == 0, out.stdout + out.stderr
    rows = json.loads(js.read_text())
    # every registered strategy, with offload where it offloads
    assert [(r["strategy"], r["offload"]) for r in rows] == strategy_configs()
    for r in rows:
        assert 0 < r["max_ulps"] <= 4 and abs(r["bias_ulps"]) < 0.05
        assert r["memory"]["device"]["block_grad"] > 0
        assert r["passed"] is True and r["bias_se_ulps"] >= 0
    assert "max ulps" in out.stdout and "bias ulps  " in out.stdout  # the table and its legend
    assert out.stdout.splitlines()[-1].startswith("verdict: PASS: every strategy within the SR bound (max error <= 4")


def test_demo_rejects_a_world_that_does_not_divide_the_layout() -> None:
    out = run("demo", "--backend", "host", "--world", "3")
    assert out.returncode == 2 and "divisible by world 3" in out.stderr
    assert out.stderr.startswith(f"{os.path.basename(sys.executable)} -m lowgrad demo: error:")  # as invoked


@pytest.mark.parametrize("argv,who,says", [
    (["demo", "--world", "0"], "lowgrad demo", "argument --world: must be at least 1, got 0"),
    (["demo", "--bogus"], "lowgrad demo", "unrecognized arguments: --bogus"),
    (["demo", "--steps"], "lowgrad demo", "argument --steps: expected one argument"),
    (["demo", "--strategy", "nope"], "lowgrad demo", "argument --strategy: invalid choice: 'nope'"),
    (["doctor", "extra"], "lowgrad doctor", "unrecognized arguments: extra"),
    (["doctor", "--jsn"], "lowgrad doctor", "unrecognized arguments: --jsn"),
    (["--bogus", "demo"], "lowgrad", "unrecognized arguments: --bogus"),
    (["bogus"], "lowgrad", "argument {doctor,demo}: invalid choice: 'bogus'"),
    ([], "lowgrad", "the following arguments are required: {doctor,demo}"),
])
def test_an_argument_error_is_one_line_naming_the_command(capsys: pytest.CaptureFixture[str], argv: list[str],
                                                         who: str, says: str) -> None:
    """docs/cli.md: a bad argument is one line on stderr naming the (sub)command it belongs to,
    exit status 2, nothing on stdout (argparse would print the usage first, and blame the
    top-level parser for an option the subcommand does not know)."""
    with pytest.raises(SystemExit) as info:
        main(argv, prog="lowgrad")
    out = capsys.readouterr()
    assert info.value.code == 2 and out.out == ""
    (line,) = out.err.splitlines()
    assert line.startswith(f"{who}: error: {says}"), line  # argparse may add "(choose from ...)"


@pytest.mark.parametrize("args", [["doctor"], ["doctor", "--json"],
                                  ["demo", "--backend", "host", "--micro-steps", "2", "--steps", "1"]])
def test_a_closed_pipe_ends_quietly_with_the_shells_status(args: list[str]) -> None:
    """``lowgrad doctor | head -1``: the reader goes away (here before the first write, so that
    the outcome does not depend on timing); the command ends without a traceback, with 141 (128 +
    SIGPIPE, what the shell reports for a command SIGPIPE ends)."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run([sys.executable, "-m", "lowgrad", *args], cwd=ROOT, stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=300, check=False)
    finally:
        os.close(write)
    assert proc.returncode == 141, proc.stderr
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr, proc.stderr


def test_a_broken_pipe_that_is_not_stdout_is_still_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the reader of stdout going away is quiet: a BrokenPipeError from anything else (a
    rendezvous socket) while stdout is fine propagates."""
    from lowgrad.cli import doctor

    def broken(args: object) -> int:
        raise BrokenPipeError("a socket")

    monkeypatch.setattr(doctor, "run", broken)
    with pytest.raises(BrokenPipeError, match="a socket"):
        main(["doctor"], prog="lowgrad")


def test_version_names_the_program_as_invoked() -> None:
    out = run("--version")
    assert out.returncode == 0 and out.stdout.split() == [os.path.basename(sys.executable), "-m", "lowgrad",
                                                          lowgrad.__version__]
    assert prog_name(str(ROOT / "lowgrad" / "__main__.py")).endswith(" -m lowgrad")
    assert prog_name("/usr/local/bin/lowgrad") == "lowgrad"
    assert prog_name(str(Path(pytest.__file__).parent / "__main__.py")) == "lowgrad"  # another package's -m


@pytest.mark.parametrize("command", [[], ["demo"], ["doctor"]])
def test_help_is_plain_text(capsys: pytest.CaptureFixture[str], command: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([*command, "--help"], prog="lowgrad")
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: {' '.join(['lowgrad', *command])} ")
    for markup in ("``", ":class:", ":func:", ":mod:", ":data:"):
        assert markup not in text
    assert len(text.split("\n\n")) >= 3  # usage, description paragraphs, options


def test_doctor_json_is_one_document(tmp_path: Path) -> None:
    """--json prints one JSON document (json.loads of the whole stdout; JSON Lines would fail with
    "Extra data"), nothing else, with the same checks as the text in the same order."""
    out = run("doctor", "--json", cache=tmp_path / "cache")
    assert out.returncode == 0, out.stdout + out.stderr
    doc = json.loads(out.stdout)
    assert set(doc) == {"version", "lowgrad", "failed", "checks"}
    assert doc["version"] == 1 and doc["lowgrad"] == lowgrad.__version__ and doc["failed"] is False
    rows = doc["checks"]
    assert all(set(r) == {"name", "status", "detail"} and r["status"] in ("ok", "absent") for r in rows)
    assert all("\n" not in r["detail"] for r in rows)
    assert [r["name"] for r in rows][:7] == TOP
    assert lowgrad.__version__ in rows[0]["detail"]
    text = statuses(run("doctor", cache=tmp_path / "cache").stdout)
    assert {r["name"]: r["status"] for r in rows} == text


def test_doctor_json_exit_status_on_a_failed_line(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.write_text("a file where the cache directory should be")
    out = run("doctor", "--json", cache=cache)
    assert out.returncode == 1
    doc = json.loads(out.stdout)
    assert doc["failed"] is True
    rows = {r["name"]: r for r in doc["checks"]}
    assert rows["kernel cache"]["status"] == "FAILED" and str(cache) in rows["kernel cache"]["detail"]
    assert rows["NVRTC"]["status"] in ("ok", "absent")  # the other checks still ran


def _result(max_ulps: float, bias: float, se: float) -> Result:
    return Result("scatter_reduce", True, 2, 1.0, 0.5, max_ulps, 0.3, bias, se, {})


@pytest.mark.parametrize("max_ulps, bias, se, why", [
    (4.0, 0.0, 0.001, None),  # at the bound
    (4.01, 0.0, 0.001, "max error 4.01 ulps > 4"),
    (1.0, 0.051, 0.001, "|bias| 0.0510 ulps > 0.0500"),  # the floor
    (1.0, -0.09, 0.02, None),  # within 5 standard errors of a small sample
    (1.0, 0.11, 0.02, "|bias| 0.1100 ulps > 0.1000"),
    (float("nan"), 0.0, 0.0, "max error nan ulps > 4"),  # a NaN never passes
])
def test_demo_verdict_criteria(max_ulps: float, bias: float, se: float, why: str | None) -> None:
    r = _result(max_ulps, bias, se)
    assert demo_report.failures(r, micro_steps=3) == ([] if why is None else [why])
    passed, line = demo_report.verdict([_result(1.0, 0.0, 0.0), r], micro_steps=3)
    assert passed is (why is None)
    assert line.startswith("verdict: PASS" if why is None else "verdict: FAIL")
    assert why is None or f"scatter_reduce+offload: {why}" in line
