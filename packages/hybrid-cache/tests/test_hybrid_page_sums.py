"""The compiled page checksums (`page_sums.c`, page_sums.py) are zlib's CRC-32: both of its
ways (carry-less multiplies, table) agree with `zlib.crc32` and the Python `page_checksums`
on every length and alignment, and a `StorageRunner` made with them backs up the same bytes
and checksums and, over pages corrupted in storage, lands, refuses and counts exactly what one
made inside `native.disabled()` does. Bad input is refused with an exception."""

from __future__ import annotations

import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.hybrid_cache import AckStatus, PrefetchPolicy
from kvstrata.hybrid_cache.page_sums import page_sums_module
from kvstrata.hybrid_cache.storage_io import (
    BackupTask,
    PrefetchTask,
    StorageRunner,
    checksum_key,
    page_checksums,
)
from kvstrata.pool import native
from kvstrata.pool_host import HostLayout
from kvstrata.storage import MemoryStorage, PageKeyer
from kvstrata.testkit.tiers import SHAPES, Shape, Tiers, make_tiers, storage_runner

MODULE = page_sums_module()
needs_module = pytest.mark.skipif(MODULE is None, reason="no compiled page sums (no compiler?)")


@needs_module
@pytest.mark.parametrize("table", [False, True])
@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=700), cut=st.integers(0, 15))
def test_the_checksums_are_zlibs_crc32(data: bytes, cut: int, table: bool) -> None:
    assert MODULE is not None
    view = memoryview(data)[min(cut, len(data)) :]  # any alignment
    views = [view, memoryview(data)]
    sums = MODULE.crc32_views(views, table)
    assert [bytes(s) for s in sums] == [zlib.crc32(v).to_bytes(4, "little") for v in views]
    assert [bytes(s) for s in sums] == page_checksums(views)
    right = [bytearray(s) for s in sums]
    assert MODULE.crc32_agree(views, right, table) == [True, True]
    wrong = [bytearray(s) for s in sums]
    wrong[0][cut % 4] ^= 1 << (cut % 8)
    assert MODULE.crc32_agree(views, wrong, table) == [False, True]
    short = [bytearray(bytes(sums[0])[:3]), bytearray(bytes(sums[1]) + b"\0")]
    assert MODULE.crc32_agree(views, short, table) == [False, False]


@needs_module
def test_every_length_across_the_folding_boundaries() -> None:
    assert MODULE is not None
    data = bytes((7 * i + 3) % 251 for i in range(1200))
    for length in range(1100):
        view = memoryview(data)[3 : 3 + length]
        want = zlib.crc32(view).to_bytes(4, "little")
        assert bytes(MODULE.crc32_views([view], False)[0]) == want, length
        assert bytes(MODULE.crc32_views([view], True)[0]) == want, length


@needs_module
def test_bad_input_is_refused_with_an_exception() -> None:
    assert MODULE is not None
    view = memoryview(bytes(8))
    with pytest.raises(TypeError, match="list"):
        MODULE.crc32_views((view,), False)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        MODULE.crc32_views([3], False)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="as many"):
        MODULE.crc32_agree([view], [], False)
    with pytest.raises(TypeError):
        MODULE.crc32_agree([view], [None], False)  # type: ignore[list-item]
    with pytest.raises(TypeError):
        MODULE.crc32_views([view])  # type: ignore[call-arg]


def _runner(
    tiers: Tiers, storage: MemoryStorage, acks: list[tuple[int, AckStatus, int]]
) -> StorageRunner:
    return storage_runner(
        tiers, storage, lambda op, status, done, _: acks.append((op, status, done)), batch_pages=3
    )


def _serve(
    tiers: Tiers, num_pages: int, corrupt: set[int], unsummed: set[int]
) -> tuple[object, ...]:
    """Back up `num_pages` host pages (0, 1, ...) to a new store, corrupt the stored pages
    `corrupt` and drop the checksums of `unsummed`, then prefetch them all into host pages
    16, 17, ...: the acks, stats, stored items and the landed host bytes."""
    for host in tiers.hosts.values():  # known bytes in the sources, zeros where they land
        size = host.page_size_bytes
        for p in range(32):
            fill = bytes((p * 31 + i) % 256 for i in range(size)) if p < 16 else bytes(size)
            host.write_page_from(p, fill)
    storage = MemoryStorage(capacity_bytes=1 << 24)
    acks: list[tuple[int, AckStatus, int]] = []
    runner = _runner(tiers, storage, acks)
    keys = PageKeyer(page_size=tiers.page_size).page_keys(list(range(num_pages * tiers.page_size)))
    names = tiers.group.member_names
    src = {name: list[int | None](range(num_pages)) for name in names}
    dst = {name: list[int | None](range(16, 16 + num_pages)) for name in names}
    runner.run_backups(
        [BackupTask(op_id=1, keys=tuple(keys), pages=tiers.group.check_keyed_pages(keys, src))]
    )
    stored = list((k, bytes(v)) for k, v in storage._pages.items())
    for name in names:
        for i in corrupt:
            page = storage._pages[tiers.group.storage_key(name, keys[i])]
            page[len(page) // 2] ^= 0x5A
        for i in unsummed:
            storage.delete([checksum_key(tiers.group.storage_key(name, keys[i]))])
    runner.run_prefetches(
        [
            PrefetchTask(
                op_id=2,
                keys=tuple(keys),
                pages=tiers.group.check_keyed_pages(keys, dst),
                policy=PrefetchPolicy.WAIT_COMPLETE,
                deadline=None,
            )
        ]
    )
    landed = [bytes(host.page_view(p)) for host in tiers.hosts.values() for p in range(16, 32)]
    stats = runner.stats.snapshot()
    return (tuple(acks), stats.storage_faults, stats.pages, stats.bytes, stored, landed)


@needs_module
@pytest.mark.parametrize("shape", SHAPES)
@settings(max_examples=30, deadline=None)
@given(
    num_pages=st.integers(1, 8),
    corrupt=st.sets(st.integers(0, 7), max_size=3),
    unsummed=st.sets(st.integers(0, 7), max_size=2),
)
def test_a_runner_with_compiled_sums_backs_up_and_checks_as_the_python_one(
    shape: Shape, num_pages: int, corrupt: set[int], unsummed: set[int]
) -> None:
    corrupt = {i for i in corrupt if i < num_pages}
    unsummed = {i for i in unsummed if i < num_pages}
    compiled_tiers = make_tiers(shape, layout=HostLayout.page_first)
    compiled = _serve(compiled_tiers, num_pages, corrupt, unsummed)
    assert _runner(compiled_tiers, MemoryStorage(capacity_bytes=1), [])._sums is not None
    with native.disabled():
        python_tiers = make_tiers(shape, layout=HostLayout.page_first)
        assert _runner(python_tiers, MemoryStorage(capacity_bytes=1), [])._sums is None
        python = _serve(python_tiers, num_pages, corrupt, unsummed)
    assert compiled == python
    acks = compiled[0]
    assert isinstance(acks, tuple) and acks[0] == (1, AckStatus.DONE, num_pages)
    first_bad = min(corrupt | unsummed, default=num_pages)
    assert acks[1][2] <= first_bad  # a corrupt or unchecked page is never landed
