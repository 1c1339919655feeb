"""StoreCore against a model (a dict of what must be readable), with check_integrity after every
step: writes through both paths, leases that pin, releases, expiry, deletes, clears; memory
small enough that pages spill to disk and the disk small enough that it drops some."""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvstrata.l3_store.arena import ALIGNMENT
from kvstrata.l3_store.core import StoreCore, StoreParams, checksum
from kvstrata.storage import FileStorage
from kvstrata.storage.base import WriteResult

KEYS = [hashlib.sha256(b"%d" % i).digest()[:16] for i in range(12)]
SIZES = st.sampled_from([0, 100, ALIGNMENT, ALIGNMENT + 1, 3 * ALIGNMENT])


def _page(key: bytes, size: int) -> bytes:
    return (key * (size // len(key) + 1))[:size]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class CoreMachine(RuleBasedStateMachine):
    @initialize(with_disk=st.booleans())
    def build(self, with_disk: bool) -> None:
        self.tmp = tempfile.TemporaryDirectory()
        root = Path(self.tmp.name)
        self.arena = bytearray(8 * ALIGNMENT)
        disk = None
        if with_disk:
            (root / "disk").mkdir()
            disk = FileStorage(root / "disk", capacity_bytes=4 * (ALIGNMENT + 200), io_threads=1)
        self.clock = Clock()
        self.core = StoreCore(
            StoreParams(
                memory_bytes=8 * ALIGNMENT, high_watermark=0.9, low_watermark=0.6, lease_s=10.0
            ),
            arena=memoryview(self.arena),
            disk=disk,
            clock=self.clock,
        )
        self.sizes: dict[bytes, int] = {}  # every key ever written -> its size (content = key)
        self.leases: dict[int, list[bytes]] = {}

    def teardown(self) -> None:
        if hasattr(self, "tmp"):
            self.tmp.cleanup()

    @rule(key=st.sampled_from(KEYS), size=SIZES)
    def write(self, key: bytes, size: int) -> None:
        size = self.sizes.setdefault(key, size)  # a key names its content: one size per key
        [result] = self.core.write([key], [_page(key, size)])
        if result is WriteResult.PRESENT:
            assert self.core.exists([key]) == [True]

    @rule(key=st.sampled_from(KEYS), size=SIZES, fill_ok=st.booleans())
    def reserve_commit(self, key: bytes, size: int, fill_ok: bool) -> None:
        size = self.sizes.setdefault(key, size)
        grant = self.core.reserve([key], [size])
        if grant.reservation_id is None:
            return
        offset = grant.offsets[0]
        assert offset is not None
        self.arena[offset : offset + size] = _page(key, size)
        want = checksum(_page(key, size)) ^ (0 if fill_ok else 1)
        [result] = self.core.commit(grant.reservation_id, [want])
        assert result is (WriteResult.WRITTEN if fill_ok else WriteResult.FAILED)

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=4))
    def lease(self, keys: list[bytes]) -> None:
        grant = self.core.lease(keys)
        for key, ref in zip(keys, grant.refs, strict=True):
            if ref is not None:
                data = bytes(self.arena[ref.offset : ref.offset + ref.size])
                assert data == _page(key, self.sizes[key]), "a leased page holds other bytes"
                assert checksum(data) == ref.checksum
        if grant.lease_id is not None:
            self.leases[grant.lease_id] = keys

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        lease_id = data.draw(st.sampled_from(sorted(self.leases)))
        del self.leases[lease_id]
        self.core.release(lease_id)

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=4))
    def read(self, keys: list[bytes]) -> None:
        pages, sums = self.core.read(keys)
        for key, page, s in zip(keys, pages, sums, strict=True):
            if page is not None:
                assert page == _page(key, self.sizes[key]) and checksum(page) == s

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=3))
    def delete(self, keys: list[bytes]) -> None:
        self.core.delete(keys)

    @rule()
    def advance_clock(self) -> None:
        self.clock.now += 11.0
        self.core.expire()
        self.leases.clear()

    @rule()
    def clear(self) -> None:
        self.core.clear()

    @invariant()
    def integrity(self) -> None:
        if hasattr(self, "core"):
            self.core.check_integrity()
            stats = self.core.stats()
            assert stats.memory_used_bytes <= stats.memory_capacity_bytes
            assert stats.active_leases == len(self.leases)


CoreMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
test_core_machine = CoreMachine.TestCase
