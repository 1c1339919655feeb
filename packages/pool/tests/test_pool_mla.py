"""MLAKVPool and MLASpec: latent rows, the V prefix view, round trips per dtype, errors."""

from __future__ import annotations

import pytest
import torch

from kvstrata.pool import BufferMismatch, InvalidSpec, LayerOutOfRange, MLASpec
from kvstrata.testkit.pools import POOL_DTYPES, make_mla_pool, raw_bytes


def test_spec_sizes() -> None:
    spec = MLASpec(num_layers=61, kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.bfloat16)
    assert spec.kv_dim == 576
    assert spec.bytes_per_token == 61 * 576 * 2
    assert spec.page_size_bytes(64) == spec.bytes_per_token * 64
    with pytest.raises(InvalidSpec):
        MLASpec(num_layers=1, kv_lora_rank=0, qk_rope_head_dim=64)


@pytest.mark.parametrize("dtype", POOL_DTYPES)
def test_geometry_and_value_view(dtype: torch.dtype) -> None:
    pool = make_mla_pool(dtype=dtype, kv_lora_rank=8, qk_rope_head_dim=4, start_layer=1)
    buffers = pool.layer_buffers()
    assert len(buffers) == 3
    assert all(tuple(b.shape) == (pool.num_rows, 1, 12) for b in buffers)
    assert pool.size_bytes == pool.num_rows * pool.bytes_per_token
    key, value = pool.get_key_buffer(2), pool.get_value_buffer(2)
    assert key.dtype == dtype and value.dtype == dtype
    assert tuple(value.shape) == (pool.num_rows, 1, 8)
    assert value.data_ptr() == key.data_ptr() == buffers[1].data_ptr()
    pool.check_integrity()


@pytest.mark.parametrize("dtype", POOL_DTYPES)
def test_set_kv_reads_back_bit_identical(dtype: torch.dtype, device: str) -> None:
    pool = make_mla_pool(dtype=dtype, device=device)
    gen = torch.Generator().manual_seed(2)
    loc = torch.tensor([4, 8, pool.num_rows - 1], device=device)
    for layer in pool.layer_ids:
        nope = torch.randn(3, 1, 8, generator=gen).to(dtype).to(device)
        rope = torch.randn(3, 1, 4, generator=gen).to(dtype).to(device)
        pool.set_kv(layer, loc, nope, rope)
        row = pool.get_key_buffer(layer)[loc]
        assert torch.equal(raw_bytes(row[..., :8]), raw_bytes(nope))
        assert torch.equal(raw_bytes(row[..., 8:]), raw_bytes(rope))
        assert torch.equal(raw_bytes(pool.get_value_buffer(layer)[loc]), raw_bytes(nope))


def test_set_kv_casts() -> None:
    pool = make_mla_pool(dtype=torch.float8_e4m3fn)
    nope, rope = torch.randn(2, 1, 8), torch.randn(2, 1, 4)
    loc = torch.tensor([1, 2])
    pool.set_kv(0, loc, nope, rope)
    want = torch.cat([nope, rope], dim=-1).to(torch.float8_e4m3fn)
    assert torch.equal(raw_bytes(pool.get_key_buffer(0)[loc]), raw_bytes(want))


def test_errors_change_nothing() -> None:
    pool = make_mla_pool(dtype=torch.float32, start_layer=2)
    before = [b.clone() for b in pool.layer_buffers()]
    with pytest.raises(BufferMismatch):
        pool.set_kv(2, torch.tensor([1]), torch.ones(1, 1, 8), torch.ones(1, 1, 5))
    with pytest.raises(LayerOutOfRange):
        pool.set_kv(1, torch.tensor([1]), torch.ones(1, 1, 8), torch.ones(1, 1, 4))
    with pytest.raises(LayerOutOfRange):
        pool.get_value_buffer(5)
    assert all(torch.equal(a, b) for a, b in zip(pool.layer_buffers(), before, strict=True))
