"""The compiled page-row copy of CPU backups (`copy_pages.c`) against the NumPy / torch path:
twin pools, the host mirror of one built inside `kvstrata.pool.native.disabled()`, must end
with the same host bytes and raise the same errors on every plan; the compiled call itself
refuses what it cannot take without copying anything."""

from __future__ import annotations

from typing import cast

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.pool import native
from kvstrata.pool.base import DevicePool
from kvstrata.pool_host import CopyStrategy, HostLayout, LayerCompletion, PagePlan, copy_pages
from kvstrata.pool_host.base import HostPool
from kvstrata.pool_host.copy_pages import RowCopy, row_copy
from kvstrata.pool_host.errors import IndexOutOfRange, LayerLoadFailed, ReservedIndex
from kvstrata.testkit.host_pools import (
    HOST_CLASSES,
    Family,
    fill_random,
    make_device_pool,
    page_tokens,
)

pytestmark = pytest.mark.skipif(
    row_copy([torch.zeros(2, 8, dtype=torch.uint8)], [torch.zeros(2, 8, dtype=torch.uint8)])
    is None,
    reason="no compiled page copy",
)


def host_bytes(host: HostPool[DevicePool], pages: set[int]) -> list[bytes]:
    """The bytes of host `pages` (pages never written hold whatever the allocation held)."""
    out = []
    for p in sorted(pages):
        buf = bytearray(host.page_size_bytes)
        host.read_page_into(p, buf)
        out.append(bytes(buf))
    return out


def twins(
    family: Family, layout: HostLayout
) -> tuple[DevicePool, HostPool[DevicePool], HostPool[DevicePool]]:
    pool = make_device_pool(family, num_pages=24, num_layers=2)
    fill_random(pool, seed=3)
    cls = HOST_CLASSES[family]
    fast = cls(pool, layout=layout, size=30 * pool.page_size)
    with native.disabled():
        slow = cls(pool, layout=layout, size=30 * pool.page_size)
    return pool, fast, slow


@pytest.mark.parametrize("layout", [HostLayout.page_first, HostLayout.layer_first], ids=str)
@pytest.mark.parametrize("family", ["mha", "mamba"])
def test_random_backups_give_the_same_host_bytes_as_the_numpy_path(
    family: Family, layout: HostLayout
) -> None:
    pool, fast, slow = twins(family, layout)
    assert fast._d2h_rows is not None and slow._d2h_rows is None
    calls: list[bool] = []
    compiled = fast._d2h_rows

    def spy(src: np.ndarray, dst: np.ndarray) -> bool:
        done = compiled(src, dst)
        calls.append(done)
        return done

    fast._d2h_rows = spy  # type: ignore[assignment]
    rng = np.random.default_rng(7)
    written: set[int] = set()
    num_device = pool.num_rows // pool.page_size
    for step in range(40):
        n = int(rng.integers(0, 12))
        src = rng.choice(np.arange(1, num_device), size=n, replace=False).astype(np.int64)
        if step % 3 == 0:  # runs on both sides: packed rows copy them as one block
            start = int(rng.integers(1, num_device - n)) if n < num_device - 1 else 1
            src = np.arange(start, start + n, dtype=np.int64)
        dst = rng.choice(np.arange(fast.num_pages), size=n, replace=False).astype(np.int64)
        if step % 3 == 0:
            dst = np.sort(dst)
        for host in (fast, slow):
            t = host.backup_planned(pool, PagePlan(src, dst))
            assert t.num_pages == n
        written.update(dst.tolist())
        assert host_bytes(fast, written) == host_bytes(slow, written)
        fill_random(pool, seed=100 + step)
    # The compiled copy answered, every time (a refusal would let the NumPy path copy the
    # same bytes and the comparison above pass without it).
    assert calls and all(calls)


def test_untrusted_backups_take_the_compiled_copy_and_keep_their_checks() -> None:
    pool, fast, slow = twins("mha", HostLayout.page_first)
    page = pool.page_size
    compiled = fast._d2h_rows
    assert compiled is not None
    answers: list[bool] = []

    def spy(src: np.ndarray, dst: np.ndarray) -> bool:
        answers.append(compiled(src, dst))
        return answers[-1]

    fast._d2h_rows = spy  # type: ignore[assignment]
    for host in (fast, slow):
        t = host.backup(pool, page_tokens([3, 1, 7], page), page_tokens([2, 9, 4], page))
        assert t.strategy is CopyStrategy.gather
    assert answers == [True]  # the compiled copy moved them
    assert host_bytes(fast, {2, 9, 4}) == host_bytes(slow, {2, 9, 4})
    for host in (fast, slow):
        with pytest.raises(IndexOutOfRange):
            host.backup(pool, page_tokens([3], page), page_tokens([99], page))


def test_a_plan_out_of_range_raises_the_same_either_way() -> None:
    pool, fast, slow = twins("mha", HostLayout.page_first)
    bad = PagePlan(np.array([2, 500], dtype=np.int64), np.array([0, 1], dtype=np.int64))
    before = host_bytes(fast, {0, 1})
    errors = []
    for host in (fast, slow):
        with pytest.raises(IndexError) as info:
            host.backup_planned(pool, bad)
        errors.append(type(info.value))
    assert errors[0] is errors[1]
    assert host_bytes(fast, {0, 1}) == before  # the compiled call refused before any copy


def test_row_copy_refuses_without_copying_and_converts_strided_plans() -> None:
    src = [torch.arange(64, dtype=torch.uint8).view(8, 8)]
    dst = [torch.zeros(4, 8, dtype=torch.uint8)]
    copy = row_copy(src, dst)
    assert isinstance(copy, RowCopy)
    assert not copy(np.array([1, 8]), np.array([0, 1]))  # source page 8 of 8 rows
    assert not copy(np.array([1]), np.array([-1]))
    assert int(dst[0].sum()) == 0
    strided = np.array([5, 0, 6, 0], dtype=np.int64)[::2]  # not contiguous
    assert copy(strided, np.array([3, 2], dtype=np.int32))  # nor int64: converted
    assert dst[0][3].tolist() == src[0][5].tolist() and dst[0][2].tolist() == src[0][6].tolist()
    before = dst[0].clone()
    assert not copy(np.array([1, 2]), np.array([1]))  # lengths differ: refused, NumPy decides
    assert not copy(np.array([1.0]), np.array([0]))  # float ids are not truncated
    assert torch.equal(dst[0], before)
    assert row_copy([torch.zeros(2, 8)], [torch.zeros(2, 8)]) is None  # not byte rows
    assert row_copy(src, [torch.zeros(4, 4, dtype=torch.uint8)]) is None  # row lengths differ


@pytest.mark.parametrize(
    "src, dst",
    [
        (np.array([2.0, 3.7]), np.array([0.0, 1.0])),  # float ids: never truncated
        (np.array([True, True]), np.array([True, False])),  # a mask, not ids
        (np.array([2], dtype=np.int64), np.array([0, 1], dtype=np.int64)),  # lengths differ
    ],
    ids=["float", "bool", "lengths"],
)
def test_a_plan_outside_the_contract_answers_as_the_numpy_path(
    src: np.ndarray, dst: np.ndarray
) -> None:
    """`backup_planned` is public: whatever a plan the compiled copy cannot take as it is,
    the twin built inside `native.disabled()` decides the outcome (error or bytes)."""
    pool, fast, slow = twins("mha", HostLayout.page_first)
    outcome: list[object] = []
    for host in (fast, slow):
        try:
            host.backup_planned(pool, PagePlan(src, dst))
            outcome.append(host_bytes(host, {0, 1}))
        except (IndexError, ValueError) as exc:
            outcome.append(type(exc))
    assert outcome[0] == outcome[1]


def test_row_copy_refuses_buffers_it_cannot_take() -> None:
    """`RowCopy` holds raw addresses: rows that are not packed CPU byte rows of equal length
    (a float tensor's stride counts elements, not bytes) are refused when it is built."""
    module = native.native_extension(copy_pages.SOURCE, copy_pages.MODULE_NAME).module
    assert module is not None
    rows = torch.zeros(2, 8, dtype=torch.uint8)
    for src, dst in (
        ([torch.zeros(2, 8)], [rows]),  # float32 rows
        ([rows.t()], [torch.zeros(8, 2, dtype=torch.uint8)]),  # strided byte rows
        ([rows], [torch.zeros(2, 4, dtype=torch.uint8)]),  # row lengths differ
        ([rows, rows], [rows]),  # one destination per source
    ):
        with pytest.raises(ValueError, match="RowCopy"):
            RowCopy(cast(copy_pages.CopyModule, module), src, dst)


def test_the_compiled_call_raises_on_arguments_it_cannot_take() -> None:
    """The extension's own argument checks (no crash, no copy, buffers released: run under
    `python -X dev` in CI)."""
    module = native.native_extension(copy_pages.SOURCE, copy_pages.MODULE_NAME).module
    assert module is not None
    src = torch.arange(16, dtype=torch.uint8).view(2, 8)
    dst = torch.zeros(2, 8, dtype=torch.uint8)
    table = np.array([src.data_ptr(), 8, dst.data_ptr(), 8, 8], dtype=np.int64)
    one = np.ones(1, dtype=np.int64)
    copy = module.copy_pages
    with pytest.raises(TypeError):
        copy(table, 2, 2, one)  # four arguments
    with pytest.raises(TypeError):
        copy(table, "2", 2, one, one)  # a row count that is not an int
    with pytest.raises(TypeError):
        copy(table, 2, 2, [1], one)  # not a buffer
    with pytest.raises(TypeError, match="dst_pages must be an int64 array"):
        copy(table, 2, 2, one, one.astype(np.int32))
    with pytest.raises(TypeError, match="table must be an int64 array"):
        copy(table.astype(np.float64), 2, 2, one, one)
    with pytest.raises(ValueError, match="contiguous"):  # NumPy's refusal of the buffer
        copy(table, 2, 2, np.ones(4, dtype=np.int64)[::2], np.ones(2, dtype=np.int64))
    with pytest.raises(ValueError, match="5 entries per buffer"):
        copy(table[:4], 2, 2, one, one)
    with pytest.raises(ValueError, match="equal length"):
        copy(table, 2, 2, one, np.ones(2, dtype=np.int64))
    assert copy(table, 2, 2, one, np.array([2], dtype=np.int64)) == -1  # row 2 of 2
    assert int(dst.sum()) == 0
    assert copy(table, 2, 2, one, np.zeros(1, dtype=np.int64)) == 1
    assert dst[0].tolist() == src[1].tolist()


# --- loads (host -> device): every layer's rows in one compiled call ------------------------------


def load_twins(
    family: Family, layout: HostLayout
) -> tuple[list[DevicePool], list[HostPool[DevicePool]]]:
    """Two identical device pools, a host mirror of each (the second built inside
    `native.disabled()`), every host page filled with the same bytes by a backup."""
    pools = [make_device_pool(family, num_pages=24, num_layers=3) for _ in range(2)]
    for pool in pools:
        fill_random(pool, seed=5)
    cls = HOST_CLASSES[family]
    fast = cls(pools[0], layout=layout, size=30 * pools[0].page_size)
    with native.disabled():
        slow = cls(pools[1], layout=layout, size=30 * pools[1].page_size)
    rng = np.random.default_rng(11)
    num_device = pools[0].num_rows // pools[0].page_size
    src = rng.choice(np.arange(1, num_device), size=fast.num_pages, replace=True)
    plan = PagePlan(src.astype(np.int64), np.arange(fast.num_pages, dtype=np.int64))
    for pool, host in zip(pools, (fast, slow), strict=True):
        host.backup_planned(pool, plan)
        fill_random(pool, seed=6)  # the device rows a load overwrites differ from the host's
    return pools, [fast, slow]


def device_bytes(pool: DevicePool) -> list[bytes]:
    return [b.view(torch.uint8).numpy().tobytes() for b in pool.layer_buffers()]


def spy_loads(host: HostPool[DevicePool]) -> list[bool]:
    """Record every answer of `host`'s compiled load copy."""
    compiled = host._h2d_rows
    assert compiled is not None
    answers: list[bool] = []

    def spy(src: np.ndarray, dst: np.ndarray, buffers: list[int]) -> bool:
        answers.append(compiled(src, dst, buffers))
        return answers[-1]

    host._h2d_rows = spy  # type: ignore[assignment]
    return answers


def load_outcome(
    host: HostPool[DevicePool], pool: DevicePool, plan: PagePlan, layers: list[int]
) -> tuple[object, ...]:
    """What a planned load did: its reports (copy counts aside: the compiled call is one),
    the marked layers, the h2d counters and the device bytes; or the error's type."""
    completion = LayerCompletion(layers)
    try:
        loads = host.load_layers_planned(pool, plan, completion=completion, layer_ids=layers)
    except (IndexError, ValueError) as exc:
        return type(exc), completion.num_loaded, device_bytes(pool)
    reports = [(ld.layer_id, ld.num_pages, ld.num_bytes, ld.strategy, ld.event) for ld in loads]
    h2d = host.stats().h2d
    counters = (h2d.calls, h2d.pages, h2d.bytes, h2d.latency.count)
    return reports, completion.num_loaded, counters, device_bytes(pool)


@pytest.mark.parametrize("layout", [HostLayout.page_first, HostLayout.layer_first], ids=str)
@pytest.mark.parametrize("family", ["mha", "mamba"])
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_random_loads_give_the_same_device_bytes_as_the_numpy_path(
    family: Family, layout: HostLayout, data: st.DataObject
) -> None:
    pools, (fast, slow) = load_twins(family, layout)
    answers = spy_loads(fast)
    assert slow._h2d_rows is None  # the twin really runs the NumPy path
    num_device = pools[0].num_rows // pools[0].page_size
    non_empty = 0
    for _ in range(4):
        n = data.draw(st.integers(0, 10))
        non_empty += n > 0
        dst = data.draw(st.permutations(range(1, num_device)))[:n]
        src = data.draw(st.lists(st.integers(0, fast.num_pages - 1), min_size=n, max_size=n))
        layers = data.draw(st.permutations(list(fast.layer_ids)))
        layers = layers[: data.draw(st.integers(1, len(layers)))]
        plan = PagePlan(np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64))
        outcomes = [
            load_outcome(h, p, plan, layers) for h, p in zip((fast, slow), pools, strict=True)
        ]
        assert outcomes[0] == outcomes[1]
    # The compiled copy answered every non-empty load (an empty one is no gather), and was
    # called for each: an empty `answers` (the compiled path never ran) must not pass.
    assert answers == [True] * non_empty


def test_untrusted_loads_take_the_compiled_copy_and_keep_their_checks() -> None:
    pools, (fast, slow) = load_twins("mha", HostLayout.page_first)
    page = pools[0].page_size
    answers = spy_loads(fast)
    for host, pool in zip((fast, slow), pools, strict=True):
        loads = host.load_layers(pool, page_tokens([3, 1, 7], page), page_tokens([2, 9, 4], page))
        assert [ld.strategy for ld in loads] == [CopyStrategy.gather] * 3
    assert answers == [True]  # one call for the three layers
    assert device_bytes(pools[0]) == device_bytes(pools[1])
    for host, pool in zip((fast, slow), pools, strict=True):
        with pytest.raises(ReservedIndex):
            host.load_layers(pool, page_tokens([3], page), page_tokens([0], page))
        with pytest.raises(IndexOutOfRange):
            host.load_layers(pool, page_tokens([99], page), page_tokens([1], page))
    assert answers == [True]


def test_a_load_plan_out_of_range_raises_the_same_either_way() -> None:
    pools, (fast, slow) = load_twins("mha", HostLayout.layer_first)
    answers = spy_loads(fast)
    bad = PagePlan(np.array([2, 500], dtype=np.int64), np.array([3, 4], dtype=np.int64))
    before = device_bytes(pools[0])
    outcomes = [load_outcome(h, p, bad, [0, 1]) for h, p in zip((fast, slow), pools, strict=True)]
    assert outcomes[0] == outcomes[1] and outcomes[0][0] is IndexError
    assert answers == [False] and device_bytes(pools[0]) == before  # refused, nothing copied


def test_a_compiled_load_whose_mark_raises_fails_the_completion() -> None:
    """After the one compiled copy, layers are marked in order; a mark that raises fails the
    completion (its waiters wake with the error) as a failing per-layer copy does."""
    pools, (fast, _) = load_twins("mha", HostLayout.page_first)
    answers = spy_loads(fast)

    class Refusing(LayerCompletion):
        def mark_loaded(self, layer_id: int, event: torch.cuda.Event | None = None) -> None:
            if layer_id == 1:
                raise RuntimeError("consumer gone")
            super().mark_loaded(layer_id, event)

    completion = Refusing(fast.layer_ids)
    plan = PagePlan(np.array([0], dtype=np.int64), np.array([1], dtype=np.int64))
    with pytest.raises(RuntimeError, match="consumer gone"):
        fast.load_layers_planned(pools[0], plan, completion=completion)
    assert answers == [True]
    completion.wait(0, timeout=1)
    for layer in (1, 2):
        with pytest.raises(LayerLoadFailed, match=f"layer {layer}"):
            completion.wait(layer, timeout=1)
