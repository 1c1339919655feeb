"""Page plans: index validation, run detection, and every copy path against a reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstrata.pool_host import transfer
from kvstrata.pool_host.errors import IndexLengthMismatch, MisalignedIndex
from kvstrata.pool_host.slots import pages_to_tokens
from kvstrata.pool_host.transfer import (
    CopyStrategy,
    aligned_pages,
    choose_strategy,
    copy_rows,
    find_runs,
    indices_to_pages,
    make_plan,
    pages_to_token_array,
    widen,
)


def test_runs_of_the_module_doc_example() -> None:
    src = np.array([7, 8, 9, 3, 12, 13])
    dst = np.array([40, 41, 42, 43, 44, 45])
    runs = find_runs(src, dst)
    assert runs.src_starts == [7, 3, 12]
    assert runs.dst_starts == [40, 43, 44]
    assert runs.lengths == [3, 1, 2]
    plan = make_plan(src, dst)
    assert plan.dst_runs.lengths == [6]  # the destination alone is one run
    assert plan.src_runs.lengths == [3, 1, 2]
    assert plan.src_runs.dst_starts == [0, 3, 4]  # positions into the pair arrays


def test_indices_to_pages() -> None:
    pages = indices_to_pages(torch.tensor([8, 9, 10, 11, 0, 1, 2, 3]), 4, side="host")
    assert pages.tolist() == [2, 0]
    assert indices_to_pages(torch.tensor([5, 3], dtype=torch.int32), 1, side="host").tolist() == [
        5,
        3,
    ]
    with pytest.raises(MisalignedIndex, match="aligned"):
        indices_to_pages(torch.tensor([2, 3, 4, 5]), 4, side="device")
    with pytest.raises(MisalignedIndex):
        indices_to_pages(torch.tensor([True, False]), 1, side="device")
    with pytest.raises(IndexLengthMismatch):
        indices_to_pages(torch.tensor([0, 1, 2]), 4, side="device")
    with pytest.raises(IndexLengthMismatch):
        make_plan(np.array([1, 2]), np.array([1]))


def test_strategy_follows_mean_run_bytes() -> None:
    contiguous = make_plan(np.arange(1, 9), np.arange(8))
    scattered = make_plan(np.array([5, 1, 7, 3]), np.array([0, 1, 2, 3]))
    row = transfer.CPU_RUN_MIN_BYTES // 4  # 8 contiguous pages average 2x the threshold
    assert choose_strategy(contiguous, row, cuda=False) is CopyStrategy.runs
    assert choose_strategy(scattered, row, cuda=False) is CopyStrategy.gather
    assert choose_strategy(contiguous, transfer.CUDA_RUN_MIN_BYTES // 16, cuda=True) is (
        CopyStrategy.gather
    )
    assert choose_strategy(make_plan(np.array([]), np.array([])), 1, cuda=False) is (
        CopyStrategy.empty
    )


def test_widen_picks_the_widest_view_the_strides_allow() -> None:
    arena = torch.zeros((4, 48), dtype=torch.uint8)
    assert widen(arena[:, 8:24]).dtype == torch.int64
    assert widen(arena[:, 4:12]).dtype == torch.int32
    assert widen(arena[:, 2:4]).dtype == torch.int16
    assert widen(arena[:, 1:4]).dtype == torch.uint8


PLANS = {
    "joint runs": (np.array([1, 2, 3, 7, 8]), np.array([4, 5, 6, 0, 1])),
    "dst runs": (np.array([9, 2, 6, 4]), np.array([2, 3, 4, 5])),
    "src runs": (np.array([2, 3, 4, 5]), np.array([9, 0, 6, 3])),
    "scattered": (np.array([9, 2, 6, 4]), np.array([3, 8, 0, 5])),
}


# 50 bytes sits between one 24-byte row and the 96-byte one-sided runs: it sends "dst runs"
# and "src runs" down the one-pass gather paths.
EXPECTED_COPIES = {"joint runs": 2, "dst runs": 1, "src runs": 1, "scattered": 2}


@pytest.mark.parametrize(
    "threshold", [1, 50, 1 << 40], ids=["runs-favoured", "side-runs", "gather-favoured"]
)
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous-dst", "strided-dst"])
@pytest.mark.parametrize("name", list(PLANS))
def test_every_cpu_copy_path_matches_the_reference(
    name: str, strided: bool, threshold: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(transfer, "CPU_RUN_MIN_BYTES", threshold)
    src_pages, dst_pages = PLANS[name]
    gen = torch.Generator().manual_seed(0)
    src = torch.randint(0, 256, (10, 24), dtype=torch.uint8, generator=gen)
    arena = torch.zeros((10, 72), dtype=torch.uint8)
    dst = arena[:, 24:48] if strided else torch.zeros((10, 24), dtype=torch.uint8)
    expected = dst.clone()
    expected[torch.from_numpy(dst_pages)] = src[torch.from_numpy(src_pages)]
    plan = make_plan(src_pages, dst_pages)
    strategy = choose_strategy(plan, 24, cuda=False)
    copies = copy_rows(src, dst, plan, strategy, index_cache={})
    assert torch.equal(dst, expected)
    if threshold == 50:
        assert copies == EXPECTED_COPIES[name]
    else:
        assert copies == (len(plan.runs.lengths) if threshold == 1 else 2)
    if strided:
        assert not arena[:, :24].any() and not arena[:, 48:].any(), "wrote outside its rows"


def test_aligned_pages_accepts_only_whole_pages_in_order() -> None:
    pages = np.array([3, 0, 7])
    flat = pages_to_token_array(pages, 4)
    assert flat.tolist() == [12, 13, 14, 15, 0, 1, 2, 3, 28, 29, 30, 31]
    got = aligned_pages(flat, 4)
    assert got is not None and got.tolist() == [3, 0, 7]
    assert aligned_pages(np.array([5, 2]), 1) is not None  # any index is a page of one
    for bad in ([1, 2, 3, 4], [0, 1, 3, 2], [4, 5, 6, 7, 0, 1, 2, 4], [0, 0, 0, 0]):
        assert aligned_pages(np.array(bad), 4) is None, bad
    assert aligned_pages(np.empty(0, dtype=np.int64), 4) is not None


def test_runs_are_found_only_when_asked_and_match_the_eager_definition() -> None:
    plan = make_plan(np.array([7, 8, 9, 3]), np.array([40, 41, 42, 43]))
    # A gather below the threshold never needs the runs.
    assert choose_strategy(plan, 16, cuda=False) is CopyStrategy.gather
    assert plan._runs is None and plan._src_runs is None and plan._dst_runs is None
    assert plan.runs == find_runs(plan.src_pages, plan.dst_pages)
    assert plan.src_runs.lengths == [3, 1] and plan.dst_runs.lengths == [4]


def test_pages_to_tokens_takes_any_integer_dtype() -> None:
    expected = [8, 9, 10, 11, 0, 1, 2, 3]
    for dtype in (torch.int64, torch.int32, torch.int16):
        assert pages_to_tokens(torch.tensor([2, 0], dtype=dtype), 4).tolist() == expected
