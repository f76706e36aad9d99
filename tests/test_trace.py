"""The opt-in trace (``LOWGRAD_TRACE``, :func:`trace.enable`, the ``lowgrad`` logger) and NVTX
ranges, on the host backend."""
from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from helpers import Records

import lowgrad as lg
from lowgrad.base import trace


@pytest.fixture
def routed() -> Iterator[Records]:
    """A user handler on the ``lowgrad`` logger at DEBUG; level and handler restored after."""
    logger, h = logging.getLogger("lowgrad"), Records()
    level = logger.level
    logger.addHandler(h)
    logger.setLevel(logging.DEBUG)
    try:
        yield h
    finally:
        logger.setLevel(level)
        logger.removeHandler(h)


def _host_job(comm: lg.HostCommunicator) -> None:
    """One of every host kernel and collective the managers use."""
    d = comm.device
    a = lg.from_numpy(np.ones(8, np.float32), d, name="tr_a")
    b = lg.from_numpy(np.ones(8, np.float32), d, name="tr_b")
    lg.ops.add_sr(a, a, b, 1.0, 1)
    lg.ops.fill_zero(b)
    comm.all_reduce(a)
    comm.reduce_scatter(a)
    comm.all_gather(a)
    comm.all_to_all(b)
    peer = 1 - comm.rank
    if comm.rank == 0:
        comm.send(a, peer)
    else:
        comm.recv(a, peer)


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
    code = ("import lowgrad as lg; from lowgrad.base import trace; h = lg.HostDevice(); "
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


def test_logger_level_routes_trace_records_to_user_handlers(routed: Records) -> None:
    assert trace.ENABLED
    lg.run_threads(2, _host_job)
    lines = {(r.trace_kind, r.trace_name, r.threadName) for r in routed.records}  # type: ignore[attr-defined]
    for rank in (0, 1):
        t = f"lowgrad-rank{rank}"
        assert {("kernel", "add_sr", t), ("kernel", "fill", t), ("collective", "all_reduce", t),
                ("collective", "reduce_scatter", t), ("collective", "all_gather", t),
                ("collective", "all_to_all", t)} <= lines
    assert ("collective", "send", "lowgrad-rank0") in lines and ("collective", "recv", "lowgrad-rank1") in lines
    assert all(r.levelno == logging.DEBUG and r.name == "lowgrad" for r in routed.records)
    rs = next(r for r in routed.records if r.trace_name == "reduce_scatter")  # type: ignore[attr-defined]
    assert "count=4 dtype=fp32 stream=0x0 op=avg" in rs.getMessage() and rs.getMessage().startswith("lowgrad-trace ")
    logging.getLogger("lowgrad").setLevel(logging.INFO)
    assert not trace.ENABLED  # the level switches the hot-path flag back off
    n = len(routed.records)
    lg.run_threads(1, lambda c: lg.ops.fill_zero(lg.from_numpy(np.ones(4, np.float32), c.device)))
    assert len(routed.records) == n


def test_a_debug_root_logger_alone_does_not_switch_the_trace_on() -> None:
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.DEBUG)
    try:
        assert logging.getLogger("lowgrad").getEffectiveLevel() == logging.DEBUG and not trace.ENABLED
    finally:
        root.setLevel(level)
    assert any(isinstance(h, logging.NullHandler) for h in logging.getLogger("lowgrad").handlers)


def test_enable_writes_host_kernels_and_collectives_to_a_file(tmp_path: Path) -> None:
    out = tmp_path / "trace.log"
    trace.enable(str(out))
    try:
        assert not logging.getLogger("lowgrad").propagate  # lowgrad writes these lines itself
        lg.run_threads(2, _host_job)
    finally:
        trace.enable(None)
    assert logging.getLogger("lowgrad").propagate and not trace.ENABLED
    text = out.read_text()
    for what in ("kernel add_sr dst=tr_a numel=8 dtype=fp32", "kernel fill dst=tr_b",
                 "collective all_reduce rank=1", "collective reduce_scatter rank=0", "collective all_gather",
                 "collective all_to_all",
                 "collective send rank=0 tensor=tr_a count=8 dtype=fp32 stream=0x0 peer=1", "collective recv rank=1"):
        assert what in text, what


@pytest.mark.timeout(60)
def test_lowgrad_trace_lines_are_written_once_beside_a_root_handler() -> None:
    code = ("import logging, sys; logging.basicConfig(level=logging.DEBUG, stream=sys.stderr); "
            "import lowgrad as lg, numpy as np; h = lg.HostDevice(); "
            "lg.ops.fill_zero(lg.from_numpy(np.ones(4, np.float32), h, name='once'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60,
                         env={"LOWGRAD_TRACE": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)})
    assert out.stderr.count("kernel fill dst=once") == 1
