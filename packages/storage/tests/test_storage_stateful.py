"""MemoryStorage and FileStorage against a dict model of a byte-capacity LRU store, with
check_integrity() after every step."""

from __future__ import annotations

import shutil
import tempfile
from collections import OrderedDict
from pathlib import Path

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvstrata.storage import FileStorage, MemoryStorage, Storage
from kvstrata.testkit.storage import page_cost, page_payload

KEYS = [f"k{i}".encode() for i in range(8)]
SIZES = [0, 16, 40, 100]
key_lists = st.lists(st.sampled_from(KEYS), min_size=1, max_size=5)


class LRUModel:
    """What a byte-capacity LRU store must hold: key -> payload, least recently used first."""

    def __init__(self, capacity_bytes: int, cost: dict[int, int]) -> None:
        self.capacity_bytes = capacity_bytes
        self.cost = cost
        self.pages: OrderedDict[bytes, bytes] = OrderedDict()
        self.evictions = 0

    def used(self) -> int:
        return sum(self.cost[len(v)] for v in self.pages.values())

    def set(self, keys: list[bytes], payloads: list[bytes]) -> list[bool]:
        batch = set(keys)
        out: list[bool] = []
        for key, payload in zip(keys, payloads, strict=True):
            if key in self.pages:
                self.pages.move_to_end(key)
                out.append(True)
                continue
            need = self.used() + self.cost[len(payload)] - self.capacity_bytes
            victims: list[bytes] = []
            for candidate, page in self.pages.items():
                if need <= 0:
                    break
                if candidate not in batch:
                    victims.append(candidate)
                    need -= self.cost[len(page)]
            if need > 0:
                out.append(False)
                continue
            for victim in victims:
                del self.pages[victim]
            self.evictions += len(victims)
            self.pages[key] = payload
            out.append(True)
        return out

    def get(self, keys: list[bytes]) -> list[bytes | None]:
        found = [self.pages.get(k) for k in keys]
        for key, page in zip(keys, found, strict=True):
            if page is not None:
                self.pages.move_to_end(key)
        return found

    def exists(self, keys: list[bytes]) -> int:
        for i, key in enumerate(keys):
            if key not in self.pages:
                return i
        return len(keys)


class StorageMachine(RuleBasedStateMachine):
    """Subclasses say which backend `make` builds."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="kvstrata-storage-sm-"))
        self.storage: Storage = MemoryStorage(capacity_bytes=0)
        self.model = LRUModel(0, {})

    def make(self, capacity_bytes: int) -> Storage:
        raise NotImplementedError("subclasses build the backend under test")

    @initialize(capacity_pages=st.integers(min_value=0, max_value=6))
    def start(self, capacity_pages: int) -> None:
        probe = self.make(0)
        cost = {size: page_cost(probe, size) for size in SIZES}
        capacity = capacity_pages * cost[40]
        self.storage = self.make(capacity)
        self.model = LRUModel(capacity, cost)

    @rule(
        keys=key_lists,
        sizes=st.lists(st.sampled_from(SIZES), min_size=5, max_size=5),
        as_views=st.booleans(),
    )
    def set(self, keys: list[bytes], sizes: list[int], as_views: bool) -> None:
        # A key names its content: a key's payload depends on the key and on its size, and the
        # model keeps whatever was stored first. `as_views`: flat memoryviews (what the tiers
        # pass, checked batch-wide) instead of bytes.
        payloads = [page_payload(k, s) for k, s in zip(keys, sizes, strict=False)]
        buffers = [memoryview(p) for p in payloads] if as_views else payloads
        assert self.storage.batch_set(keys, buffers) == self.model.set(keys, payloads)

    @rule(keys=key_lists, as_views=st.booleans())
    def get(self, keys: list[bytes], as_views: bool) -> None:
        expected = self.model.get(keys)
        outs = [bytearray(len(p) if p is not None else 1) for p in expected]
        buffers = [memoryview(o) for o in outs] if as_views else outs
        found = self.storage.batch_get(keys, buffers)
        assert found == [p is not None for p in expected]
        for out, page in zip(outs, expected, strict=True):
            if page is not None:
                assert bytes(out) == page

    @rule(keys=key_lists)
    def exists(self, keys: list[bytes]) -> None:
        assert self.storage.batch_exists(keys) == self.model.exists(keys)

    @rule(keys=key_lists)
    def delete(self, keys: list[bytes]) -> None:
        present = {k for k in keys if k in self.model.pages}
        for key in present:
            del self.model.pages[key]
        assert self.storage.delete(keys) == len(present)

    @rule()
    def clear(self) -> None:
        self.storage.clear()
        self.model.pages.clear()

    @invariant()
    def matches_model(self) -> None:
        self.storage.check_integrity()
        stats = self.storage.stats()
        assert stats.used_bytes == self.model.used() <= self.model.capacity_bytes
        assert stats.num_pages == len(self.model.pages)
        assert stats.evictions == self.model.evictions
        assert isinstance(self.storage, MemoryStorage | FileStorage)
        assert self.storage.lru_keys() == list(self.model.pages)

    def teardown(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


class MemoryMachine(StorageMachine):
    def make(self, capacity_bytes: int) -> Storage:
        return MemoryStorage(capacity_bytes=capacity_bytes)


class FileMachine(StorageMachine):
    """A batch's pages written and read on 4 threads (ranges of 2+ pages each)."""

    io_threads = 4

    def make(self, capacity_bytes: int) -> Storage:
        return FileStorage(
            self.dir, capacity_bytes=capacity_bytes, namespace="sm", io_threads=self.io_threads
        )

    @invariant()
    def disk_holds_exactly_the_indexed_pages(self) -> None:
        on_disk = {bytes.fromhex(p.name.removesuffix(".page")) for p in self.dir.rglob("*.page")}
        assert on_disk == set(self.model.pages)
        assert list(self.dir.rglob(".*.tmp")) == []


class SequentialFileMachine(FileMachine):
    """Everything in the calling thread: must match the same model, LRU order included."""

    io_threads = 1


TestMemoryStorageMachine = MemoryMachine.TestCase
TestFileStorageMachine = FileMachine.TestCase
TestSequentialFileStorageMachine = SequentialFileMachine.TestCase
