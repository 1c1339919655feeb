"""Host <-> storage moves: prefetch (storage -> host) and backup (host -> storage).

Prefetch of one op, with keys k0..k(n-1) of a prefix and per member the host page of each key:

    1. batch_exists per member over the keys it lists -> which pages could arrive;
       restorable_pages over that -> bound b: nothing past b can ever be a hit, so it is not read
    2. for key ranges [a, a + batch) below b, while the op is not stopped and (timeout policy)
       before its deadline: one batch_get per member straight into its host pages
    3. after each range: ready = restorable_pages(landed) -> what the request may take now
    4. a storage call that raises, returns False, or outlasts storage_call_timeout_s ends the op
       at the last good page (status partial), counted in storage_faults

A page read by a call that failed or timed out is never counted as landed, so the host pages
past `num_pages_done` may hold anything and the tree must not use them: nothing wrong is ever
loaded. The ack comes only after the worker's last storage call returned, because until then
that call may still be writing into the op's host pages.

Checksums (`verify_checksums`, on by default): backup stores beside each page a 4-byte CRC-32 of
its bytes under `<page key>#crc32`, and prefetch reads both and counts a page as landed only when
they agree. So a backend that returns a flipped byte (a memory or network fault, a buggy remote
tier) costs a shorter hit, never wrong KV. A page stored without its checksum (by a writer with
checks off) is then a miss. CRC-32 because the threat is corruption, not an adversary: the page
key already names the content, and zlib's CRC runs at memory speed.

Backup merges consecutive ops: one batch_exists per op and member (leading keys already stored
are skipped), then the remaining pages of all merged ops in shared batch_set calls.
"""

from __future__ import annotations

import logging
import operator
import struct
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import compress, groupby, repeat
from typing import TypeAlias, cast

from kvstrata.hybrid_cache.group import PoolGroup
from kvstrata.hybrid_cache.metrics import ControllerStats, Direction, FaultReason
from kvstrata.hybrid_cache.ops import AckStatus, OpKind, PrefetchPolicy
from kvstrata.hybrid_cache.restore import restorable_pages
from kvstrata.storage import Storage

logger = logging.getLogger(__name__)

Finish = Callable[[int, AckStatus, int, BaseException | None], None]

CHECKSUM_SUFFIX = b"#crc32"
_CRC_BYTES = 4


def checksum_key(page_key: bytes) -> bytes:
    """The storage key of the CRC-32 stored beside the page of `page_key`."""
    return page_key + CHECKSUM_SUFFIX


_CRC_FORMAT = struct.Struct("<I")  # a CRC-32 as its 4 little-endian bytes


def page_checksum(view: memoryview) -> bytes:
    return _CRC_FORMAT.pack(zlib.crc32(view))


def page_checksums(views: Sequence[memoryview]) -> list[bytes]:
    """`page_checksum` of each view, by C-level maps (no Python frame per page)."""
    return list(map(_CRC_FORMAT.pack, map(zlib.crc32, views)))


def checksum_keys(page_keys: Sequence[bytes]) -> list[bytes]:
    """`checksum_key` of each key, by a C-level map."""
    return list(map(operator.add, page_keys, repeat(CHECKSUM_SUFFIX)))


@dataclass(kw_only=True, eq=False)
class PrefetchTask:
    op_id: int
    keys: tuple[bytes, ...]
    pages: dict[str, tuple[int | None, ...]]
    policy: PrefetchPolicy
    deadline: float | None
    stop: threading.Event = field(default_factory=threading.Event)
    ready_pages: int = 0
    """Leading key pages restorable now; only grows; written by the prefetch worker."""


@dataclass(kw_only=True, eq=False)
class BackupTask:
    op_id: int
    keys: tuple[bytes, ...]
    pages: dict[str, tuple[int | None, ...]]


#: One member page of one key, in one storage call: (member, position, page, key). A plain
#: tuple, made by `zip` in C: a NamedTuple's `__new__` would cost a Python call per page.
_Slot: TypeAlias = tuple[str, int, int, bytes]


# Field getters in C: a batch's columns are read without a Python step per page.
_MEMBER = operator.itemgetter(0)
_POSITION = operator.itemgetter(1)
_PAGE = operator.itemgetter(2)
_KEY = operator.itemgetter(3)


@dataclass(kw_only=True, eq=False)
class StorageRunner:
    """Runs prefetch and backup tasks on their workers, with what the controller hands it."""

    group: PoolGroup
    storage: Storage
    stats: ControllerStats
    finish: Finish
    clock: Callable[[], float]
    batch_pages: int
    call_timeout_s: float | None
    verify_checksums: bool
    _page_bytes: dict[str, int] = field(init=False)

    def __post_init__(self) -> None:
        group = self.group
        self._page_bytes = {name: group.page_bytes(name) for name in group.member_names}

    # --- prefetch --------------------------------------------------------------------------------

    def run_prefetches(self, tasks: list[PrefetchTask]) -> None:
        for task in tasks:
            self._prefetch(task)

    def _prefetch(self, task: PrefetchTask) -> None:
        n = len(task.keys)
        rules = self.group.rules
        if n == 0:
            self.finish(task.op_id, AckStatus.DONE, 0, None)
            return
        if self._should_stop(task):
            self.finish(task.op_id, AckStatus.PARTIAL, 0, None)
            return
        listed = {name: self._listed(task, name) for name in rules}
        possible = {name: [False] * n for name in rules}
        error: BaseException | None = None
        for name, slots in listed.items():
            try:
                found = self._exists(slots)
            except Exception as exc:  # a backend error ends this prefetch; the worker goes on
                logger.warning("prefetch: batch_exists raised", exc_info=True)
                self.stats.count_fault(FaultReason.ERROR)
                error, found = exc, 0
            flags = possible[name]
            for position in map(_POSITION, slots[:found]):
                flags[position] = True
        bound = restorable_pages(rules, possible, n).num_pages

        landed = {name: [False] * n for name in rules}
        for lo in range(0, bound, self.batch_pages):
            if self._should_stop(task):
                break
            hi = min(lo + self.batch_pages, bound)
            ended = False
            for name, slots in listed.items():
                flags = possible[name]
                batch = [s for s in slots if lo <= s[1] < hi and flags[s[1]]]
                ok, call_error = self._get(name, batch)
                arrived = landed[name]
                for position, good in zip(map(_POSITION, batch), ok, strict=True):
                    arrived[position] = good
                if call_error is not None:
                    error = call_error
                ended = ended or not all(ok)
            task.ready_pages = restorable_pages(rules, landed, n).num_pages
            if ended:
                break
        done = restorable_pages(rules, landed, n).num_pages
        task.ready_pages = done
        status = AckStatus.DONE if done == n else AckStatus.PARTIAL
        self.finish(task.op_id, status, done, error)

    def _should_stop(self, task: PrefetchTask) -> bool:
        if task.stop.is_set():
            return True
        return task.deadline is not None and self.clock() >= task.deadline

    def _listed(self, task: PrefetchTask | BackupTask, name: str) -> list[_Slot]:
        keys = self.group.storage_keys(name, task.keys)
        pages = task.pages[name]
        if None not in pages:  # every key has a page (Full): the tuples made by zip in C
            return cast("list[_Slot]", list(zip(repeat(name), range(len(pages)), pages, keys)))
        return [(name, i, page, keys[i]) for i, page in enumerate(pages) if page is not None]

    def _exists(self, slots: list[_Slot]) -> int:
        """How many of `slots`, from the first, are stored (with their checksums)."""
        if not slots:
            return 0
        page_keys = list(map(_KEY, slots))
        if not self.verify_checksums:
            return self.storage.batch_exists(page_keys)
        # Each page key followed by its checksum's, interleaved by two slice assignments in C.
        keys = page_keys * 2
        keys[::2] = page_keys
        keys[1::2] = checksum_keys(page_keys)
        return self.storage.batch_exists(keys) // 2

    def _get(self, name: str, batch: list[_Slot]) -> tuple[list[bool], BaseException | None]:
        """Read `batch` into its host pages: per page whether it landed intact, as a run of
        True then only False (the prefetch ends at the first bad page)."""
        if not batch:
            return [], None
        target = self.group.get_targets(name, list(map(_PAGE, batch)))
        keys = list(map(_KEY, batch))
        buffers: list[memoryview | bytearray] = list(target.buffers)
        sums = [bytearray(_CRC_BYTES) for _ in batch] if self.verify_checksums else []
        if self.verify_checksums:
            keys += checksum_keys(keys)
            buffers += sums
        start = time.perf_counter()
        try:
            found = self.storage.batch_get(keys, buffers)
        except Exception as exc:  # a backend error ends this prefetch; the worker goes on
            logger.warning("prefetch: batch_get of %d pages raised", len(batch), exc_info=True)
            self.stats.count_fault(FaultReason.ERROR)
            return [False] * len(batch), exc
        elapsed = time.perf_counter() - start
        if self.call_timeout_s is not None and elapsed > self.call_timeout_s:
            self.stats.count_fault(FaultReason.TIMEOUT)
            return [False] * len(batch), None
        ok = found[: len(batch)]
        if self.verify_checksums:
            # A page without its checksum is a miss; one whose bytes disagree with it is corrupt.
            ok = list(map(operator.and_, ok, found[len(batch) :]))
            intact = [
                good and page_checksum(view) == bytes(expected)
                for good, view, expected in zip(ok, target.buffers, sums, strict=True)
            ]
            corrupt = sum(ok) - sum(intact)
            if corrupt:
                self.stats.count_fault(FaultReason.CORRUPT, corrupt)
            misses = len(batch) - sum(ok)
            ok = intact
        else:
            misses = len(batch) - sum(ok)
        if misses:
            self.stats.count_fault(FaultReason.MISS, misses)
        good = 0
        while good < len(ok) and ok[good]:
            good += 1
        ok = [True] * good + [False] * (len(ok) - good)
        target.commit(ok)
        self.stats.count_transfer(
            Direction.STORAGE_GET,
            num_pages=good,
            num_bytes=good * self._page_bytes[name],
            seconds=elapsed,
        )
        return ok, None

    # --- backup ----------------------------------------------------------------------------------

    def run_backups(self, tasks: list[BackupTask]) -> None:
        self.stats.count_merged(OpKind.BACKUP, len(tasks) - 1)
        rules = self.group.rules
        stored = {t.op_id: {name: [False] * len(t.keys) for name in rules} for t in tasks}
        errors: dict[int, BaseException] = {}
        to_set: list[_Slot] = []
        owners: list[int] = []  # per slot of to_set: its task's index in `tasks`
        for index, task in enumerate(tasks):
            for name in rules:
                slots = self._listed(task, name)
                try:
                    found = self._exists(slots)
                except Exception as exc:  # this op fails alone; the batch goes on
                    logger.warning("backup: batch_exists raised", exc_info=True)
                    self.stats.count_fault(FaultReason.ERROR)
                    errors[task.op_id] = exc
                    continue
                self.stats.count_backup_skipped(found)
                flags = stored[task.op_id][name]
                for position in map(_POSITION, slots[:found]):
                    flags[position] = True
                rest = slots[found:]
                to_set += rest
                owners += repeat(index, len(rest))
        for lo in range(0, len(to_set), self.batch_pages):
            chunk = to_set[lo : lo + self.batch_pages]
            chunk_owners = owners[lo : lo + self.batch_pages]
            ok, error = self._set(chunk)
            # Only the pages stored change a flag (every flag starts False).
            pairs = zip(chunk, chunk_owners, strict=True)
            for (member, position, _, _), owner in compress(pairs, ok):
                stored[tasks[owner].op_id][member][position] = True
            if error is not None:
                for owner in set(chunk_owners):
                    errors[tasks[owner].op_id] = error
        for task in tasks:
            done = restorable_pages(rules, stored[task.op_id], len(task.keys)).num_pages
            error = errors.get(task.op_id)
            if done == len(task.keys):
                self.finish(task.op_id, AckStatus.DONE, done, None)
            elif error is not None and done == 0:
                self.finish(task.op_id, AckStatus.FAILED, 0, error)
            else:
                self.finish(task.op_id, AckStatus.PARTIAL, done, error)

    def _set(self, slots: Sequence[_Slot]) -> tuple[list[bool], BaseException | None]:
        views = self._sources(slots)
        keys = list(map(_KEY, slots))
        buffers: list[memoryview | bytes] = list(views)
        if self.verify_checksums:
            # Pages first, then their checksums: a reader trusts a page only with its checksum,
            # and a page whose checksum write failed is reported not stored.
            keys += checksum_keys(keys)
            buffers += page_checksums(views)
        start = time.perf_counter()
        try:
            results = self.storage.batch_set(keys, buffers)
        except Exception as exc:  # these pages fail; other chunks and ops go on
            logger.warning("backup: batch_set of %d pages raised", len(slots), exc_info=True)
            self.stats.count_fault(FaultReason.ERROR)
            return [False] * len(slots), exc
        ok = results[: len(slots)]
        if self.verify_checksums:
            ok = list(map(operator.and_, ok, results[len(slots) :]))  # page and checksum, in C
        num_ok = ok.count(True)
        if num_ok < len(ok):
            self.stats.count_fault(FaultReason.WRITE_FAILED, len(ok) - num_ok)
        stored = Counter(map(_MEMBER, compress(slots, ok)))  # pages per member, counted in C
        num_bytes = sum(self._page_bytes[name] * n for name, n in stored.items())
        self.stats.count_transfer(
            Direction.STORAGE_SET,
            num_pages=num_ok,
            num_bytes=num_bytes,
            seconds=time.perf_counter() - start,
        )
        return ok, None

    def _sources(self, slots: Sequence[_Slot]) -> list[memoryview]:
        """The host bytes of each slot's page, one `set_sources` call per run of one member."""
        views: list[memoryview] = []
        for member, run in groupby(slots, _MEMBER):
            views += self.group.set_sources(member, list(map(_PAGE, run)))
        return views
