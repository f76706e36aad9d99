"""``lowgrad doctor``: what a user runs first on a broken setup. Each check gives one line with a
status: ``ok``; ``FAILED`` with the reason (a broken install: a library that is there but does not
load or is too old, an unusable kernel cache); or ``absent`` (no CUDA driver, no NVRTC, no NCCL: a
CPU-only install, where the host backend works). Text, one line per check, or with ``--json`` one
JSON document. The exit status is 1 when any line FAILED, 0 otherwise (absent is not a failure)."""
from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import platform
import sys
from collections.abc import Callable

from lowgrad.base.version import __version__

SUMMARY = "check the installation: libraries, kernel cache, driver, GPUs, a kernel/NCCL smoke test"
DESCRIPTION = """\
Checks the installation one line at a time: Python packages, cuda-bindings, NVRTC, the
kernel cache, the NCCL library and the CUDA driver; with a driver, also the GPUs, their
peer links, pinned-copy bandwidth, a kernel, NCCL at world 1 and a CUDA graph.

Each line has a status: ok; FAILED with the reason (a broken install: a library that is
there but does not load, or is too old; an unusable kernel cache); or absent (no CUDA
driver, no NVRTC or no NCCL installed: a CPU-only install, where the host backend works).
Exit status: 0 when no line FAILED (absent lines included), 1 otherwise.

With --json stdout is one JSON document (json.load reads it):
  {"version": 1, "lowgrad": "0.1.0", "failed": false,
   "checks": [{"name": "NVRTC", "status": "ok", "detail": "NVRTC 12.9 from ..."}, ...]}"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The doctor's options."""
    p.add_argument("--json", action="store_true",
                   help="print one JSON document (every check's name, status and detail) instead of text")


JSON_VERSION = 1  # of the --json document's layout


class Absent(str):
    """What a check returns when its subject is not installed here: the line is ``absent``, not
    FAILED (a result, not an exception: every lowgrad exception is a public LowgradError)."""


class _Doctor:
    """Runs the checks, prints each line as text (as it goes) or collects it for the one JSON
    document (:meth:`finish`), remembers whether any FAILED."""

    def __init__(self, as_json: bool) -> None:
        self.as_json, self.failed = as_json, False
        self.checks: list[dict[str, str]] = []

    def line(self, status: str, name: str, detail: str) -> None:
        """One line: ``status`` is "ok", "FAILED" or "absent". ``detail`` becomes one line (a
        library's message may carry newlines)."""
        detail = " ".join(str(detail).split())
        self.checks.append({"name": name, "status": status, "detail": detail})
        if not self.as_json:
            print(f"[{status:>6}] {name:<22} {detail}", flush=True)
        self.failed |= status == "FAILED"

    def finish(self) -> None:
        """With --json, print the document: the format version, lowgrad's version, whether any
        check FAILED, and every check in order."""
        if self.as_json:
            print(json.dumps({"version": JSON_VERSION, "lowgrad": __version__, "failed": self.failed,
                              "checks": self.checks}, indent=2), flush=True)

    def note(self, text: str) -> None:
        """A remark for people (text mode only)."""
        if not self.as_json:
            print(text)

    def check(self, name: str, fn: Callable[[], str]) -> bool:
        """Run ``fn`` and print ``name``'s line; True when it is ok. An :class:`Absent` result
        and a CudaUnavailableError are ``absent``, not FAILED."""
        from lowgrad.base.errors import CudaUnavailableError

        try:
            detail = fn()
            if isinstance(detail, Absent):
                self.line("absent", name, detail)
                return False
        except CudaUnavailableError as exc:
            self.line("absent", name, str(exc))
        except Exception as exc:  # noqa: BLE001 - the doctor reports every failure and carries on
            self.line("FAILED", name, f"{type(exc).__name__}: {exc}")
        else:
            self.line("ok", name, detail)
            return True
        return False


def _lowgrad() -> str:
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return f"lowgrad {__version__} from {package}, Python {sys.version.split()[0]} on {platform.platform()}"


def _packages() -> str:
    names = ["numpy", "ml_dtypes", "cuda-bindings", "cuda-python", "nvidia-cuda-nvrtc-cu12", "nvidia-cuda-nvrtc",
             "nvidia-nccl-cu12", "nvidia-nccl-cu13", "torch"]
    found = []
    for n in names:
        try:
            found.append(f"{n} {md.version(n)}")
        except md.PackageNotFoundError:
            pass
    return ", ".join(found)


def _driver() -> str:
    from lowgrad.cuda import driver as _cuda

    drv = _cuda.driver()
    v = _cuda.check("cuDriverGetVersion", drv.cuDriverGetVersion())
    return f"CUDA driver API {v // 1000}.{v % 1000 // 10} from {_loaded('libcuda')}"


def _loaded(name: str) -> str:
    """The path of a shared library this process has mapped (from /proc/self/maps), or '?'."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if name in line and "/" in line}
    except OSError:
        return "?"
    return ", ".join(sorted(paths)) or "?"


def _bindings() -> str:
    import cuda.bindings

    return f"cuda-bindings {cuda.bindings.__version__} from {os.path.dirname(cuda.bindings.__file__)}"


_GET_GPU_STACK = "the host backend needs none; the cu12 or cu13 extra installs it for a GPU"


def _nvrtc() -> str:
    from lowgrad.base.errors import NvrtcError
    from lowgrad.cuda import compiler

    try:
        major, minor = compiler.nvrtc_version()
    except NvrtcError as exc:
        if _not_found(exc.__cause__):
            return Absent(f"not installed ({str(exc.__cause__).strip()}): {_GET_GPU_STACK}")
        raise  # there but failing to load, or a broken cuda-bindings: FAILED
    return f"NVRTC {major}.{minor} from {_loaded('libnvrtc')}; kernel sources {compiler.kernel_dir()}"


def _cache() -> str:
    from lowgrad.cuda import compiler

    return f"{compiler.check_cache()} (LOWGRAD_CACHE_DIR moves it)"


def _not_found(cause: BaseException | None) -> bool:
    """Whether cuda-bindings failed to load a library because it found no file of it anywhere it
    looks (cuda-pathfinder's DynamicLibNotFoundError), rather than finding one that did not load
    (a RuntimeError naming the file) or being asked for a name it does not know."""
    try:
        from cuda.pathfinder import DynamicLibNotFoundError, DynamicLibUnknownError
    except ImportError:  # cuda-bindings before 12.9 searched by itself: cannot tell, so FAILED
        return False
    return isinstance(cause, DynamicLibNotFoundError) and not isinstance(cause, DynamicLibUnknownError)


def _nccl() -> str:
    from lowgrad.cuda import nccl

    try:
        nccl.lib()
    except nccl.NcclLibraryError:
        if nccl.library_absent():
            return Absent(f"not installed (no libnccl in the nvidia-nccl-cu12/-cu13 wheels nor on the loader "
                          f"path; {nccl.LIBRARY_ENV} unset): {_GET_GPU_STACK}")
        raise  # a library that is there but does not load, or lacks symbols: FAILED
    return f"NCCL {'.'.join(map(str, nccl.version()))} from {nccl.library_path()}"


def _gpus() -> str:
    from lowgrad.cuda.device import Device, device_count

    rows = []
    for i in range(device_count()):
        d = Device(i)
        rows.append(f"#{i} {d.name} {d.arch} {d.sm_count} SMs {d.total_memory / 2**30:.1f} GiB "
                    f"L2 {d.l2_bytes / 2**20:.0f} MiB bus {d.pci_bus_id}")
    return "; ".join(rows)


def _links() -> str:
    from lowgrad.cuda import driver as _cuda
    from lowgrad.cuda.device import Device, device_count

    n = device_count()
    if n < 2:
        return "one GPU: no peer links to check"
    drv = _cuda.driver()
    rows = []
    for i in range(n):
        row = []
        for j in range(n):
            ok = i == j or bool(_cuda.check("cuDeviceCanAccessPeer",
                                            drv.cuDeviceCanAccessPeer(Device(i)._dev, Device(j)._dev)))
            row.append("x" if i == j else ("P2P" if ok else "-"))
        rows.append(f"#{i}: " + " ".join(row))
    return "; ".join(rows)


def _pinned_bandwidth() -> str:
    from lowgrad.cli.bandwidth import copy_bandwidths
    from lowgrad.cuda.device import Device

    bw = copy_bandwidths(Device(0), 1 << 28, reps=3)
    return f"H2D {bw['h2d'] / 1e9:.1f} GB/s, D2H {bw['d2h'] / 1e9:.1f} GB/s (pinned, 128 MiB copies)"


def _kernel_smoke() -> str:
    import numpy as np

    from lowgrad import ops
    from lowgrad.base.dtypes import bf16
    from lowgrad.buffers.tensor import from_numpy
    from lowgrad.cuda.device import Device

    d = Device(0)
    x = np.linspace(-3, 3, 1000, dtype=np.float32)
    a, b = from_numpy(x, d, name="doctor"), from_numpy(x, d, name="doctor")
    out = d.alloc(1000, bf16, name="doctor")
    ops.add_sr(out, a, b, 0.5, seed=1)
    d.synchronize()
    got = out.numpy().astype(np.float32)
    if np.max(np.abs(got - x)) > 0.05:
        raise RuntimeError("add_sr result is wrong")
    return f"add_sr compiled for {d.arch}, launched and checked"


def _nccl_world1() -> str:
    import numpy as np

    from lowgrad.buffers.tensor import from_numpy
    from lowgrad.launch.bootstrap import run_threads

    def job(comm: object) -> float:
        t = from_numpy(np.full(8, 3.0, np.float32), comm.device, name="doctor")  # type: ignore[attr-defined]
        comm.all_reduce(t, op="sum")  # type: ignore[attr-defined]
        comm.device.synchronize()  # type: ignore[attr-defined]
        return float(t.numpy()[0])

    (v,) = run_threads(1, job, backend="cuda")
    if v != 3.0:
        raise RuntimeError(f"all-reduce at world 1 gave {v}")
    return "all-reduce at world 1 through NCCL"


def _graph() -> str:
    import numpy as np

    from lowgrad import ops
    from lowgrad.buffers.tensor import from_numpy
    from lowgrad.cuda.device import Device
    from lowgrad.cuda.graph import Graph

    d = Device(0)
    x, one = from_numpy(np.zeros(256, np.float32), d, name="doctor"), from_numpy(np.ones(256, np.float32), d,
                                                                                  name="doctor")
    s = d.stream()
    g = Graph(d)
    with g.capture(s):
        ops.add_sr(x, x, one, 1.0, stream=s)
    for _ in range(3):
        g.replay(s)
    s.synchronize()
    if not np.all(x.numpy() == 3.0):
        raise RuntimeError("a replayed add_sr gave the wrong result")
    g.close()
    return f"captured a kernel in a CUDA graph ({g.kernel_nodes} kernel node), replayed 3 times, checked"


def run(args: argparse.Namespace) -> int:
    """Print every line (or the JSON document); 1 when any FAILED, else 0."""
    doc = _Doctor(args.json)
    for name, fn in (("lowgrad", _lowgrad), ("packages", _packages), ("cuda-bindings", _bindings),
                     ("NVRTC", _nvrtc), ("kernel cache", _cache), ("NCCL library", _nccl)):
        doc.check(name, fn)
    if doc.check("CUDA driver", _driver):
        for name, fn in (("GPUs", _gpus), ("GPU links", _links), ("pinned bandwidth", _pinned_bandwidth),
                         ("kernel", _kernel_smoke), ("NCCL world 1", _nccl_world1), ("CUDA graph", _graph)):
            doc.check(name, fn)
    else:
        doc.note("no usable NVIDIA driver/GPU: the host backend (lowgrad.HostDevice) still works")
    doc.finish()
    return 1 if doc.failed else 0
