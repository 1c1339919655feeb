"""MHAKVPool and MHASpec: geometry, set_kv round trips per dtype, layer ranges, errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvstrata.pool import (
    BufferMismatch,
    IndexOutOfRange,
    InvalidArgument,
    InvalidSpec,
    LayerOutOfRange,
    MHAKVPool,
    MHASpec,
    UnsupportedDtype,
)
from kvstrata.testkit.pools import POOL_DTYPES, make_mha_pool, raw_bytes


def _snapshot(pool: MHAKVPool) -> list[torch.Tensor]:
    return [b.view(torch.uint8).clone().cpu() for b in pool.layer_buffers()]


def _assert_unchanged(pool: MHAKVPool, before: list[torch.Tensor]) -> None:
    after = _snapshot(pool)
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))


def test_spec_sizes() -> None:
    spec = MHASpec(num_layers=4, num_kv_heads=8, head_dim=128, dtype=torch.float16)
    assert spec.value_head_dim == 128
    assert spec.bytes_per_token == 4 * 2 * 8 * 128 * 2
    assert spec.page_size_bytes(16) == spec.bytes_per_token * 16
    fp8 = MHASpec(num_layers=2, num_kv_heads=1, head_dim=4, v_head_dim=2, dtype=torch.float8_e5m2)
    assert fp8.bytes_per_token == 2 * (4 + 2)
    assert fp8.store_dtype == torch.uint8
    assert MHASpec(num_layers=3, num_kv_heads=1, head_dim=1, start_layer=5).layer_ids == range(5, 8)


@pytest.mark.parametrize(
    "fields",
    [
        {"num_layers": 0},
        {"num_kv_heads": -1},
        {"head_dim": 0},
        {"v_head_dim": 0},
        {"start_layer": -1},
    ],
)
def test_spec_rejects_bad_fields(fields: dict[str, int]) -> None:
    base = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 4}
    with pytest.raises(InvalidSpec):
        MHASpec(**{**base, **fields})  # pyright: ignore[reportArgumentType]


@pytest.mark.parametrize("dtype", [torch.int8, torch.float64, torch.uint8])
def test_spec_rejects_unsupported_dtype(dtype: torch.dtype) -> None:
    with pytest.raises(UnsupportedDtype):
        MHASpec(num_layers=1, num_kv_heads=1, head_dim=1, dtype=dtype)


def test_spec_is_frozen_and_keyword_only() -> None:
    spec = MHASpec(num_layers=1, num_kv_heads=1, head_dim=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.num_layers = 2  # type: ignore[misc]
    with pytest.raises(TypeError):
        MHASpec(1, 1, 1)  # type: ignore[misc]


@pytest.mark.parametrize("dtype", POOL_DTYPES)
def test_geometry(dtype: torch.dtype) -> None:
    pool = make_mha_pool(dtype=dtype, v_head_dim=3, size=32, page_size=4)
    assert (pool.num_rows, pool.num_pages) == (36, 9)
    assert pool.dtype == dtype
    assert pool.store_dtype == (torch.uint8 if dtype.itemsize == 1 else dtype)
    buffers = pool.layer_buffers()
    assert len(buffers) == 2 * pool.spec.num_layers
    assert all(b.shape[0] == pool.num_rows and b.dtype == pool.store_dtype for b in buffers)
    assert [tuple(b.shape[1:]) for b in buffers] == [(2, 4)] * 3 + [(2, 3)] * 3
    assert pool.size_bytes == pool.num_rows * pool.bytes_per_token
    assert pool.page_size_bytes == pool.page_size * pool.bytes_per_token
    assert all(not b.view(torch.uint8).any() for b in buffers), "buffers start zeroed"
    pool.check_integrity()


@pytest.mark.parametrize(("size", "page_size"), [(30, 4), (0, 4), (-4, 4), (8, 0)])
def test_pool_rejects_sizes_that_are_not_whole_pages(size: int, page_size: int) -> None:
    with pytest.raises(InvalidArgument):
        make_mha_pool(size=size, page_size=page_size)


def test_buffers_are_views_of_the_pool() -> None:
    pool = make_mha_pool(dtype=torch.float8_e4m3fn, start_layer=2)
    buffers = pool.layer_buffers()
    for i, layer in enumerate(pool.layer_ids):
        key, value = pool.get_key_buffer(layer), pool.get_value_buffer(layer)
        assert key.dtype == torch.float8_e4m3fn
        assert key.data_ptr() == buffers[i].data_ptr()
        assert value.data_ptr() == buffers[len(pool.layer_ids) + i].data_ptr()


@pytest.mark.parametrize("dtype", POOL_DTYPES)
def test_set_kv_reads_back_bit_identical(dtype: torch.dtype, device: str) -> None:
    pool = make_mha_pool(dtype=dtype, v_head_dim=3, start_layer=2, device=device)
    gen = torch.Generator().manual_seed(1)
    loc = torch.tensor([4, 9, 17, pool.num_rows - 1], device=device)
    written: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for layer in pool.layer_ids:
        k = torch.randn(4, 2, 4, generator=gen).to(dtype).to(device)
        v = torch.randn(4, 2, 3, generator=gen).to(dtype).to(device)
        pool.set_kv(layer, loc, k, v)
        written[layer] = (k, v)
    others = torch.ones(pool.num_rows, dtype=torch.bool)
    others[loc.cpu()] = False
    for layer, (k, v) in written.items():
        key, value = pool.get_key_buffer(layer), pool.get_value_buffer(layer)
        assert torch.equal(raw_bytes(key[loc]), raw_bytes(k))
        assert torch.equal(raw_bytes(value[loc]), raw_bytes(v))
        assert not raw_bytes(key)[others].any() and not raw_bytes(value)[others].any()


@pytest.mark.parametrize("dtype", POOL_DTYPES)
def test_set_kv_casts_and_scales(dtype: torch.dtype) -> None:
    pool = make_mha_pool(dtype=dtype)
    loc = torch.tensor([5, 6])
    k = torch.randn(2, 2 * 4)  # flat heads: any shape with n rows of the right size
    v = torch.randn(2, 2, 4)
    pool.set_kv(0, loc, k, v, k_scale=2.0)
    assert torch.equal(
        raw_bytes(pool.get_key_buffer(0)[loc]), raw_bytes((k / 2.0).to(dtype).view(2, 2, 4))
    )
    assert torch.equal(raw_bytes(pool.get_value_buffer(0)[loc]), raw_bytes(v.to(dtype)))


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_set_kv_scales_fp8_input(fp8: torch.dtype) -> None:
    """Values already in fp8 with a scale: divided in fp32 (float8 has no division kernel)."""
    pool = make_mha_pool(dtype=fp8)
    loc = torch.tensor([3, 9])
    k = (torch.randn(2, 2, 4) * 4).to(fp8)
    v = (torch.randn(2, 2, 4) * 4).to(fp8)
    pool.set_kv(0, loc, k, v, k_scale=2.0, v_scale=0.5)
    assert torch.equal(raw_bytes(pool.get_key_buffer(0)[loc]), raw_bytes((k.float() / 2.0).to(fp8)))
    assert torch.equal(
        raw_bytes(pool.get_value_buffer(0)[loc]), raw_bytes((v.float() / 0.5).to(fp8))
    )


@pytest.mark.parametrize(
    "index_dtype", [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64], ids=str
)
def test_set_kv_takes_any_integer_index_dtype_as_positions(index_dtype: torch.dtype) -> None:
    """uint8 indices are positions, not a boolean mask (what torch would make of them)."""
    pool = make_mha_pool(dtype=torch.float32, size=8, page_size=4)  # 12 rows
    loc = torch.tensor([1, 3, 11], dtype=index_dtype)
    k = torch.arange(3 * 8, dtype=torch.float32).view(3, 2, 4) + 1
    pool.set_kv(0, loc, k, k)
    written = pool.get_key_buffer(0).reshape(pool.num_rows, -1).any(1)
    assert written.nonzero().flatten().tolist() == [1, 3, 11]
    assert torch.equal(pool.get_value_buffer(0)[[1, 3, 11]], k)
    with pytest.raises(IndexOutOfRange):
        pool.set_kv(0, torch.tensor([12], dtype=index_dtype), k[:1], k[:1])


def test_padding_slot_zero_is_writable() -> None:
    pool = make_mha_pool(dtype=torch.float32)
    k = torch.ones(2, 2, 4)
    pool.set_kv(0, torch.tensor([0, 0]), k, k)
    assert torch.equal(pool.get_key_buffer(0)[0], k[0])


def test_layer_range_is_global() -> None:
    pool = make_mha_pool(num_layers=3, start_layer=4)
    assert pool.layer_ids == range(4, 7)
    assert pool.local_layer_id(6) == 2
    for bad in (3, 7, -1):
        with pytest.raises(LayerOutOfRange):
            pool.get_key_buffer(bad)
        with pytest.raises(LayerOutOfRange):
            pool.set_kv(bad, torch.tensor([1]), torch.zeros(1, 2, 4), torch.zeros(1, 2, 4))


@pytest.mark.parametrize(
    ("loc", "k_shape", "v_shape", "error"),
    [
        (torch.tensor([1, 2]), (2, 2, 5), (2, 2, 4), BufferMismatch),
        (torch.tensor([1, 2]), (2, 2, 4), (3, 2, 4), BufferMismatch),
        (torch.tensor([1, 36]), (2, 2, 4), (2, 2, 4), IndexOutOfRange),
        (torch.tensor([-1, 2]), (2, 2, 4), (2, 2, 4), IndexOutOfRange),
        (torch.tensor([1.0, 2.0]), (2, 2, 4), (2, 2, 4), InvalidArgument),
        (torch.tensor([[1, 2]]), (2, 2, 4), (2, 2, 4), InvalidArgument),
    ],
)
def test_set_kv_errors_change_nothing(
    loc: torch.Tensor, k_shape: tuple[int, ...], v_shape: tuple[int, ...], error: type[Exception]
) -> None:
    pool = make_mha_pool(dtype=torch.float32)
    before = _snapshot(pool)
    with pytest.raises(error):
        pool.set_kv(1, loc, torch.ones(k_shape), torch.ones(v_shape))
    _assert_unchanged(pool, before)


def test_location_check_can_be_turned_off() -> None:
    spec = MHASpec(num_layers=1, num_kv_heads=1, head_dim=1)
    assert MHAKVPool(spec, size=4).check_locations is True
    pool = MHAKVPool(spec, size=4, check_locations=False)
    # Without the pool's check, torch's own bounds check still refuses the write.
    with pytest.raises(IndexError):
        pool.set_kv(0, torch.tensor([99]), torch.ones(1, 1, 1), torch.ones(1, 1, 1))
