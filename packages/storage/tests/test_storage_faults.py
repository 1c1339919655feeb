"""FaultInjectingStorage: failing, corrupting and delaying chosen pages."""

from __future__ import annotations

import pytest

from kvstrata.storage import FaultInjectingStorage, FaultRules, MemoryStorage
from kvstrata.storage import faults as faults_module
from kvstrata.storage.errors import InvalidParameter
from kvstrata.testkit.storage import page_payload

KEYS = [b"k1", b"k2", b"k3"]


def wrapped(**rules: object) -> tuple[FaultInjectingStorage, MemoryStorage]:
    inner = MemoryStorage(capacity_bytes=1 << 20)
    return FaultInjectingStorage(inner, **rules), inner  # pyright: ignore[reportArgumentType]


def test_failed_keys_are_not_written_and_miss() -> None:
    storage, inner = wrapped(fail_keys={b"k2"})
    assert storage.batch_set(KEYS, [page_payload(k, 32) for k in KEYS]) == [True, False, True]
    assert inner.batch_exists([b"k2"]) == 0
    inner.batch_set([b"k2"], [page_payload(b"k2", 32)])
    outs = [bytearray(32) for _ in KEYS]
    assert storage.batch_get(KEYS, outs) == [True, False, True]
    assert storage.batch_exists(KEYS) == 1
    assert storage.injected_failures == 3
    assert storage.stats().write_failures == 1 and storage.stats().misses == 1


def test_corrupt_keys_return_flipped_bytes() -> None:
    storage, _ = wrapped(corrupt_keys={b"k1"})
    storage.batch_set(KEYS, [page_payload(k, 32) for k in KEYS])
    outs = [bytearray(32) for _ in KEYS]
    assert storage.batch_get(KEYS, outs) == [True, True, True]
    assert bytes(outs[0]) != page_payload(b"k1", 32)
    assert [bytes(o) for o in outs[1:]] == [page_payload(k, 32) for k in KEYS[1:]]
    assert storage.injected_corruptions == 1


def test_delay_and_rule_swap(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(faults_module.time, "sleep", slept.append)
    storage, _ = wrapped(delay_s=0.25)
    storage.batch_set([b"a"], [b"x"])
    storage.batch_exists([b"a"])
    storage.batch_get([b"a"], [bytearray(1)])
    assert slept == [0.25, 0.25, 0.25]
    storage.set_rules(FaultRules(fail_keys=frozenset({b"a"})))
    assert storage.batch_exists([b"a"]) == 0
    assert slept == [0.25] * 3
    storage.set_rules(FaultRules())
    assert storage.batch_exists([b"a"]) == 1
    with pytest.raises(InvalidParameter):
        FaultRules(delay_s=-1)


def test_stats_and_integrity_come_from_the_inner_storage() -> None:
    inner = MemoryStorage(capacity_bytes=64)
    storage = FaultInjectingStorage(inner)
    storage.batch_set([b"a", b"b"], [b"x" * 32] * 2)
    storage.batch_set([b"c"], [b"x" * 32])  # evicts a
    stats = storage.stats()
    assert (stats.num_pages, stats.used_bytes, stats.evictions) == (2, 64, 1)
    assert storage.delete([b"b"]) == 1
    storage.clear()
    assert inner.stats().num_pages == 0
    storage.check_integrity()
