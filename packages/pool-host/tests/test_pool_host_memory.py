"""Host tensor allocators and the host-capacity check."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvstrata.pool_host import (
    PinnedHostAllocator,
    PlainHostAllocator,
    SharedHostAllocator,
    attach_shared,
    host_memory,
)
from kvstrata.pool_host.errors import (
    InsufficientHostMemory,
    PinnedMemoryUnavailable,
    SharedMemoryError,
)


def test_host_memory_reports_plausible_figures() -> None:
    mem = host_memory()
    assert 0 < mem.available_bytes <= mem.total_bytes


def test_plain_region_is_flat_bytes() -> None:
    region = PlainHostAllocator().allocate(4096)
    assert region.tensor.dtype == torch.uint8
    assert region.num_bytes == 4096
    assert region.shared_name is None
    assert not region.pinned


@pytest.mark.parametrize(
    "allocator", [PlainHostAllocator(), SharedHostAllocator()], ids=["plain", "shared"]
)
def test_oversized_region_is_refused_before_allocating(
    allocator: PlainHostAllocator | SharedHostAllocator,
) -> None:
    with pytest.raises(InsufficientHostMemory, match="GiB"):
        allocator.allocate(4 * host_memory().total_bytes)


def test_pinned_allocator_needs_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the refusal path cannot be exercised")
    with pytest.raises(PinnedMemoryUnavailable):
        PinnedHostAllocator()
    with pytest.raises(PinnedMemoryUnavailable):
        SharedHostAllocator(pin=True)


@pytest.mark.cuda
def test_pinned_region_is_page_locked() -> None:
    region = PinnedHostAllocator().allocate(1 << 20)
    assert region.tensor.is_pinned()


@pytest.mark.cuda
def test_pinned_shared_region_is_registered_and_released() -> None:
    region = SharedHostAllocator(pin=True).allocate(1 << 20)
    assert region.tensor.is_pinned()
    region.close()


def test_shared_region_lives_under_its_name_until_closed(tmp_path: Path) -> None:
    allocator = SharedHostAllocator(directory=tmp_path, prefix="t")
    region = allocator.allocate(8192)
    assert region.shared_name is not None
    path = tmp_path / region.shared_name
    assert path.stat().st_size == 8192
    region.tensor[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    mapped = attach_shared(region.shared_name, directory=tmp_path)
    assert mapped[:4].tolist() == [1, 2, 3, 4]
    mapped[4] = 9  # the same pages: a write through one mapping shows in the other
    assert int(region.tensor[4]) == 9
    region.close()
    assert not path.exists()
    region.close()  # idempotent
    assert int(mapped[4]) == 9  # existing mappings outlive the name


def test_shared_region_is_unlinked_when_garbage_collected(tmp_path: Path) -> None:
    region = SharedHostAllocator(directory=tmp_path).allocate(4096)
    assert region.shared_name is not None
    path = tmp_path / region.shared_name
    del region
    assert not path.exists()


def test_attach_unknown_or_bad_name_fails_clearly(tmp_path: Path) -> None:
    with pytest.raises(SharedMemoryError, match="no shared region"):
        attach_shared("missing", directory=tmp_path)
    with pytest.raises(SharedMemoryError):
        attach_shared("../etc", directory=tmp_path)
    with pytest.raises(SharedMemoryError):
        SharedHostAllocator(directory=tmp_path / "absent")
