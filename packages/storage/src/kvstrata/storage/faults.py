"""FaultInjectingStorage: a wrapper that fails, delays or corrupts chosen pages, for tests of the
tiers above (prefetch ending at the last good page, acknowledgements carrying errors, ...)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from kvstrata.storage.base import Occupancy, Storage, StorageStats, WriteResult
from kvstrata.storage.errors import InvalidParameter


@dataclass(frozen=True, kw_only=True)
class FaultRules:
    """What to inject. `fail_keys`: get is a miss, set returns False (nothing stored), exists
    stops there. `corrupt_keys`: get returns True with bytes flipped in the caller's buffer (a
    backend that delivers bad data without noticing). `delay_s`: sleep before every batch call."""

    fail_keys: frozenset[bytes] = frozenset()
    corrupt_keys: frozenset[bytes] = frozenset()
    delay_s: float = 0.0

    def __post_init__(self) -> None:
        if self.delay_s < 0:
            raise InvalidParameter(f"delay_s must be >= 0, got {self.delay_s}")


class FaultInjectingStorage(Storage):
    """Wraps `inner`; every call goes to it except the injected faults.

    Its own `stats()` counts the calls made through the wrapper; occupancy, evictions and
    corrupt pages are the inner storage's (they happen there). `rules` can be
    swapped while in use (`set_rules`); a call sees one set of rules from start to end.
    """

    def __init__(
        self,
        inner: Storage,
        *,
        fail_keys: Iterable[bytes] = (),
        corrupt_keys: Iterable[bytes] = (),
        delay_s: float = 0.0,
    ) -> None:
        super().__init__()
        self.inner = inner
        self.max_key_bytes = inner.max_key_bytes
        self._rules_lock = threading.Lock()
        self._rules = FaultRules(
            fail_keys=frozenset(fail_keys), corrupt_keys=frozenset(corrupt_keys), delay_s=delay_s
        )
        self.injected_failures = 0
        self.injected_corruptions = 0

    @property
    def rules(self) -> FaultRules:
        return self._rules

    def set_rules(self, rules: FaultRules) -> None:
        """Replace the rules for calls that start after this one."""
        self._rules = rules

    def stats(self) -> StorageStats:
        inner = self.inner.stats()
        return replace(
            super().stats(), evictions=inner.evictions, corrupt_pages=inner.corrupt_pages
        )

    def _begin(self) -> FaultRules:
        rules = self._rules
        if rules.delay_s:
            time.sleep(rules.delay_s)
        return rules

    def _count(self, *, failures: int = 0, corruptions: int = 0) -> None:
        with self._rules_lock:
            self.injected_failures += failures
            self.injected_corruptions += corruptions

    def _exists_prefix(self, keys: Sequence[bytes]) -> int:
        rules = self._begin()
        limit = next((i for i, k in enumerate(keys) if k in rules.fail_keys), len(keys))
        found = self.inner.batch_exists(keys[:limit]) if limit else 0
        if found == limit < len(keys):
            self._count(failures=1)
        return found

    def _get_into(self, keys: Sequence[bytes], views: list[memoryview]) -> list[bool]:
        rules = self._begin()
        passed = [i for i, k in enumerate(keys) if k not in rules.fail_keys]
        found = [False] * len(keys)
        inner_found = self.inner.batch_get([keys[i] for i in passed], [views[i] for i in passed])
        for i, ok in zip(passed, inner_found, strict=True):
            found[i] = ok
        corrupted = 0
        for i, ok in enumerate(found):
            if ok and keys[i] in rules.corrupt_keys and views[i].nbytes:
                view = views[i]
                view[0] ^= 0xFF
                view[view.nbytes // 2] ^= 0x5A
                corrupted += 1
        self._count(failures=len(keys) - len(passed), corruptions=corrupted)
        return found

    def _set_from(self, keys: Sequence[bytes], views: list[memoryview]) -> list[WriteResult]:
        rules = self._begin()
        passed = [i for i, k in enumerate(keys) if k not in rules.fail_keys]
        results = [WriteResult.FAILED] * len(keys)
        stored = self.inner.batch_set_results([keys[i] for i in passed], [views[i] for i in passed])
        for i, result in zip(passed, stored, strict=True):
            results[i] = result
        self._count(failures=len(keys) - len(passed))
        return results

    def _delete(self, keys: Sequence[bytes]) -> int:
        return self.inner.delete(keys)

    def _clear(self) -> None:
        self.inner.clear()

    def _occupancy(self) -> Occupancy:
        stats = self.inner.stats()
        return Occupancy(stats.num_pages, stats.used_bytes, stats.capacity_bytes)

    def check_integrity(self) -> None:
        self.inner.check_integrity()
