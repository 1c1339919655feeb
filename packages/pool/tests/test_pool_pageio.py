"""read_pages / write_pages: the flat page format, round trips, validation before change,
and a stateful test against a shadow copy of every page."""

from __future__ import annotations

import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvstrata.pool import (
    BufferMismatch,
    DuplicateIndex,
    IndexOutOfRange,
    InvalidArgument,
    ReservedIndex,
)
from kvstrata.pool.base import DevicePool, check_distinct, check_index_range
from kvstrata.testkit.pools import (
    POOL_DTYPES,
    check_page_round_trip,
    fill_random_bytes,
    flat_pages,
    make_mamba_pool,
    make_mha_pool,
    make_mla_pool,
    make_page_io_pool,
    page_io_cases,
)

LAYOUTS = ["mha-two-stacks", "mla", "mamba"]
CASES = page_io_cases(LAYOUTS)


def _pool(family: str, dtype: torch.dtype, page_size: int, device: str = "cpu") -> DevicePool:
    pool = make_page_io_pool(family, dtype, page_size, num_pages=8, device=device)
    fill_random_bytes(pool, seed=7)
    return pool


def _all_pages(pool: DevicePool) -> torch.Tensor:
    return flat_pages(pool, range(pool.num_pages))


@pytest.mark.parametrize("dtype", POOL_DTYPES)
@pytest.mark.parametrize(("family", "page_size"), CASES)
def test_round_trip_random_pages(family: str, page_size: int, dtype: torch.dtype) -> None:
    pool = _pool(family, dtype, page_size)
    gen = torch.Generator().manual_seed(3)
    assert (
        pool.page_size_bytes
        == sum(b[0].numel() * b.element_size() for b in pool.layer_buffers()) * page_size
    )
    check_page_round_trip(pool, torch.randperm(pool.num_pages - 1, generator=gen)[:5] + 1, seed=3)
    pool.check_integrity()


# The flat-format tests below build the expected page from the public per-layer accessors
# (conv_state / ssm_state, get_key_buffer / get_value_buffer), not from layer_buffers(), so a
# wrong buffer order in the pool cannot hide behind a reference computed the same wrong way.


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_flat_format_of_mamba_interleaves_conv_and_ssm() -> None:
    pool = make_mamba_pool(num_layers=3, conv_dtype=torch.float8_e5m2)
    fill_random_bytes(pool, seed=7)
    buffers = pool.layer_buffers()
    for layer in range(3):
        assert buffers[2 * layer].data_ptr() == pool.conv_state[layer].data_ptr()
        assert buffers[2 * layer + 1].data_ptr() == pool.ssm_state[layer].data_ptr()
    out = torch.empty((2, pool.page_size_bytes), dtype=torch.uint8)
    pool.read_pages(torch.tensor([3, 6]), out)
    for row, slot in enumerate((3, 6)):
        expected = torch.cat(
            [
                part
                for layer in range(3)
                for part in (_raw(pool.conv_state[layer, slot]), _raw(pool.ssm_state[layer, slot]))
            ]
        )
        assert torch.equal(out[row], expected)


@pytest.mark.parametrize("v_head_dim", [None, 3], ids=["one-stack", "two-stacks"])
def test_flat_format_of_mha_is_all_keys_then_all_values(v_head_dim: int | None) -> None:
    pool = make_mha_pool(
        dtype=torch.float16, v_head_dim=v_head_dim, start_layer=4, size=16, page_size=2
    )
    fill_random_bytes(pool, seed=7)
    out = torch.empty((1, pool.page_size_bytes), dtype=torch.uint8)
    pool.read_pages(torch.tensor([2]), out)
    layers = pool.layer_ids
    expected = torch.cat(
        [_raw(pool.get_key_buffer(layer)[4:6]) for layer in layers]
        + [_raw(pool.get_value_buffer(layer)[4:6]) for layer in layers]
    )
    assert torch.equal(out[0], expected)


def test_flat_format_of_mla_is_the_layers_in_order() -> None:
    pool = make_mla_pool(dtype=torch.bfloat16, start_layer=1, size=16, page_size=4)
    fill_random_bytes(pool, seed=7)
    out = torch.empty((1, pool.page_size_bytes), dtype=torch.uint8)
    pool.read_pages(torch.tensor([3]), out)
    expected = torch.cat([_raw(pool.get_key_buffer(layer)[12:16]) for layer in pool.layer_ids])
    assert torch.equal(out[0], expected)


@pytest.mark.parametrize(
    "index_dtype", [torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32], ids=str
)
def test_page_ids_of_any_integer_dtype(index_dtype: torch.dtype) -> None:
    pool = _pool("mha-two-stacks", torch.bfloat16, 4)
    out = torch.empty((2, pool.page_size_bytes), dtype=torch.uint8)
    pool.read_pages(torch.tensor([6, 2], dtype=index_dtype), out)
    assert torch.equal(out, flat_pages(pool, [6, 2]))
    src = torch.randint(0, 256, out.shape, dtype=torch.uint8)
    pool.write_pages(torch.tensor([5, 1], dtype=index_dtype), src)
    assert torch.equal(flat_pages(pool, [5, 1]), src)


def test_repeated_ids_read_the_same_page_twice() -> None:
    pool = _pool("mla", torch.bfloat16, 4)
    out = torch.empty((3, pool.page_size_bytes), dtype=torch.uint8)
    pool.read_pages(torch.tensor([2, 2, 5], dtype=torch.int32), out)
    assert torch.equal(out, flat_pages(pool, [2, 2, 5]))


def test_strided_rows_of_a_larger_buffer() -> None:
    pool = _pool("mha-two-stacks", torch.bfloat16, 4)
    wide = torch.zeros((3, pool.page_size_bytes + 16), dtype=torch.uint8)
    view = wide[:, 8 : 8 + pool.page_size_bytes]
    pool.read_pages(torch.tensor([1, 4, 6]), view)
    assert torch.equal(view, flat_pages(pool, [1, 4, 6]))
    assert not wide[:, :8].any() and not wide[:, -8:].any(), "bytes outside the rows changed"
    pool.write_pages(torch.tensor([7, 2, 3]), view)
    assert torch.equal(flat_pages(pool, [7, 2, 3]), view)


def test_dummy_page_only_when_allowed() -> None:
    pool = _pool("mha-two-stacks", torch.bfloat16, 4)
    out = torch.empty((1, pool.page_size_bytes), dtype=torch.uint8)
    with pytest.raises(ReservedIndex):
        pool.read_pages(torch.tensor([0]), out)
    pool.read_pages(torch.tensor([0]), out, allow_dummy=True)
    assert torch.equal(out, flat_pages(pool, [0]))
    pool.write_pages(torch.tensor([0]), torch.zeros_like(out), allow_dummy=True)
    assert not flat_pages(pool, [0]).any()


def test_empty_ids_are_a_no_op() -> None:
    pool = _pool("mha-two-stacks", torch.bfloat16, 4)
    before = _all_pages(pool)
    empty = torch.empty((0, pool.page_size_bytes), dtype=torch.uint8)
    pool.read_pages(torch.empty(0, dtype=torch.int64), empty)
    pool.write_pages(torch.empty(0, dtype=torch.int64), empty)
    assert torch.equal(_all_pages(pool), before)
    assert pool.counters.pages_read == pool.counters.pages_written == 0


def _bad_calls(pool: DevicePool) -> list[tuple[str, torch.Tensor, torch.Tensor, type[Exception]]]:
    pb, n = pool.page_size_bytes, pool.num_pages
    ok = torch.zeros((2, pb), dtype=torch.uint8)
    ids = torch.tensor([1, 2])

    def flat(rows: int, cols: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        return torch.zeros((rows, cols), dtype=dtype)

    return [
        ("page 0", torch.tensor([0, 1]), ok, ReservedIndex),
        ("past the end", torch.tensor([1, n]), ok, IndexOutOfRange),
        ("negative", torch.tensor([-1, 1]), ok, IndexOutOfRange),
        ("float ids", torch.tensor([1.0, 2.0]), ok, InvalidArgument),
        ("2-D ids", torch.tensor([[1, 2]]), ok, InvalidArgument),
        ("too few rows", ids, flat(1, pb), BufferMismatch),
        ("row too short", ids, flat(2, pb - 1), BufferMismatch),
        ("not uint8", ids, flat(2, pb, torch.int8), BufferMismatch),
        ("column-major", ids, flat(pb, 2).t(), BufferMismatch),
    ]


@pytest.mark.parametrize(("family", "page_size"), CASES)
def test_errors_are_raised_before_any_change(family: str, page_size: int) -> None:
    pool = _pool(family, torch.bfloat16, page_size)
    before = _all_pages(pool)
    for what, ids, buf, error in _bad_calls(pool):
        snapshot = buf.clone()
        with pytest.raises(error):
            pool.read_pages(ids, buf)
        assert torch.equal(buf, snapshot), f"read_pages ({what}) wrote into out"
        with pytest.raises(error):
            pool.write_pages(ids, buf)
        assert torch.equal(_all_pages(pool), before), f"write_pages ({what}) changed the pool"
    src = torch.ones((2, pool.page_size_bytes), dtype=torch.uint8)
    with pytest.raises(DuplicateIndex):
        pool.write_pages(torch.tensor([3, 3]), src)
    assert torch.equal(_all_pages(pool), before)
    assert pool.counters.pages_read == pool.counters.pages_written == 0


def test_counters() -> None:
    pool = _pool("mha-two-stacks", torch.bfloat16, 4)
    out = torch.empty((3, pool.page_size_bytes), dtype=torch.uint8)
    pool.read_pages(torch.tensor([1, 2, 3]), out)
    pool.write_pages(torch.tensor([4, 5]), out[:2])
    c = pool.counters
    assert (c.pages_read, c.pages_written) == (3, 2)
    assert (c.bytes_read, c.bytes_written) == (3 * pool.page_size_bytes, 2 * pool.page_size_bytes)


@pytest.mark.cuda
@pytest.mark.parametrize(("family", "page_size"), CASES)
def test_cuda_pool_with_host_and_device_buffers(family: str, page_size: int) -> None:
    pool = _pool(family, torch.bfloat16, page_size, device="cuda")
    ids = torch.tensor([1, 5, 3])
    expected = flat_pages(pool, [1, 5, 3])
    pinned = torch.empty((3, pool.page_size_bytes), dtype=torch.uint8).pin_memory()
    pool.read_pages(ids, pinned, non_blocking=True)
    torch.cuda.current_stream().synchronize()
    assert torch.equal(pinned, expected)
    on_device = torch.empty((3, pool.page_size_bytes), dtype=torch.uint8, device="cuda")
    pool.read_pages(ids.cuda(), on_device)
    assert torch.equal(on_device.cpu(), expected)
    src = torch.randint(0, 256, (3, pool.page_size_bytes), dtype=torch.uint8).pin_memory()
    pool.write_pages(torch.tensor([2, 4, 6]), src, non_blocking=True)
    torch.cuda.current_stream().synchronize()
    assert torch.equal(flat_pages(pool, [2, 4, 6]), src)
    pool.write_pages(torch.tensor([7], device="cuda"), on_device[:1])
    assert torch.equal(flat_pages(pool, [7]), expected[:1])


class PageIOMachine(RuleBasedStateMachine):
    """Random page reads, page writes and set_kv calls against a shadow of every flat page."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = make_mha_pool(dtype=torch.float8_e4m3fn, v_head_dim=2, size=12, page_size=2)
        fill_random_bytes(self.pool, seed=11)
        self.shadow = _all_pages(self.pool)
        self.gen = torch.Generator().manual_seed(5)

    page_lists = st.lists(st.integers(1, 6), min_size=0, max_size=6)

    @rule(ids=page_lists)
    def read(self, ids: list[int]) -> None:
        out = torch.empty((len(ids), self.pool.page_size_bytes), dtype=torch.uint8)
        self.pool.read_pages(torch.tensor(ids, dtype=torch.int64), out)
        assert torch.equal(out, self.shadow[ids])

    @rule(ids=st.lists(st.integers(1, 6), max_size=6, unique=True))
    def write(self, ids: list[int]) -> None:
        shape = (len(ids), self.pool.page_size_bytes)
        src = torch.randint(0, 256, shape, generator=self.gen, dtype=torch.uint8)
        self.pool.write_pages(torch.tensor(ids, dtype=torch.int64), src)
        self.shadow[ids] = src

    @rule(ids=st.lists(st.integers(0, 7), min_size=1, max_size=4), dup=st.booleans())
    def rejected_write(self, ids: list[int], dup: bool) -> None:
        """A write with page 0, a page past the end, or a repeat: refused, nothing changes."""
        if dup:
            ids = [*ids, ids[0]]
        if all(1 <= i <= 6 for i in ids) and len(set(ids)) == len(ids):
            return
        src = torch.full((len(ids), self.pool.page_size_bytes), 0xAB, dtype=torch.uint8)
        with pytest.raises((ReservedIndex, IndexOutOfRange, DuplicateIndex)):
            self.pool.write_pages(torch.tensor(ids, dtype=torch.int64), src)

    @rule(layer=st.integers(0, 2), slot=st.integers(0, 13))
    def set_kv(self, layer: int, slot: int) -> None:
        k = torch.randn((1, 2, 4), generator=self.gen)
        v = torch.randn((1, 2, 2), generator=self.gen)
        self.pool.set_kv(layer, torch.tensor([slot]), k, v)
        # Where the flat format puts this token: K rows are 8 bytes (2 heads x 4), V rows 4,
        # page size 2, 3 layers: | K0 K1 K2 (16 bytes each) | V0 V1 V2 (8 bytes each) |.
        page, offset = divmod(slot, 2)
        k_at = layer * 16 + offset * 8
        v_at = 3 * 16 + layer * 8 + offset * 4
        self.shadow[page, k_at : k_at + 8] = k.to(torch.float8_e4m3fn).view(torch.uint8).reshape(-1)
        self.shadow[page, v_at : v_at + 4] = v.to(torch.float8_e4m3fn).view(torch.uint8).reshape(-1)

    @invariant()
    def pages_match_shadow(self) -> None:
        self.pool.check_integrity()
        assert torch.equal(_all_pages(self.pool), self.shadow)


TestPageIOMachine = PageIOMachine.TestCase


def test_page_id_checks_keep_their_order_on_every_id_dtype_and_layout() -> None:
    # One sort gives the range and the duplicates on the CPU: the errors keep the order range,
    # then page 0, then repeats, for int32 and strided ids alike.
    pool = _pool("mha-two-stacks", torch.bfloat16, 4)
    limit = pool.num_pages
    src = torch.zeros((3, pool.page_size_bytes), dtype=torch.uint8)
    with pytest.raises(IndexOutOfRange):
        pool.write_pages(torch.tensor([limit, 3, 3]), src)
    with pytest.raises(ReservedIndex):
        pool.write_pages(torch.tensor([0, 0, 2], dtype=torch.int32), src)
    with pytest.raises(DuplicateIndex):
        pool.write_pages(torch.tensor([2, 5, 2], dtype=torch.int32), src)
    strided = torch.tensor([1, 9, 2, 9, 1, 9])[::2]  # [1, 2, 1]: a view with stride 2
    with pytest.raises(DuplicateIndex):
        pool.write_pages(strided, src)
    distinct = torch.tensor([3, 9, 1, 9, 2, 9])[::2]
    pool.write_pages(
        distinct, torch.arange(3 * pool.page_size_bytes).reshape(3, -1).to(torch.uint8)
    )
    out = torch.empty_like(src)
    pool.read_pages(torch.tensor([2, 2, 1], dtype=torch.int32), out)  # reads may repeat
    assert torch.equal(out[0], out[1])


def test_id_checks_see_every_entry_of_a_multi_dimensional_tensor() -> None:
    # check_distinct sorts the flattened ids: a repeat across rows is still a repeat.
    with pytest.raises(DuplicateIndex):
        check_distinct(torch.tensor([[1, 2], [3, 2]]), what="ids")
    with pytest.raises(DuplicateIndex):
        check_index_range(
            torch.tensor([[1, 2], [3, 2]]), limit=9, what="ids", allow_zero=False, distinct=True
        )
    with pytest.raises(IndexOutOfRange):
        check_index_range(torch.tensor(12), limit=9, what="ids", allow_zero=False, distinct=True)
    check_distinct(torch.tensor([[1, 2], [3, 4]]), what="ids")
