"""Storage rules for the dtypes a pool can hold.

A pool has a *logical* dtype (what attention kernels read and `set_kv` casts to) and a *store*
dtype (what the buffers are allocated as). They are the same except for fp8: float8 tensors
are stored as uint8 and viewed back on read, because several torch index kernels
(`index_put_`, `index_copy_`, `index_select`) have no float8 implementation on every
backend, while uint8 has all of them. A view costs nothing and keeps the bytes identical.

Casting to fp8 is torch's `.to()`: values beyond the fp8 range are not clamped (e4m3fn has no
infinity and gives NaN). Pass a scale to `set_kv` to bring values into range first.
"""

from __future__ import annotations

import torch

from kvstrata.pool.errors import UnsupportedDtype

FP8_DTYPES: frozenset[torch.dtype] = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})

SUPPORTED_DTYPES: frozenset[torch.dtype] = frozenset(
    {torch.bfloat16, torch.float16, torch.float32, *FP8_DTYPES}
)


def check_dtype(dtype: torch.dtype, *, what: str = "dtype") -> torch.dtype:
    """`dtype` if a pool can hold it; UnsupportedDtype otherwise."""
    if dtype not in SUPPORTED_DTYPES:
        names = ", ".join(sorted(str(d) for d in SUPPORTED_DTYPES))
        raise UnsupportedDtype(f"{what} {dtype} is not supported; use one of {names}")
    return dtype


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def store_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype buffers of logical `dtype` are allocated as (uint8 for fp8)."""
    return torch.uint8 if is_fp8(check_dtype(dtype)) else dtype


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of logical `dtype` (equal to its store dtype's)."""
    return check_dtype(dtype).itemsize


def to_logical(buffer: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A view of store `buffer` as logical `dtype`: the same memory, no copy."""
    return buffer.view(dtype) if buffer.dtype != dtype else buffer


def to_store(values: torch.Tensor, dtype: torch.dtype, scale: float | None = None) -> torch.Tensor:
    """`values` cast to logical `dtype` (after dividing by `scale`, if given) and viewed as the
    store dtype, ready to be scattered into a buffer. Returns `values` itself when nothing
    changes; never mutates it."""
    if scale is not None:
        # float8 has no division kernel; scale fp8 input in fp32 (exact for every fp8 value).
        values = (values.float() if is_fp8(values.dtype) else values) / scale
    if values.dtype != dtype:
        values = values.to(dtype)
    return values.view(torch.uint8) if is_fp8(dtype) else values
