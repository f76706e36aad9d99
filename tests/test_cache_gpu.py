"""On the GPU, a fed kernel cache changes nothing: with every entry swapped for another kernel's
and a FIFO in place of one, a fresh process (``python -m lowgrad doctor``) recompiles, launches
add_sr, replays it in a CUDA graph and exits 0, without hanging."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import assert_rewritten, counting_compile

from lowgrad.cuda import compiler

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(600)
def test_doctor_runs_the_real_kernels_from_a_fed_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lowgrad import Device

    cache = tmp_path / "cache"
    monkeypatch.setenv("LOWGRAD_CACHE_DIR", str(cache))
    compiler.clear_memory_cache()
    compiler.compile_kernels(Device(0).arch)
    compiler.clear_memory_cache()
    paths = [next(cache.glob(f"{m}-*.cubin")) for m in compiler.modules()]
    data = [p.read_bytes() for p in paths]
    for p, other in zip(paths, data[1:] + data[:1]):  # each entry now holds the next module's entry
        p.write_bytes(other)
    add_sr = paths[compiler.modules().index("add_sr")]
    add_sr.unlink()
    os.mkfifo(add_sr, 0o600)
    out = subprocess.run([sys.executable, "-m", "lowgrad", "doctor"], capture_output=True, text=True, cwd=ROOT,
                         timeout=500, env={**os.environ, "LOWGRAD_CACHE_DIR": str(cache)}, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert any(ln.startswith("[    ok] kernel ") and "add_sr compiled for" in ln for ln in lines), out.stdout
    assert any(ln.startswith("[    ok] CUDA graph") for ln in lines), out.stdout
    assert "is not a regular file" in out.stderr  # the FIFO was refused with a warning
    for p in paths:  # every entry rewritten: this process now loads them all without NVRTC
        assert_rewritten(p)
    calls = counting_compile(monkeypatch)
    compiler.clear_memory_cache()
    compiler.compile_kernels(Device(0).arch)
    assert calls == []
