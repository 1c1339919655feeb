"""Factories for `kvstrata.allocator` in tests: every family, on every backend.

`BACKENDS` lists the array backends that run on this machine (both run on CPU; tests marked
`cuda` use the torch backend on a GPU). Indices in tests are built with `idx(...)`.
"""

from __future__ import annotations

from collections.abc import Iterable

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


def make_paged(
    *,
    page_size: int = 4,
    num_pages: int = 16,
    backend: Backend = "numpy",
    checked: bool = True,
    sorted_reuse: bool = False,
    device: str = "cpu",
) -> PagedAllocator:
    """A paged allocator of `num_pages` usable pages."""
    return PagedAllocator(
        size=num_pages * page_size,
        page_size=page_size,
        device=device,
        sorted_reuse=sorted_reuse,
        checked=checked,
        backend=backend,
    )


def make_token(
    *,
    size: int = 32,
    backend: Backend = "numpy",
    checked: bool = True,
    sorted_reuse: bool = False,
    device: str = "cpu",
) -> TokenAllocator:
    return TokenAllocator(
        size=size, device=device, sorted_reuse=sorted_reuse, checked=checked, backend=backend
    )


def make_swa(
    *,
    page_size: int = 4,
    num_pages: int = 16,
    num_swa_pages: int = 8,
    backend: Backend = "numpy",
    checked: bool = True,
    device: str = "cpu",
) -> SWAAllocator:
    return SWAAllocator(
        size=num_pages * page_size,
        swa_size=num_swa_pages * page_size,
        page_size=page_size,
        device=device,
        checked=checked,
        backend=backend,
    )


def make_mamba(
    *, size: int = 8, backend: Backend = "numpy", checked: bool = True, device: str = "cpu"
) -> MambaSlotAllocator:
    return MambaSlotAllocator(size=size, device=device, checked=checked, backend=backend)
