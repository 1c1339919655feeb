"""Factories for `kvstrata.allocator` in tests: every family, on every backend.

`BACKENDS` lists the array backends that run on this machine (both run on CPU; tests marked
`cuda` use the torch backend on a GPU). Indices in tests are built with `idx(...)`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypedDict, Unpack

import torch

from kvstrata.allocator import (
    MambaSlotAllocator,
    PagedAllocator,
    SWAAllocator,
    TokenAllocator,
)
from kvstrata.allocator.engine import Backend

__all__ = [
    "BACKENDS",
    "AllocatorOptions",
    "idx",
    "make_mamba",
    "make_paged",
    "make_swa",
    "make_token",
    "pages_of",
]

BACKENDS: tuple[Backend, ...] = ("numpy", "torch")


def idx(values: Iterable[int], device: str | torch.device = "cpu") -> torch.Tensor:
    """An int64 index tensor."""
    return torch.tensor(list(values), dtype=torch.int64, device=device)


def pages_of(indices: torch.Tensor, page_size: int) -> set[int]:
    """The distinct pages that token slots lie in."""
    return set((indices.cpu() // page_size).tolist())


class AllocatorOptions(TypedDict, total=False):
    """What every allocator takes besides its sizes, declared once for the factories below:
    the allocators' own defaults, except the numpy backend when `backend` is not given."""

    backend: Backend
    checked: bool
    device: str


def _with_defaults(options: AllocatorOptions) -> AllocatorOptions:
    return {"backend": "numpy", **options}


def make_paged(
    *,
    page_size: int = 4,
    num_pages: int = 16,
    sorted_reuse: bool = False,
    **options: Unpack[AllocatorOptions],
) -> PagedAllocator:
    """A paged allocator of `num_pages` usable pages."""
    return PagedAllocator(
        size=num_pages * page_size,
        page_size=page_size,
        sorted_reuse=sorted_reuse,
        **_with_defaults(options),
    )


def make_token(
    *, size: int = 32, sorted_reuse: bool = False, **options: Unpack[AllocatorOptions]
) -> TokenAllocator:
    return TokenAllocator(size=size, sorted_reuse=sorted_reuse, **_with_defaults(options))


def make_swa(
    *,
    page_size: int = 4,
    num_pages: int = 16,
    num_swa_pages: int = 8,
    **options: Unpack[AllocatorOptions],
) -> SWAAllocator:
    return SWAAllocator(
        size=num_pages * page_size,
        swa_size=num_swa_pages * page_size,
        page_size=page_size,
        **_with_defaults(options),
    )


def make_mamba(*, size: int = 8, **options: Unpack[AllocatorOptions]) -> MambaSlotAllocator:
    return MambaSlotAllocator(size=size, **_with_defaults(options))
