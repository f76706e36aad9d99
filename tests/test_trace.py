"""The opt-in trace and NVTX ranges (CPU side)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import lowgrad as lg
from lowgrad.core import trace


def test_trace_file_gets_one_line_per_copy(tmp_path: Path) -> None:
    out = tmp_path / "trace.log"
    trace.enable(str(out))
    try:
        h = lg.HostDevice()
        a, b = h.alloc(16, lg.fp32, name="src_t"), h.alloc(16, lg.fp32, kind="pinned", name="dst_t")
        lg.ops.copy(b, a)
        lg.ops.copy(a, b)
    finally:
        trace.enable(None)
    lines = out.read_text().splitlines()
    assert len(lines) == 2 and all(l.startswith("lowgrad-trace ") for l in lines)
    assert "copy device->pinned bytes=64 dst=dst_t src=src_t" in lines[0]
    assert not trace.ENABLED


def test_trace_from_environment_and_off_by_default(tmp_path: Path) -> None:
    code = ("import lowgrad as lg; from lowgrad.core import trace; h = lg.HostDevice(); "
            "a = h.alloc(4, lg.bf16, name='x'); lg.ops.copy(a, a); print(trace.ENABLED)")
    on = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                        env={"LOWGRAD_TRACE": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)})
    assert on.stdout.strip() == "True" and "lowgrad-trace" in on.stderr and "copy device->device" in on.stderr
    off = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)})
    assert off.stdout.strip() == "False" and "lowgrad-trace" not in off.stderr


def test_nvtx_range_is_a_context_manager_with_or_without_nvtx() -> None:
    ran = []
    with trace.nvtx_range("lowgrad.test"):
        ran.append(1)
    assert ran == [1]
