"""CPU tests of lowgrad.base.errors and the CUDA-unavailable path."""
from __future__ import annotations

import subprocess
import sys

import pytest

import lowgrad as lg
import lowgrad.cuda.driver


def test_import_without_driver_and_clear_unavailable_error() -> None:
    code = "import lowgrad; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"
    if lg.cuda.driver.unavailable_reason() is not None:
        with pytest.raises(lg.CudaUnavailableError, match="CUDA unavailable"):
            lg.Device(0)


def test_error_messages_name_call_code_and_message() -> None:
    e = lg.CudaError("cuMemAlloc", 2, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory")
    assert "cuMemAlloc" in str(e) and "CUDA_ERROR_OUT_OF_MEMORY" in str(e) and "out of memory" in str(e)
    n = lg.NcclError("ncclAllReduce", 4, "ncclInvalidArgument", "invalid argument", "count is 0")
    assert "ncclAllReduce" in str(n) and "count is 0" in str(n)
    assert issubclass(lg.CudaUnavailableError, lg.LowgradError)
