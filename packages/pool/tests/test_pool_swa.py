"""SWAKVPool and SWASpec: layer routing, the full-to-SWA map, translated writes."""

from __future__ import annotations

import pytest
import torch

from kvstrata.pool import (
    BufferMismatch,
    IndexOutOfRange,
    InvalidSpec,
    LayerOutOfRange,
    MHASpec,
    ReservedIndex,
    SlotMapMissing,
    SWAKVPool,
    SWASpec,
)
from kvstrata.testkit.pools import POOL_DTYPES, make_swa_pool, raw_bytes


def _page_map(pool: SWAKVPool, pairs: dict[int, int]) -> torch.Tensor:
    """A page-consistent full-to-SWA map: full page f -> SWA page pairs[f], offsets kept."""
    p = pool.page_size
    mapping = torch.zeros(pool.full_pool.num_rows, dtype=torch.int64, device=pool.device)
    for full_page, swa_page in pairs.items():
        mapping[full_page * p : (full_page + 1) * p] = torch.arange(
            swa_page * p, (swa_page + 1) * p, device=pool.device
        )
    return mapping


def test_spec() -> None:
    sub = MHASpec(num_layers=2, num_kv_heads=2, head_dim=4)
    spec = SWASpec(
        full=sub, swa=sub, full_layer_ids=(0, 3), swa_layer_ids=(1, 2), sliding_window=128
    )
    assert spec.layer_ids == (0, 1, 2, 3)
    as_lists = SWASpec(
        full=sub,
        swa=sub,
        full_layer_ids=[0, 3],  # pyright: ignore[reportArgumentType]
        swa_layer_ids=[1, 2],  # pyright: ignore[reportArgumentType]
        sliding_window=128,
    )
    assert as_lists == spec and hash(as_lists) == hash(spec), "id lists are stored as tuples"
    assert spec.bytes_per_token == 2 * sub.bytes_per_token
    bad: list[dict[str, object]] = [
        {"full_layer_ids": (0, 1), "swa_layer_ids": (1, 2)},  # overlap
        {"full_layer_ids": (0,), "swa_layer_ids": (1, 2)},  # count != num_layers
        {"full_layer_ids": (0, 0), "swa_layer_ids": (1, 2)},  # duplicate
        {"full_layer_ids": (0, -3), "swa_layer_ids": (1, 2)},  # negative
        {"sliding_window": 0},
        {"full": MHASpec(num_layers=2, num_kv_heads=2, head_dim=4, start_layer=1)},
    ]
    for fields in bad:
        args: dict[str, object] = {
            "full": sub,
            "swa": sub,
            "full_layer_ids": (0, 3),
            "swa_layer_ids": (1, 2),
            "sliding_window": 8,
            **fields,
        }
        with pytest.raises(InvalidSpec):
            SWASpec(**args)  # type: ignore[arg-type]


def test_layer_routing() -> None:
    pool = make_swa_pool(full_layer_ids=(0, 2, 5), swa_layer_ids=(1, 3, 4))
    assert pool.layer_ids == (0, 1, 2, 3, 4, 5)
    assert pool.layer_pool(5) == (pool.full_pool, 2)
    assert pool.layer_pool(1).pool is pool.swa_pool and pool.layer_pool(4).local_layer_id == 2
    assert pool.is_swa_layer(3) and not pool.is_swa_layer(2)
    assert pool.get_key_buffer(4).data_ptr() == pool.swa_pool.get_key_buffer(2).data_ptr()
    assert pool.get_value_buffer(2).data_ptr() == pool.full_pool.get_value_buffer(1).data_ptr()
    with pytest.raises(LayerOutOfRange):
        pool.layer_pool(6)
    assert (pool.size, pool.swa_size) == (32, 16)
    assert pool.size_bytes == pool.full_pool.size_bytes + pool.swa_pool.size_bytes
    pool.check_integrity()


def test_translate_needs_the_map() -> None:
    pool = make_swa_pool()
    with pytest.raises(SlotMapMissing):
        pool.translate(torch.tensor([4]))
    with pytest.raises(SlotMapMissing):
        pool.set_kv(1, torch.tensor([4]), torch.ones(1, 2, 4), torch.ones(1, 2, 4))
    # Full layers need no map.
    pool.set_kv(0, torch.tensor([4]), torch.ones(1, 2, 4), torch.ones(1, 2, 4))


def test_translate_follows_the_allocator_map_in_place() -> None:
    pool = make_swa_pool(page_size=4)
    mapping = _page_map(pool, {2: 1, 5: 3})
    pool.set_full_to_swa(mapping)
    assert pool.full_to_swa is mapping
    loc = torch.tensor([8, 11, 20, 23, 4, 0])
    assert pool.translate(loc).tolist() == [4, 7, 12, 15, 0, 0]
    assert pool.translate(loc.view(2, 3)).shape == (2, 3)
    for index_dtype in (torch.uint8, torch.int16, torch.int32):  # positions, never a mask
        assert pool.translate(loc.to(index_dtype)).tolist() == [4, 7, 12, 15, 0, 0]
    # The allocator frees page 2's SWA slots in place: the pool sees it without a new hand-over.
    mapping[8:12] = 0
    assert pool.translate(torch.tensor([8, 20])).tolist() == [0, 12]
    pool.check_integrity()


def test_set_full_to_swa_validates() -> None:
    pool = make_swa_pool(page_size=4)
    rows = pool.full_pool.num_rows
    with pytest.raises(BufferMismatch):
        pool.set_full_to_swa(torch.zeros(rows, dtype=torch.int32))
    with pytest.raises(BufferMismatch):
        pool.set_full_to_swa(torch.zeros(rows - 1, dtype=torch.int64))
    too_far = torch.zeros(rows, dtype=torch.int64)
    too_far[4] = pool.swa_pool.num_rows
    with pytest.raises(IndexOutOfRange):
        pool.set_full_to_swa(too_far)
    dummy = torch.zeros(rows, dtype=torch.int64)
    dummy[0] = 4
    with pytest.raises(ReservedIndex):
        pool.set_full_to_swa(dummy)
    assert pool.full_to_swa is None


@pytest.mark.parametrize("dtype", POOL_DTYPES)
def test_set_kv_writes_swa_layers_at_translated_slots(dtype: torch.dtype, device: str) -> None:
    pool = make_swa_pool(dtype=dtype, page_size=2, device=device)
    pool.set_full_to_swa(_page_map(pool, {3: 1, 4: 5}))
    loc = torch.tensor([6, 7, 9, 2], device=device)  # page 3, page 4, and page 1 (no SWA slot)
    swa_loc = torch.tensor([2, 3, 11, 0], device=device)
    gen = torch.Generator().manual_seed(4)
    k = torch.randn(4, 2, 4, generator=gen).to(dtype).to(device)
    v = torch.randn(4, 2, 4, generator=gen).to(dtype).to(device)
    full_before = [b.clone() for b in pool.full_pool.layer_buffers()]

    pool.set_kv(3, loc, k, v)  # SWA layer 3 is local layer 1 of the SWA pool
    key = pool.swa_pool.get_key_buffer(1)
    assert torch.equal(raw_bytes(key[swa_loc[:3]]), raw_bytes(k[:3]))
    assert torch.equal(raw_bytes(pool.get_value_buffer(3)[swa_loc[:3]]), raw_bytes(v[:3]))
    assert torch.equal(raw_bytes(key[0]), raw_bytes(k[3])), "a token without SWA slot hits slot 0"
    assert all(
        torch.equal(a, b) for a, b in zip(pool.full_pool.layer_buffers(), full_before, strict=True)
    ), "an SWA layer write touched the full pool"

    pool.set_kv(2, loc, k, v)  # full layer 2 is local layer 1 of the full pool, no translation
    assert torch.equal(raw_bytes(pool.full_pool.get_key_buffer(1)[loc]), raw_bytes(k))


def test_check_integrity_catches_a_broken_map() -> None:
    pool = make_swa_pool(page_size=4)
    partly = _page_map(pool, {2: 1})
    partly[9] = 0  # one slot of full page 2 lost its SWA slot, the others kept theirs
    pool.set_full_to_swa(partly)
    with pytest.raises(AssertionError, match=r"partly mapped|not mapped onto one"):
        pool.check_integrity()
    shared = _page_map(pool, {2: 1, 3: 1})  # two full pages on one SWA page
    pool.set_full_to_swa(shared)
    with pytest.raises(AssertionError, match="serves two"):
        pool.check_integrity()
    shifted = _page_map(pool, {2: 1})
    shifted[8:12] += 1  # offsets not kept
    pool.set_full_to_swa(shifted)
    with pytest.raises(AssertionError):
        pool.check_integrity()
