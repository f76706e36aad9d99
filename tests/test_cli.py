"""``python -m lowgrad doctor`` and ``demo`` run end to end (host backend where there is no GPU)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str, cache: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ) if cache is None else {**os.environ, "LOWGRAD_CACHE_DIR": str(cache)}
    return subprocess.run([sys.executable, "-m", "lowgrad", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=300, env=env)


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
    assert "max ulps" in out.stdout


def test_demo_rejects_a_world_that_does_not_divide_the_layout() -> None:
    out = run("demo", "--backend", "host", "--world", "3")
    assert out.returncode != 0 and "divisible by world 3" in out.stderr
