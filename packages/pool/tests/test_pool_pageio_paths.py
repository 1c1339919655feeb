"""The CPU page I/O fallback paths (no compiled copies: `native.disabled()` around every test
here; the compiled path is tested in test_pool_native.py): the one-piece path (numpy take /
put over whole pieces), the stacked-view path it falls back to, and stacks on huge pages. Each
path must move the same bytes: round trips bit-identical for every family and dtype, against
the flat-format reference and against the other path."""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Iterator

import pytest
import torch

from kvstrata.pool import native, page_io
from kvstrata.pool.base import DevicePool
from kvstrata.testkit.pools import (
    PAGE_IO_LAYOUTS,
    POOL_DTYPES,
    check_page_round_trip,
    fill_random_bytes,
    flat_pages,
    make_page_io_pool,
    page_io_cases,
)

LAYOUTS = ["mha", "mha-two-stacks", "mla", "mamba"]
CASES = page_io_cases(LAYOUTS)


@pytest.fixture(autouse=True)
def numpy_paths() -> Iterator[None]:
    """Every pool made in these tests uses the NumPy / torch copies."""
    with native.disabled():
        yield


@pytest.fixture
def every_read_one_piece(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reads take the one-piece path whatever the piece size (the pools here are tiny)."""
    monkeypatch.setattr(page_io, "ONE_PIECE_READ_MIN_BYTES", 1)


def _pool(family: str, dtype: torch.dtype, page_size: int) -> DevicePool:
    pool = make_page_io_pool(family, dtype, page_size)
    fill_random_bytes(pool, seed=11)
    return pool


def _layout(pool: DevicePool) -> page_io.PageLayout:
    layout = pool._layout
    assert layout is not None
    return layout


@pytest.mark.usefixtures("every_read_one_piece")
@pytest.mark.parametrize("dtype", POOL_DTYPES)
@pytest.mark.parametrize(("family", "page_size"), CASES)
def test_one_piece_round_trip_is_bit_identical(
    family: str, page_size: int, dtype: torch.dtype
) -> None:
    pool = _pool(family, dtype, page_size)
    layout = _layout(pool)
    assert (layout._pieces is not None) == PAGE_IO_LAYOUTS[family].one_stack
    gen = torch.Generator().manual_seed(5)
    check_page_round_trip(pool, torch.randperm(pool.num_pages - 1, generator=gen)[:6] + 1, seed=5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("family", ["mha", "mla"])
def test_both_paths_move_the_same_bytes(family: str, dtype: torch.dtype) -> None:
    """The one-piece path (reads included) against the stacked-view path, on twin pools
    holding the same bytes."""
    fast, slow = _pool(family, dtype, 2), _pool(family, dtype, 2)
    pieces = _layout(fast)._pieces
    assert pieces is not None
    _layout(fast)._pieces = dataclasses.replace(pieces, read=True)
    _layout(slow)._pieces = None
    ids = torch.tensor([9, 3, 14, 1, 3])
    a = torch.empty((5, fast.page_size_bytes), dtype=torch.uint8)
    b = torch.empty_like(a)
    fast.read_pages(ids, a)
    slow.read_pages(ids, b)
    assert torch.equal(a, b)
    src = torch.randint(0, 256, (3, fast.page_size_bytes), dtype=torch.uint8)
    targets = torch.tensor([2, 16, 7])
    fast.write_pages(targets, src)
    slow.write_pages(targets, src)
    everything = range(fast.num_pages)
    assert torch.equal(flat_pages(fast, everything), flat_pages(slow, everything))


@pytest.mark.usefixtures("every_read_one_piece")
def test_strided_rows_fall_back_to_the_stacked_view() -> None:
    """A caller buffer whose rows are not back to back cannot be seen as one run of pieces."""
    pool = _pool("mla", torch.bfloat16, 4)
    wide = torch.zeros((3, pool.page_size_bytes + 16), dtype=torch.uint8)
    view = wide[:, 8 : 8 + pool.page_size_bytes]
    assert not view.is_contiguous()
    pool.read_pages(torch.tensor([1, 4, 6]), view)
    assert torch.equal(view, flat_pages(pool, [1, 4, 6]))
    assert not wide[:, :8].any() and not wide[:, -8:].any(), "bytes outside the rows changed"
    view.random_(0, 256)
    pool.write_pages(torch.tensor([7, 2, 3]), view)
    assert torch.equal(flat_pages(pool, [7, 2, 3]), view)


def test_huge_page_zeros_is_aligned_zeroed_and_outlives_its_first_view() -> None:
    region = page_io.huge_page_zeros(3 * page_io.HUGE_PAGE_BYTES + 5)
    assert region.numel() == 3 * page_io.HUGE_PAGE_BYTES + 5
    assert region.data_ptr() % page_io.HUGE_PAGE_BYTES == 0
    assert not region.any()
    tail = region[-7:]
    del region
    gc.collect()
    tail.fill_(9)  # the mapping is still there: the view holds it
    assert tail.sum().item() == 63


@pytest.mark.parametrize("family", ["mha", "mha-two-stacks", "mamba"])
def test_stacks_above_the_threshold_live_on_huge_page_memory(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the threshold lowered every stack takes the mmap path; the pool must behave the
    same: zeroed at construction, round trips bit-identical."""
    monkeypatch.setattr(page_io, "HUGE_PAGE_MIN_STACK_BYTES", 1)
    pool = make_page_io_pool(family, torch.float16, 1)
    for stack in _layout(pool).stack_tensors():
        assert stack.data_ptr() % page_io.HUGE_PAGE_BYTES == 0
    assert not flat_pages(pool, range(pool.num_pages)).any(), "a new pool reads as zeros"
    pool.check_integrity()
    src = torch.randint(0, 256, (4, pool.page_size_bytes), dtype=torch.uint8)
    ids = torch.tensor([3, 1, 12, 8])
    pool.write_pages(ids, src)
    back = torch.empty_like(src)
    pool.read_pages(ids, back)
    assert torch.equal(back, src)
    assert torch.equal(flat_pages(pool, ids.tolist()), src)
