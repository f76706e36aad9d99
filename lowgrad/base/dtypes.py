"""Element types: fp32, bf16, fp16, fp8 e4m3 and byte, with their numpy, NCCL and DLPack codes."""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

# ncclDataType_t values (nccl.h)
_NCCL_UINT8, _NCCL_FLOAT16, _NCCL_FLOAT32, _NCCL_FLOAT64, _NCCL_BFLOAT16, _NCCL_FP8_E4M3 = 1, 6, 7, 8, 9, 10
# DLPack DLDataTypeCode values
_DL_UINT, _DL_FLOAT, _DL_BFLOAT, _DL_FP8_E4M3FN = 1, 2, 4, 10


@dataclass(frozen=True, eq=False)
class DType:
    """An element type. ``itemsize`` in bytes; ``np`` is the numpy dtype used for host views."""

    name: str
    itemsize: int
    np: np.dtype
    nccl: int
    dlpack_code: int
    typestr: str  # __cuda_array_interface__ typestr ("|V2" for types numpy's protocol lacks)

    def __repr__(self) -> str:
        return f"lowgrad.{self.name}"

    def __reduce__(self) -> str:
        return self.name


fp32 = DType("fp32", 4, np.dtype(np.float32), _NCCL_FLOAT32, _DL_FLOAT, "<f4")
bf16 = DType("bf16", 2, np.dtype(ml_dtypes.bfloat16), _NCCL_BFLOAT16, _DL_BFLOAT, "<V2")
fp16 = DType("fp16", 2, np.dtype(np.float16), _NCCL_FLOAT16, _DL_FLOAT, "<f2")
fp8_e4m3 = DType("fp8_e4m3", 1, np.dtype(ml_dtypes.float8_e4m3fn), _NCCL_FP8_E4M3, _DL_FP8_E4M3FN, "|V1")
byte = DType("byte", 1, np.dtype(np.uint8), _NCCL_UINT8, _DL_UINT, "|u1")
fp64 = DType("fp64", 8, np.dtype(np.float64), _NCCL_FLOAT64, _DL_FLOAT, "<f8")  # norm scalars

ALL: tuple[DType, ...] = (fp32, bf16, fp16, fp8_e4m3, byte, fp64)
_BY_NAME = {d.name: d for d in ALL}
_BY_NP = {d.np: d for d in ALL}


def as_dtype(x: object) -> DType:
    """Accept a DType, its name ("bf16"), or a numpy dtype; raise TypeError otherwise."""
    if isinstance(x, DType):
        return x
    if isinstance(x, str) and x in _BY_NAME:
        return _BY_NAME[x]
    npd = None
    if x is not None:  # np.dtype(None) would be float64
        try:
            npd = np.dtype(x)  # type: ignore[call-overload]
        except (TypeError, ValueError, SyntaxError):  # numpy's parser raises any of these
            pass
    if npd is not None and npd in _BY_NP:
        return _BY_NP[npd]
    raise TypeError(f"unsupported dtype {x!r}; expected one of {', '.join(_BY_NAME)}")
