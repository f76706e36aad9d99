"""``python -m lowgrad doctor``: what a user runs first on a broken setup. Each line is
``ok`` or ``FAILED`` with the reason."""
from __future__ import annotations

import importlib.metadata as md
import os
import platform
import sys
from collections.abc import Callable


def _line(status: str, what: str, detail: str) -> None:
    print(f"[{status:>6}] {what:<22} {detail}")


def _check(what: str, fn: Callable[[], str]) -> bool:
    try:
        _line("ok", what, fn())
        return True
    except Exception as exc:  # the doctor reports every failure and carries on
        _line("FAILED", what, f"{type(exc).__name__}: {exc}")
        return False


def _packages() -> str:
    names = ["numpy", "ml_dtypes", "cuda-bindings", "cuda-python", "nvidia-cuda-nvrtc-cu12", "nvidia-cuda-nvrtc",
             "nvidia-nccl-cu12", "nvidia-nccl-cu13"]
    found = []
    for n in names:
        try:
            found.append(f"{n} {md.version(n)}")
        except md.PackageNotFoundError:
            pass
    return ", ".join(found)


def _driver() -> str:
    from . import _cuda

    drv = _cuda.driver()
    v = _cuda.check("cuDriverGetVersion", drv.cuDriverGetVersion())
    return f"CUDA driver API {v // 1000}.{v % 1000 // 10}"


def _nvrtc() -> str:
    from . import compiler

    major, minor = compiler.nvrtc_version()
    return f"NVRTC {major}.{minor}; kernels from {compiler.kernel_dir()}; cache {compiler.cache_dir()}"


def _nccl() -> str:
    from . import nccl

    return f"NCCL {'.'.join(map(str, nccl.version()))} from {nccl.library_path()}"


def _gpus() -> str:
    from .device import Device, device_count

    rows = []
    for i in range(device_count()):
        d = Device(i)
        rows.append(f"#{i} {d.name} {d.arch} {d.sm_count} SMs {d.total_memory / 2**30:.1f} GiB "
                    f"L2 {d.l2_bytes / 2**20:.0f} MiB bus {d.pci_bus_id}")
    return "; ".join(rows)


def _kernel_smoke() -> str:
    import numpy as np

    from . import ops
    from .device import Device
    from .dtypes import bf16
    from .tensor import from_numpy

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

    from .bootstrap import run_threads
    from .tensor import from_numpy

    def job(comm: object) -> float:
        t = from_numpy(np.full(8, 3.0, np.float32), comm.device, name="doctor")  # type: ignore[attr-defined]
        comm.all_reduce(t, op="sum")  # type: ignore[attr-defined]
        comm.device.synchronize()  # type: ignore[attr-defined]
        return float(t.numpy()[0])

    (v,) = run_threads(1, job, backend="cuda")
    if v != 3.0:
        raise RuntimeError(f"all-reduce at world 1 gave {v}")
    return "all-reduce at world 1 through NCCL"


def run() -> int:
    print(f"lowgrad doctor — Python {sys.version.split()[0]} on {platform.platform()}")
    _check("packages", _packages)
    _check("NVRTC", _nvrtc)
    _check("NCCL library", _nccl)
    if not _check("CUDA driver", _driver):
        print("no usable NVIDIA driver/GPU: the host backend (lowgrad.HostDevice) still works")
        return 0
    _check("GPUs", _gpus)
    _check("kernel", _kernel_smoke)
    _check("NCCL world 1", _nccl_world1)
    cache = os.environ.get("LOWGRAD_CACHE_DIR")
    if cache:
        _line("info", "LOWGRAD_CACHE_DIR", cache)
    return 0
