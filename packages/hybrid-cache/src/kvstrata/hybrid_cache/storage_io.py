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
from kvstrata.hybrid_cache.page_sums import PageSums, page_sums_module
from kvstrata.hybrid_cache.restore import RestoreKind, restorable_pages
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
    #: The compiled checksums of a batch (page_sums.py), or None: the Python ones.
    _sums: PageSums | None = field(init=False)

    def __post_init__(self) -> None:
        group = self.group
        self._page_bytes = {name: group.page_bytes(name) for name in group.member_names}
        self._sums = page_sums_module() if self.verify_checksums else None

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
        if len(rules) == 1:
            ((name, rule),) = rules.items()
            if rule.kind is RestoreKind.PREFIX and None not in task.pages[name]:
                self._prefetch_prefix(task, name)
                return
        self._prefetch_members(task)

    def _prefetch_members(self, task: PrefetchTask) -> None:
        """`_prefetch` of any group (at least one key): per page a slot, per member
        availability flags."""
        n = len(task.keys)
        rules = self.group.rules
        listed = {name: self._listed(task, name) for name in rules}
        possible = {name: [False] * n for name in rules}
        error: BaseException | None = None
        for name, slots in listed.items():
            found, exists_error = self._prefetch_exists(list(map(_KEY, slots)))
            if exists_error is not None:
                error = exists_error
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

    def _prefetch_prefix(self, task: PrefetchTask, name: str) -> None:
        """`_prefetch` of a group whose one member restores a prefix (Full attention) and has
        a page for every key: the same storage calls, counters and ack, without a slot tuple
        or availability flag per page. The keys stored (with their checksums) bound the
        prefix; what landed is the leading run of pages the batch_get calls delivered."""
        keys = self.group.storage_keys(name, task.keys)
        pages = cast("tuple[int, ...]", task.pages[name])
        bound, error = self._prefetch_exists(keys)
        done = 0
        for lo in range(0, bound, self.batch_pages):
            if self._should_stop(task):
                break
            hi = min(lo + self.batch_pages, bound)
            ok, call_error = self._get_pages(name, keys[lo:hi], list(pages[lo:hi]))
            if call_error is not None:
                error = call_error
            landed = ok.count(True)  # a run of True, then only False
            done = lo + landed
            task.ready_pages = done
            if landed < hi - lo:
                break
        task.ready_pages = done
        status = AckStatus.DONE if done == len(keys) else AckStatus.PARTIAL
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
        return self._exists_keys(page_keys)

    def _prefetch_exists(self, page_keys: list[bytes]) -> tuple[int, BaseException | None]:
        """A prefetch's `_exists_keys` (0 for no keys): how many are stored, and the error a
        raising backend gave (logged, counted as an ERROR fault, 0 stored), else None. The
        error ends that prefetch; the worker goes on."""
        if not page_keys:
            return 0, None
        try:
            return self._exists_keys(page_keys), None
        except Exception as exc:
            logger.warning("prefetch: batch_exists raised", exc_info=True)
            self.stats.count_fault(FaultReason.ERROR)
            return 0, exc

    def _exists_keys(self, page_keys: list[bytes], sum_keys: list[bytes] | None = None) -> int:
        """How many of `page_keys` (non-empty), from the first, are stored (with their
        checksums, whose keys `sum_keys` are when the caller made them already). Trusted
        storage call: the keys are the tier's own page keys (bytes)."""
        if not self.verify_checksums:
            return self.storage.batch_exists(page_keys, trusted=True)
        # Each page key followed by its checksum's, interleaved by two slice assignments in C.
        keys = page_keys * 2
        keys[::2] = page_keys
        keys[1::2] = checksum_keys(page_keys) if sum_keys is None else sum_keys
        return self.storage.batch_exists(keys, trusted=True) // 2

    def _get(self, name: str, batch: list[_Slot]) -> tuple[list[bool], BaseException | None]:
        """Read `batch` into its host pages: per page whether it landed intact, as a run of
        True then only False (the prefetch ends at the first bad page)."""
        if not batch:
            return [], None
        return self._get_pages(name, list(map(_KEY, batch)), list(map(_PAGE, batch)))

    def _get_pages(
        self, name: str, keys: list[bytes], pages: list[int]
    ) -> tuple[list[bool], BaseException | None]:
        """`_get` of pages of one member: `keys[k]` is read into host page `pages[k]`."""
        num = len(keys)
        target = self.group.get_targets(name, pages)
        # Trusted storage call: bytes keys, and flat writable byte views (host page views or
        # staging buffers, and the checksums' bytearrays viewed here).
        buffers: list[memoryview] = list(target.buffers)
        sums = [bytearray(_CRC_BYTES) for _ in range(num)] if self.verify_checksums else []
        if self.verify_checksums:
            keys += checksum_keys(keys)
            buffers += map(memoryview, sums)
        start = time.perf_counter()
        try:
            found = self.storage.batch_get(keys, buffers, trusted=True)
        except Exception as exc:  # a backend error ends this prefetch; the worker goes on
            logger.warning("prefetch: batch_get of %d pages raised", num, exc_info=True)
            self.stats.count_fault(FaultReason.ERROR)
            return [False] * num, exc
        elapsed = time.perf_counter() - start
        if self.call_timeout_s is not None and elapsed > self.call_timeout_s:
            self.stats.count_fault(FaultReason.TIMEOUT)
            return [False] * num, None
        ok = found[:num]
        if self.verify_checksums:
            # A page without its checksum is a miss; one whose bytes disagree with it is corrupt.
            # Every page's CRC is compared by C-level maps (a missing page's too: its flag is
            # False either way).
            ok = list(map(operator.and_, ok, found[num:]))
            if self._sums is not None:
                agree = self._sums.crc32_agree(target.buffers, sums, False)
            else:
                agree = list(map(operator.eq, page_checksums(target.buffers), map(bytes, sums)))
            intact = list(map(operator.and_, ok, agree))
            corrupt = ok.count(True) - intact.count(True)
            if corrupt:
                self.stats.count_fault(FaultReason.CORRUPT, corrupt)
            misses = num - ok.count(True)
            ok = intact
        else:
            misses = num - ok.count(True)
        if misses:
            self.stats.count_fault(FaultReason.MISS, misses)
        good = ok.index(False) if False in ok else num  # the leading run, found in C
        ok = [True] * good + [False] * (num - good)
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
        if len(rules) == 1:
            ((name, rule),) = rules.items()
            if rule.kind is RestoreKind.PREFIX and all(None not in t.pages[name] for t in tasks):
                self._run_prefix_backups(tasks, name)
                return
        self._run_member_backups(tasks)

    def _run_member_backups(self, tasks: list[BackupTask]) -> None:
        """`run_backups` of any group: per page a slot, per member availability flags."""
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

    def _run_prefix_backups(self, tasks: list[BackupTask], name: str) -> None:
        """`run_backups` of a group whose one member restores a prefix (Full attention) and
        has a page for every key: the same storage calls, counters and acks, without a slot
        tuple or availability flag per page. A task's pages restorable = the keys found
        stored, then the leading run of pages its batch_set calls stored."""
        # Per task: (found, lo, hi) -- its pages to set are keys[lo:hi] of the merged batch --
        # or None when its batch_exists raised (the op fails alone, as in `run_backups`).
        spans: list[tuple[int, int, int] | None] = []
        errors: dict[int, BaseException] = {}
        keys: list[bytes] = []
        pages: list[int] = []
        # The checksum keys of `keys` (with checksums on), made once per task for its
        # batch_exists and kept for the batch_set of its pages not stored yet.
        sum_keys: list[bytes] = []
        checked = self.verify_checksums
        for task in tasks:
            task_keys = self.group.storage_keys(name, task.keys)
            task_sums = checksum_keys(task_keys) if checked else None
            try:
                found = self._exists_keys(task_keys, task_sums) if task_keys else 0
            except Exception as exc:  # this op fails alone; the batch goes on
                logger.warning("backup: batch_exists raised", exc_info=True)
                self.stats.count_fault(FaultReason.ERROR)
                errors[task.op_id] = exc
                spans.append(None)
                continue
            self.stats.count_backup_skipped(found)
            lo = len(keys)
            keys += task_keys[found:]
            if task_sums is not None:
                sum_keys += task_sums[found:]
            pages += cast("tuple[int, ...]", task.pages[name])[found:]
            spans.append((found, lo, len(keys)))
        stored: list[bool] = []
        chunk_errors: list[tuple[int, int, BaseException]] = []
        step = self.batch_pages
        for lo in range(0, len(keys), step):
            chunk_sums = sum_keys[lo : lo + step] if checked else None
            ok, error = self._set_pages(
                name, keys[lo : lo + step], pages[lo : lo + step], chunk_sums
            )
            stored += ok
            if error is not None:
                chunk_errors.append((lo, lo + step, error))
        for task, span in zip(tasks, spans, strict=True):
            n = len(task.keys)
            if span is None:
                done = 0
            else:
                found, lo, hi = span
                mine = stored[lo:hi]
                done = found + (mine.index(False) if False in mine else hi - lo)
                for clo, chi, error in chunk_errors:  # a failed call the task had pages in
                    if lo < chi and clo < hi:
                        errors[task.op_id] = error
            error = errors.get(task.op_id)
            if done == n:
                self.finish(task.op_id, AckStatus.DONE, done, None)
            elif error is not None and done == 0:
                self.finish(task.op_id, AckStatus.FAILED, 0, error)
            else:
                self.finish(task.op_id, AckStatus.PARTIAL, done, error)

    def _set(self, slots: Sequence[_Slot]) -> tuple[list[bool], BaseException | None]:
        views = self._sources(slots)
        ok, error, num_ok, seconds = self._store(list(map(_KEY, slots)), views)
        if error is None:
            stored = Counter(map(_MEMBER, compress(slots, ok)))  # pages per member, in C
            num_bytes = sum(self._page_bytes[name] * n for name, n in stored.items())
            self._count_set(num_ok, num_bytes, seconds)
        return ok, error

    def _set_pages(
        self, name: str, keys: list[bytes], pages: list[int], sum_keys: list[bytes] | None
    ) -> tuple[list[bool], BaseException | None]:
        """`_set` of pages of one member: `keys[k]` is stored from host page `pages[k]`
        (`sum_keys`: their checksum keys, when made already)."""
        views = self.group.set_sources(name, pages)
        ok, error, num_ok, seconds = self._store(keys, views, sum_keys)
        if error is None:
            self._count_set(num_ok, num_ok * self._page_bytes[name], seconds)
        return ok, error

    def _store(
        self, keys: list[bytes], views: list[memoryview], sum_keys: list[bytes] | None = None
    ) -> tuple[list[bool], BaseException | None, int, float]:
        """One batch_set of `views` under `keys` (and their checksums, under `sum_keys` when
        the caller made them already): per page whether it is stored, the call's error, the
        pages stored and the call's seconds."""
        num = len(keys)
        buffers = views
        if self.verify_checksums:
            # Pages first, then their checksums: a reader trusts a page only with its checksum,
            # and a page whose checksum write failed is reported not stored.
            keys = keys + (checksum_keys(keys) if sum_keys is None else sum_keys)
            if self._sums is not None:
                buffers = views + self._sums.crc32_views(views, False)
            else:
                buffers = views + list(map(memoryview, page_checksums(views)))
        start = time.perf_counter()
        try:
            # Trusted: the tier's own page keys (bytes), flat byte views of host pages and of
            # the checksums made here.
            results = self.storage.batch_set(keys, buffers, trusted=True)
        except Exception as exc:  # these pages fail; other chunks and ops go on
            logger.warning("backup: batch_set of %d pages raised", num, exc_info=True)
            self.stats.count_fault(FaultReason.ERROR)
            return [False] * num, exc, 0, 0.0
        seconds = time.perf_counter() - start
        ok = results[:num]
        if self.verify_checksums:
            ok = list(map(operator.and_, ok, results[num:]))  # page and checksum, in C
        num_ok = ok.count(True)
        if num_ok < num:
            self.stats.count_fault(FaultReason.WRITE_FAILED, num - num_ok)
        return ok, None, num_ok, seconds

    def _count_set(self, num_pages: int, num_bytes: int, seconds: float) -> None:
        self.stats.count_transfer(
            Direction.STORAGE_SET, num_pages=num_pages, num_bytes=num_bytes, seconds=seconds
        )

    def _sources(self, slots: Sequence[_Slot]) -> list[memoryview]:
        """The host bytes of each slot's page, one `set_sources` call per run of one member."""
        views: list[memoryview] = []
        for member, run in groupby(slots, _MEMBER):
            views += self.group.set_sources(member, list(map(_PAGE, run)))
        return views
