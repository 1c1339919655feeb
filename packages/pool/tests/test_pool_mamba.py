"""MambaPool and MambaSpec: state round trips per dtype, copy-on-write, clear, errors."""

from __future__ import annotations

import pytest
import torch

from kvstrata.pool import (
    BufferMismatch,
    DuplicateIndex,
    IndexOutOfRange,
    InvalidArgument,
    InvalidSpec,
    LayerOutOfRange,
    MambaPool,
    MambaSpec,
    ReservedIndex,
)
from kvstrata.testkit.pools import (
    POOL_DTYPES,
    fill_random_bytes,
    make_mamba_pool,
    raw_bytes,
)


def _slot_bytes(pool: MambaPool, slot: int) -> torch.Tensor:
    return torch.cat([raw_bytes(b[slot]).reshape(-1) for b in pool.layer_buffers()])


def test_spec() -> None:
    spec = MambaSpec(
        num_layers=3, conv_dim=8, conv_kernel=4, num_heads=2, head_dim=4, state_size=16
    )
    assert spec.conv_shape == (8, 3) and spec.ssm_shape == (2, 4, 16)
    assert spec.conv_bytes_per_slot == 8 * 3 * 2
    assert spec.ssm_bytes_per_slot == 2 * 4 * 16 * 4
    assert spec.bytes_per_token == 3 * (48 + 512)
    with pytest.raises(InvalidSpec):
        MambaSpec(num_layers=1, conv_dim=8, conv_kernel=1, num_heads=1, head_dim=1, state_size=1)


def test_geometry() -> None:
    pool = make_mamba_pool(num_layers=2, size=8)
    assert (pool.num_rows, pool.page_size, pool.num_pages) == (9, 1, 9)
    assert tuple(pool.conv_state.shape) == (2, 9, 6, 3)
    assert tuple(pool.ssm_state.shape) == (2, 9, 2, 3, 4)
    assert pool.dtype == torch.float32 and pool.conv_dtype == torch.bfloat16
    buffers = pool.layer_buffers()
    assert [b.dtype for b in buffers] == [torch.bfloat16, torch.float32] * 2
    assert buffers[3].data_ptr() == pool.ssm_state[1].data_ptr()
    assert pool.size_bytes == pool.num_rows * pool.bytes_per_token
    pool.check_integrity()


@pytest.mark.parametrize("dtype", POOL_DTYPES)
def test_set_state_reads_back_bit_identical(dtype: torch.dtype, device: str) -> None:
    pool = make_mamba_pool(conv_dtype=dtype, ssm_dtype=dtype, device=device)
    gen = torch.Generator().manual_seed(6)
    slots = torch.tensor([2, 8], device=device)
    conv = torch.randn(2, 6, 3, generator=gen).to(dtype).to(device)
    ssm = torch.randn(2, 2, 3, 4, generator=gen).to(dtype).to(device)
    pool.set_state(1, slots, conv=conv, ssm=ssm)
    assert pool.conv_state.dtype == dtype and pool.ssm_state.dtype == dtype
    assert torch.equal(raw_bytes(pool.conv_state[1, slots]), raw_bytes(conv))
    assert torch.equal(raw_bytes(pool.ssm_state[1, slots]), raw_bytes(ssm))
    assert not raw_bytes(pool.conv_state[0]).any(), "layer 0 was written"


def test_set_state_casts_and_validates() -> None:
    pool = make_mamba_pool()
    conv = torch.randn(1, 6, 3)
    pool.set_state(0, torch.tensor([3]), conv=conv)
    assert torch.equal(pool.conv_state[0, 3], conv[0].to(torch.bfloat16))
    before = [b.clone() for b in pool.layer_buffers()]
    with pytest.raises(BufferMismatch):
        pool.set_state(0, torch.tensor([3]), conv=conv, ssm=torch.ones(1, 2, 3, 5))
    with pytest.raises(LayerOutOfRange):
        pool.set_state(2, torch.tensor([3]), conv=conv)
    with pytest.raises(ReservedIndex):
        pool.set_state(0, torch.tensor([0]), conv=conv)
    assert all(torch.equal(a, b) for a, b in zip(pool.layer_buffers(), before, strict=True))


def test_copy_on_write_independence(device: str) -> None:
    pool = make_mamba_pool(device=device)
    fill_random_bytes(pool, seed=9)
    src, dst = torch.tensor([1, 2]), torch.tensor([5, 6])
    originals = [_slot_bytes(pool, s) for s in (1, 2)]
    pool.copy(src, dst)
    assert torch.equal(_slot_bytes(pool, 5), originals[0])
    assert torch.equal(_slot_bytes(pool, 6), originals[1])

    # Mutating the copies leaves the sources alone, and the other way round.
    pool.set_state(0, dst, conv=torch.ones(2, 6, 3, device=device))
    pool.set_state(1, dst, ssm=torch.full((2, 2, 3, 4), 7.0, device=device))
    assert torch.equal(_slot_bytes(pool, 1), originals[0])
    assert torch.equal(_slot_bytes(pool, 2), originals[1])
    copied = _slot_bytes(pool, 5)
    pool.clear(torch.tensor([1]))
    assert torch.equal(_slot_bytes(pool, 5), copied)


def test_copy_forks_and_overlaps() -> None:
    pool = make_mamba_pool()
    fill_random_bytes(pool, seed=10)
    old = {s: _slot_bytes(pool, s) for s in range(1, 9)}
    pool.copy(torch.tensor([3, 3, 3]), torch.tensor([6, 7, 8]))  # one state forked three times
    assert all(torch.equal(_slot_bytes(pool, s), old[3]) for s in (6, 7, 8))
    pool.copy(torch.tensor([1, 2]), torch.tensor([2, 3]))  # overlapping: sources read first
    assert torch.equal(_slot_bytes(pool, 2), old[1])
    assert torch.equal(_slot_bytes(pool, 3), old[2])


def test_copy_and_clear_errors_change_nothing() -> None:
    pool = make_mamba_pool()
    fill_random_bytes(pool, seed=12)
    before = [raw_bytes(b) for b in pool.layer_buffers()]
    bad = [
        (torch.tensor([1, 2]), torch.tensor([3]), InvalidArgument),
        (torch.tensor([1, 2]), torch.tensor([3, 3]), DuplicateIndex),
        (torch.tensor([0]), torch.tensor([3]), ReservedIndex),
        (torch.tensor([1]), torch.tensor([0]), ReservedIndex),
        (torch.tensor([1]), torch.tensor([9]), IndexOutOfRange),
        (torch.tensor([1.0]), torch.tensor([2]), InvalidArgument),
    ]
    for src, dst, error in bad:
        with pytest.raises(error):
            pool.copy(src, dst)
    with pytest.raises(ReservedIndex):
        pool.clear(torch.tensor([2, 0]))
    with pytest.raises(IndexOutOfRange):
        pool.clear(torch.tensor([9]))
    after = [raw_bytes(b) for b in pool.layer_buffers()]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))


def test_clear_zeroes_only_its_slots() -> None:
    pool = make_mamba_pool()
    fill_random_bytes(pool, seed=13)
    keep = _slot_bytes(pool, 5)
    pool.clear(torch.tensor([4, 6, 4]))
    assert not _slot_bytes(pool, 4).any() and not _slot_bytes(pool, 6).any()
    assert torch.equal(_slot_bytes(pool, 5), keep)
    pool.clear(torch.empty(0, dtype=torch.int64))
