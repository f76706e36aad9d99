"""The command line: ``lowgrad``/``python -m lowgrad`` with ``--version``, ``doctor`` (text and
``--json``) and ``demo`` (verdict, legend) end to end (host backend where there is no GPU)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import lowgrad
from lowgrad.cli import demo_report
from lowgrad.cli.demo_report import Result
from lowgrad.cli.main import main, prog_name

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str, cache: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ) if cache is None else {**os.environ, "LOWGRAD_CACHE_DIR": str(cache)}
    return subprocess.run([sys.executable, "-m", "lowgrad", *args], check=False, capture_output=True, text=True,
                          cwd=ROOT, timeout=300, env=env)


def test_doctor_reports_every_library(tmp_path: Path) -> None:
    out = run("doctor", cache=tmp_path / "cache")
    assert out.returncode == 0, out.stdout + out.stderr
    for what in ("packages", "NVRTC", "NCCL library", "CUDA driver", "kernel cache"):
        assert what in out.stdout
    assert "[FAILED]" not in out.stdout
    assert "[    ok] NVRTC" in out.stdout and "[    ok] NCCL library" in out.stdout
    assert "[    ok] kernel cache" in out.stdout and "private, writable" in out.stdout
    assert "[    ok] CUDA driver" in out.stdout or "[absent] CUDA driver" in out.stdout


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
    assert "[    ok] NVRTC" in out.stdout  # the other lines still ran


@pytest.mark.parametrize("world", [1, 2])
def test_demo_on_the_host_backend_checks_against_float64(tmp_path: Path, world: int) -> None:
    js = tmp_path / "demo.json"
    out = run("demo", "--backend", "host", "--world", str(world), "--micro-steps", "3", "--steps", "2",
              "--json", str(js))
    assert out.returncode == 0, out.stdout + out.stderr
    rows = json.loads(js.read_text())
    assert {(r["strategy"], r["offload"]) for r in rows} == {("unsharded", False), ("scatter_reduce", False),
                                                              ("scatter_reduce", True), ("all_to_all", False),
                                                              ("all_to_all", True)}
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


def test_doctor_json_lines(tmp_path: Path) -> None:
    out = run("doctor", "--json", cache=tmp_path / "cache")
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert all(set(r) == {"name", "status", "detail"} and r["status"] in ("ok", "absent") for r in rows)
    names = [r["name"] for r in rows]
    assert names[:7] == ["lowgrad", "packages", "cuda-bindings", "NVRTC", "kernel cache", "NCCL library", "CUDA driver"]
    assert lowgrad.__version__ in rows[0]["detail"]


def test_doctor_json_exit_status_on_a_failed_line(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.write_text("a file where the cache directory should be")
    out = run("doctor", "--json", cache=cache)
    assert out.returncode == 1
    rows = {r["name"]: r for r in map(json.loads, out.stdout.splitlines())}
    assert rows["kernel cache"]["status"] == "FAILED" and str(cache) in rows["kernel cache"]["detail"]
    assert rows["NVRTC"]["status"] == "ok"


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
