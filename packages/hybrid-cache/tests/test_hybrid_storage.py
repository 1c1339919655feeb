"""Prefetch (storage -> host) and backup (host -> storage): bit-identical round trips across
pools, the three prefetch policies, the host share limit, and faults that shorten hits without
ever loading wrong data."""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Sequence
from dataclasses import replace

import pytest
import torch

from kvstrata.hybrid_cache import (
    Ack,
    AckStatus,
    BackupOp,
    ControllerParams,
    InvalidOperation,
    LoadOp,
    OpKind,
    PageMove,
    PrefetchOp,
    PrefetchPolicy,
    PrefetchTimeout,
    StorageNotConfigured,
    TierController,
    UnknownOperation,
    WriteOp,
)
from kvstrata.hybrid_cache.metrics import ControllerStats, Direction, FaultReason
from kvstrata.hybrid_cache.storage_io import (
    BackupTask,
    PrefetchTask,
    StorageRunner,
    checksum_key,
    checksum_keys,
    page_checksum,
    page_checksums,
)
from kvstrata.pool_host import HostLayout
from kvstrata.storage import FaultInjectingStorage, MemoryStorage, PageKeyer, Storage
from kvstrata.storage.base import WriteResult
from kvstrata.storage.faults import FaultRules
from kvstrata.testkit.spies import record_calls
from kvstrata.testkit.tiers import (
    SHAPES,
    Shape,
    Tiers,
    assert_pages_equal,
    device_pools,
    make_tiers,
    page_indices,
    snapshot,
    storage_runner,
)

TIMEOUT_S = 10.0
N = 6  # pages of the prefix in most tests


class GatedStorage(FaultInjectingStorage):
    """Passes every call to `inner` (a FaultInjectingStorage with no rules); a `batch_get` of a
    `hold_get` key (a `batch_set` of a `hold_set` key) first waits for `gate`, or sleeps
    `stall_s`; `raise_on` keys make batch_get raise."""

    def __init__(
        self,
        inner: Storage,
        *,
        hold_get: frozenset[bytes] = frozenset(),
        hold_set: frozenset[bytes] = frozenset(),
        stall_s: float = 0.0,
        raise_on: frozenset[bytes] = frozenset(),
    ) -> None:
        super().__init__(inner)
        self.hold_get = hold_get
        self.hold_set = hold_set
        self.stall_s = stall_s
        self.raise_on = raise_on
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.set_calls = 0

    def _pause(self, keys: Sequence[bytes], hold: frozenset[bytes]) -> None:
        if hold & set(keys):
            self.entered.set()
            if self.stall_s:
                time.sleep(self.stall_s)
            else:
                assert self.gate.wait(TIMEOUT_S), "gate never opened"

    def _get_into(self, keys: Sequence[bytes], views: list[memoryview]) -> list[bool]:
        self._pause(keys, self.hold_get)
        if self.raise_on & set(keys):
            raise OSError("backend unreachable")
        return super()._get_into(keys, views)

    def _set_from(self, keys: Sequence[bytes], views: list[memoryview]) -> list[WriteResult]:
        self.set_calls += 1
        self._pause(keys, self.hold_set)
        return super()._set_from(keys, views)


def prefix_keys(tiers: Tiers, num_pages: int, *, salt: int = 0) -> list[bytes]:
    keyer = PageKeyer(page_size=tiers.page_size, namespace=b"hybrid-tests")
    tokens = torch.arange(num_pages * tiers.page_size) + 1000 * salt
    return keyer.page_keys(tokens.numpy())


def all_pages(tiers: Tiers, pages: list[int]) -> dict[str, list[int | None]]:
    return {name: list[int | None](pages) for name in tiers.group.member_names}


def write_and_back_up(
    controller: TierController, tiers: Tiers, keys: list[bytes], device: list[int], host: list[int]
) -> dict[str, list[torch.Tensor]]:
    """Back device pages up to host, then host to storage; the device bytes, per member."""
    pools = device_pools(tiers)
    before = {
        n: snapshot(p, page_indices(device, tiers.member_page_size(n))) for n, p in pools.items()
    }
    moves = {
        n: PageMove(
            device=page_indices(device, tiers.member_page_size(n)),
            host=page_indices(host, tiers.member_page_size(n)),
        )
        for n in pools
    }
    ack = controller.wait(controller.submit_write(WriteOp(moves=moves)), TIMEOUT_S)
    assert ack is not None and ack.ok, ack
    ack = controller.wait(
        controller.submit_backup(BackupOp(keys=keys, host_pages=all_pages(tiers, host))), TIMEOUT_S
    )
    assert ack is not None and ack.status is AckStatus.DONE, ack
    return before


def load_and_check(
    controller: TierController,
    tiers: Tiers,
    host: list[int],
    device: list[int],
    expected: dict[str, list[torch.Tensor]],
    num_pages: int,
) -> None:
    """Load the first `num_pages` of `host` into `device` and compare with `expected`."""
    pools = device_pools(tiers)
    moves = {
        n: PageMove(
            device=page_indices(device[:num_pages], tiers.member_page_size(n)),
            host=page_indices(host[:num_pages], tiers.member_page_size(n)),
        )
        for n in pools
    }
    handle = controller.submit_load(LoadOp(moves=moves))
    ack = controller.wait(handle.op_id, TIMEOUT_S)
    assert ack is not None and ack.ok, ack
    for name, pool in pools.items():
        size = tiers.member_page_size(name)
        want = [e[: num_pages * size] for e in expected[name]]
        assert_pages_equal(pool, page_indices(device[:num_pages], size), want, what=name)


def wipe_host(tiers: Tiers, pages: list[int]) -> None:
    for host in tiers.hosts.values():
        zeros = bytes(host.page_size_bytes)
        for p in pages:
            host.write_page_from(p, zeros)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("layout", [HostLayout.page_first, HostLayout.layer_first])
def test_backup_prefetch_load_round_trip_is_bit_identical(shape: Shape, layout: HostLayout) -> None:
    tiers = make_tiers(shape, layout=layout)
    storage = MemoryStorage(capacity_bytes=1 << 24)
    keys = prefix_keys(tiers, N)
    src, host_a, host_b, dst = (
        [1, 2, 3, 4, 5, 6],
        [0, 1, 2, 3, 4, 5],
        [20, 21, 22, 23, 24, 25],
        [8, 9, 10, 11, 12, 13],
    )
    with TierController(tiers.group, storage=storage) as controller:
        expected = write_and_back_up(controller, tiers, keys, src, host_a)
        wipe_host(tiers, host_a)
        op = controller.submit_prefetch(
            PrefetchOp(
                keys=keys, host_pages=all_pages(tiers, host_b), num_tokens=N * tiers.page_size
            )
        )
        assert op is not None
        ack = controller.wait(op, TIMEOUT_S)
        assert ack is not None and ack.status is AckStatus.DONE and ack.num_pages_done == N
        load_and_check(controller, tiers, host_b, dst, expected, N)
        snap = controller.stats.snapshot()
        members = len(tiers.group.member_names)
        assert snap.pages[Direction.STORAGE_GET] == N * members
        assert snap.pages[Direction.STORAGE_SET] == N * members
        controller.check_integrity()
    storage.check_integrity()


def test_swa_and_mamba_prefetch_only_what_restores_the_boundary() -> None:
    tiers = make_tiers("swa")
    storage = MemoryStorage(capacity_bytes=1 << 24)
    keys = prefix_keys(tiers, N)
    with TierController(tiers.group, storage=storage) as controller:
        write_and_back_up(controller, tiers, keys, [1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5])
        window = tiers.group.rules["swa"].window_pages

        def prefetch(swa_pages: list[int | None]) -> Ack:
            op = controller.submit_prefetch(
                PrefetchOp(
                    keys=keys,
                    host_pages={"full": [10, 11, 12, 13, 14, 15], "swa": swa_pages},
                    num_tokens=N * tiers.page_size,
                )
            )
            assert op is not None
            ack = controller.wait(op, TIMEOUT_S)
            assert ack is not None
            return ack

        ack = prefetch([None] * (N - window) + [20 + i for i in range(window)])
        assert ack.status is AckStatus.DONE and ack.num_pages_done == N
        assert controller.stats.snapshot().pages[Direction.STORAGE_GET] == N + window
        # Without the window's pages the prefix cannot be resumed at its end: 0 pages.
        assert prefetch([None] * (N - 1) + [20]).status is AckStatus.PARTIAL


def test_missing_pages_end_the_prefetch_at_the_stored_prefix() -> None:
    tiers = make_tiers("mamba")
    storage = MemoryStorage(capacity_bytes=1 << 24)
    keys = prefix_keys(tiers, N)
    with TierController(tiers.group, storage=storage) as controller:
        # Only 4 of 6 pages were ever backed up.
        write_and_back_up(controller, tiers, keys[:4], [1, 2, 3, 4], [0, 1, 2, 3])
        op = controller.submit_prefetch(
            PrefetchOp(keys=keys, host_pages=all_pages(tiers, list(range(10, 16))), num_tokens=24)
        )
        assert op is not None
        ack = controller.wait(op, TIMEOUT_S)
        assert ack is not None and ack.status is AckStatus.PARTIAL and ack.num_pages_done == 4
        assert ack.error is None


def test_backup_skips_keys_already_stored_and_merges_queued_ops() -> None:
    tiers = make_tiers("full")
    inner = MemoryStorage(capacity_bytes=1 << 24)
    keys = prefix_keys(tiers, N)
    gated = GatedStorage(inner, hold_set=frozenset({prefix_keys(tiers, 1, salt=9)[0]}))
    with TierController(tiers.group, storage=gated) as controller:
        write_and_back_up(controller, tiers, keys, [1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5])
        ack = controller.wait(
            controller.submit_backup(
                BackupOp(keys=keys, host_pages=all_pages(tiers, list(range(6))))
            ),
            TIMEOUT_S,
        )
        assert ack is not None and ack.ok and ack.num_pages_done == N
        assert controller.stats.snapshot().backup_skipped_pages == N

        # Hold the worker in one backup; three more queue up and share one batch_set.
        held = controller.submit_backup(
            BackupOp(keys=prefix_keys(tiers, 1, salt=9), host_pages=all_pages(tiers, [6]))
        )
        assert gated.entered.wait(TIMEOUT_S)
        calls_before = gated.set_calls
        queued = [
            controller.submit_backup(
                BackupOp(keys=prefix_keys(tiers, 1, salt=s), host_pages=all_pages(tiers, [s]))
            )
            for s in (1, 2, 3)
        ]
        gated.gate.set()
        for op in [held, *queued]:
            ack = controller.wait(op, TIMEOUT_S)
            assert ack is not None and ack.ok
        assert gated.set_calls == calls_before + 1
        assert controller.stats.snapshot().merged[OpKind.BACKUP] == 2


def _delayed(
    tiers: Tiers, delay_s: float
) -> tuple[FaultInjectingStorage, list[bytes], TierController]:
    inner = MemoryStorage(capacity_bytes=1 << 24)
    storage = FaultInjectingStorage(inner)
    keys = prefix_keys(tiers, N)
    params = ControllerParams(storage_batch_pages=1)
    controller = TierController(tiers.group, storage=storage, params=params)
    write_and_back_up(controller, tiers, keys, [1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5])
    storage.set_rules(FaultRules(delay_s=delay_s))
    return storage, keys, controller


def _prefetch_all(
    controller: TierController,
    tiers: Tiers,
    keys: list[bytes],
    policy: PrefetchPolicy,
    timeout: PrefetchTimeout | None = None,
) -> int:
    """Prefetch the whole prefix of `_delayed` into host pages 10..15; the op id."""
    spec = PrefetchOp(
        keys=keys, host_pages=all_pages(tiers, list(range(10, 16))), num_tokens=24, policy=policy
    )
    op = controller.submit_prefetch(spec if timeout is None else replace(spec, timeout=timeout))
    assert op is not None
    return op


def test_best_effort_takes_what_arrived_when_stopped() -> None:
    tiers = make_tiers("full")
    _, keys, controller = _delayed(tiers, 0.2)
    with controller:
        op = _prefetch_all(controller, tiers, keys, PrefetchPolicy.BEST_EFFORT)
        progress = controller.prefetch_progress(op)
        assert progress.ready_to_take and not progress.finished
        time.sleep(0.15)
        taken = controller.stop_prefetch(op)
        assert taken.num_pages_ready < N
        ack = controller.wait(op, TIMEOUT_S)
        assert ack is not None and ack.status is AckStatus.PARTIAL
        # The ack may add the page whose call was running at the stop, never more.
        assert taken.num_pages_ready <= ack.num_pages_done <= taken.num_pages_ready + 1
        with pytest.raises(UnknownOperation):
            controller.prefetch_progress(op)


def test_wait_complete_waits_for_every_page() -> None:
    tiers = make_tiers("full")
    _, keys, controller = _delayed(tiers, 0.02)
    with controller:
        op = _prefetch_all(controller, tiers, keys, PrefetchPolicy.WAIT_COMPLETE)
        assert not controller.prefetch_progress(op).ready_to_take
        ack = controller.wait(op, TIMEOUT_S)
        assert ack is not None and ack.status is AckStatus.DONE and ack.num_pages_done == N


def test_timeout_policy_stops_at_its_allowance() -> None:
    assert PrefetchTimeout(base_s=1.0, per_1k_tokens_s=0.5).seconds(3000) == pytest.approx(2.5)
    tiers = make_tiers("full")
    _, keys, controller = _delayed(tiers, 0.1)
    with controller:
        op = _prefetch_all(
            controller,
            tiers,
            keys,
            PrefetchPolicy.TIMEOUT,
            timeout=PrefetchTimeout(base_s=0.25, per_1k_tokens_s=0.0),
        )
        assert not controller.prefetch_progress(op).ready_to_take
        # 1 exists + 6 get calls of 0.1 s each would take 0.7 s: the worker checks the
        # deadline before each call, so by 0.25 s it has stopped with at most 3 pages.
        ack = controller.wait(op, TIMEOUT_S)
        assert ack is not None and ack.status is AckStatus.PARTIAL and ack.num_pages_done <= 3
        assert controller.prefetch_inflight_pages() == {"full": 0}


def _prefetch_path(path: str, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Make a Full-only group's prefetches take `path`: "prefix" (the fast path `_prefetch`
    takes, which the returned list, filled per prefetch, proves) or "members" (any group's)."""
    taken: list[str] = []
    prefix_path = StorageRunner._prefetch_prefix  # pyright: ignore[reportPrivateUsage]

    def spy(self: StorageRunner, task: PrefetchTask, name: str) -> None:
        taken.append(name)
        prefix_path(self, task, name)

    def members(self: StorageRunner, task: PrefetchTask, name: str) -> None:
        self._prefetch_members(task)  # pyright: ignore[reportPrivateUsage]

    monkeypatch.setattr(StorageRunner, "_prefetch_prefix", spy if path == "prefix" else members)
    return taken


@pytest.mark.parametrize("path", ["prefix", "members"])
@pytest.mark.parametrize("fault", ["fail", "corrupt", "raise", "stall"])
def test_faults_shorten_the_hit_and_never_load_wrong_data(
    fault: str, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Page 3 of 6 goes wrong after batch_exists said all 6 are there: the hit is 3 pages.
    Both ways: the Full-only fast path and any group's path."""
    taken = _prefetch_path(path, monkeypatch)
    tiers = make_tiers("full")
    inner = MemoryStorage(capacity_bytes=1 << 24)
    keys = prefix_keys(tiers, N)
    bad = frozenset({keys[3]})
    storage: Storage
    params = ControllerParams(storage_batch_pages=1)
    injector = FaultInjectingStorage(inner)
    if fault == "fail":
        # Held in the first get, so the page is lost between batch_exists and its batch_get
        # (evicted, or a backend failing it).
        storage = GatedStorage(injector, hold_get=frozenset({keys[0]}))
    elif fault == "corrupt":
        storage = FaultInjectingStorage(inner, corrupt_keys=bad)
    elif fault == "raise":
        storage = GatedStorage(inner, raise_on=bad)
    else:
        # Generous margins: on a loaded 2-core box a healthy call may take tens of ms.
        storage = GatedStorage(inner, hold_get=bad, stall_s=1.0)
        params = ControllerParams(storage_batch_pages=1, storage_call_timeout_s=0.5)
    with TierController(tiers.group, storage=storage, params=params) as controller:
        expected = write_and_back_up(
            controller, tiers, keys, [1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5]
        )
        host = list(range(10, 16))
        op = controller.submit_prefetch(
            PrefetchOp(keys=keys, host_pages=all_pages(tiers, host), num_tokens=24)
        )
        assert op is not None
        if isinstance(storage, GatedStorage) and fault == "fail":
            assert storage.entered.wait(TIMEOUT_S)
            injector.set_rules(FaultRules(fail_keys=bad))
            storage.gate.set()
        ack = controller.wait(op, TIMEOUT_S)
        assert ack is not None and ack.status is AckStatus.PARTIAL and ack.num_pages_done == 3
        load_and_check(controller, tiers, host, [8, 9, 10], expected, ack.num_pages_done)
        faults = controller.stats.snapshot().storage_faults
        reason = {
            "fail": FaultReason.MISS,
            "corrupt": FaultReason.CORRUPT,
            "raise": FaultReason.ERROR,
            "stall": FaultReason.TIMEOUT,
        }
        assert faults[reason[fault]] == 1
        assert (ack.error is not None) == (fault == "raise")
        assert controller.stats.snapshot().pages[Direction.STORAGE_GET] == 3
    assert taken == (["full"] if path == "prefix" else [])


def test_without_checksums_a_corrupt_page_would_go_unnoticed() -> None:
    """The contrast that shows who catches corruption: the controller's checksums."""
    tiers = make_tiers("full")
    inner = MemoryStorage(capacity_bytes=1 << 24)
    keys = prefix_keys(tiers, N)
    storage = FaultInjectingStorage(inner, corrupt_keys={keys[3]})
    params = ControllerParams(verify_checksums=False)
    with TierController(tiers.group, storage=storage, params=params) as controller:
        write_and_back_up(controller, tiers, keys, [1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5])
        op = controller.submit_prefetch(
            PrefetchOp(keys=keys, host_pages=all_pages(tiers, list(range(10, 16))), num_tokens=24)
        )
        assert op is not None
        ack = controller.wait(op, TIMEOUT_S)
        assert ack is not None and ack.status is AckStatus.DONE
    assert not inner.batch_exists([checksum_key(keys[0])])


def test_pages_in_flight_never_pass_the_host_share() -> None:
    tiers = make_tiers("full", host_pages=32)
    inner = MemoryStorage(capacity_bytes=1 << 24)
    keys = prefix_keys(tiers, 10)
    gated = GatedStorage(inner, hold_get=frozenset({keys[0]}))
    params = ControllerParams(prefetch_host_share=0.5)  # 16 of 32 host pages
    with TierController(tiers.group, storage=gated, params=params) as controller:
        write_and_back_up(controller, tiers, keys, list(range(1, 11)), list(range(10)))
        first = controller.submit_prefetch(
            PrefetchOp(keys=keys, host_pages=all_pages(tiers, list(range(10, 20))), num_tokens=40)
        )
        assert first is not None
        assert gated.entered.wait(TIMEOUT_S)
        assert controller.prefetch_inflight_pages() == {"full": 10}
        second = PrefetchOp(
            keys=keys[:8], host_pages=all_pages(tiers, list(range(20, 28))), num_tokens=32
        )
        assert controller.submit_prefetch(second) is None
        assert controller.stats.snapshot().prefetch_refused == 1
        controller.check_integrity()
        gated.gate.set()
        ack = controller.wait(first, TIMEOUT_S)
        assert ack is not None and ack.ok
        assert controller.prefetch_inflight_pages() == {"full": 0}
        again = controller.submit_prefetch(second)
        assert again is not None
        assert controller.wait(again, TIMEOUT_S) is not None


def test_close_stops_queued_prefetches() -> None:
    tiers = make_tiers("full")
    inner = MemoryStorage(capacity_bytes=1 << 24)
    keys = prefix_keys(tiers, 4)
    gated = GatedStorage(inner, hold_get=frozenset({keys[0]}))
    controller = TierController(tiers.group, storage=gated)
    write_and_back_up(controller, tiers, keys, [1, 2, 3, 4], [0, 1, 2, 3])
    running = controller.submit_prefetch(
        PrefetchOp(keys=keys, host_pages=all_pages(tiers, [10, 11, 12, 13]), num_tokens=16)
    )
    assert running is not None and gated.entered.wait(TIMEOUT_S)
    queued = controller.submit_prefetch(
        PrefetchOp(keys=keys[:2], host_pages=all_pages(tiers, [14, 15]), num_tokens=8)
    )
    assert queued is not None
    closer = threading.Thread(target=controller.close)
    closer.start()
    deadline = time.monotonic() + TIMEOUT_S
    while not controller.closed and time.monotonic() < deadline:
        time.sleep(0.005)
    gated.gate.set()
    closer.join(TIMEOUT_S)
    acks = {a.op_id: a for a in controller.poll_acks()}
    assert acks[queued].status is AckStatus.PARTIAL and acks[queued].num_pages_done == 0
    assert acks[running].num_pages_done <= 4
    controller.check_integrity()


def test_storage_ops_need_a_storage() -> None:
    tiers = make_tiers("full")
    with TierController(tiers.group) as controller:
        with pytest.raises(StorageNotConfigured):
            controller.submit_backup(BackupOp(keys=[b"k"], host_pages={"full": [0]}))
        with pytest.raises(StorageNotConfigured):
            controller.submit_prefetch(
                PrefetchOp(keys=[b"k"], host_pages={"full": [0]}, num_tokens=4)
            )


def test_submit_backups_queues_a_batch_with_one_wake_up_and_validates_first() -> None:
    tiers = make_tiers("full")
    inner = MemoryStorage(capacity_bytes=1 << 24)
    gated = GatedStorage(inner, hold_set=frozenset({prefix_keys(tiers, 1, salt=9)[0]}))
    params = ControllerParams(queue_capacity=2)
    with TierController(tiers.group, storage=gated, params=params) as controller:
        write_and_back_up(controller, tiers, prefix_keys(tiers, 2), [1, 2], [0, 1])
        held = controller.submit_backup(
            BackupOp(keys=prefix_keys(tiers, 1, salt=9), host_pages=all_pages(tiers, [6]))
        )
        assert gated.entered.wait(TIMEOUT_S)
        ops = [
            BackupOp(keys=prefix_keys(tiers, 1, salt=s), host_pages=all_pages(tiers, [s]))
            for s in (1, 2, 3)
        ]
        bad = BackupOp(keys=prefix_keys(tiers, 1, salt=4), host_pages=all_pages(tiers, [10**6]))
        before = controller.stats.snapshot().submitted[OpKind.BACKUP]
        with pytest.raises(InvalidOperation):
            controller.submit_backups([ops[0], bad])
        assert controller.stats.snapshot().submitted[OpKind.BACKUP] == before
        calls_before = gated.set_calls
        ids = controller.submit_backups(ops)
        # Room for two (capacity 2, the held one is running): the third is refused.
        assert ids[0] is not None and ids[1] is not None and ids[2] is None
        controller.check_integrity()
        gated.gate.set()
        for op in (held, ids[0], ids[1]):
            assert op is not None
            ack = controller.wait(op, TIMEOUT_S)
            assert ack is not None and ack.ok
        assert gated.set_calls == calls_before + 1  # the two queued went as one batch_set
        controller.check_integrity()


def test_batch_checksums_and_checksum_keys_equal_the_per_page_ones() -> None:
    views = [memoryview(bytes([i]) * (16 + i)) for i in range(5)] + [memoryview(b"")]
    assert page_checksums(views) == [page_checksum(v) for v in views]
    assert page_checksums(views)[0] == zlib.crc32(views[0]).to_bytes(4, "little")
    keys = [b"k%d" % i for i in range(5)]
    assert checksum_keys(keys) == [checksum_key(k) for k in keys]
    assert checksum_keys([]) == [] and page_checksums([]) == []


class _SetRaising(FaultInjectingStorage):
    """A `batch_set` holding one of `raise_on` raises (the whole call fails)."""

    def __init__(self, inner: Storage, raise_on: frozenset[bytes]) -> None:
        super().__init__(inner)
        self.raise_on = raise_on

    def _set_from(self, keys: Sequence[bytes], views: list[memoryview]) -> list[WriteResult]:
        if self.raise_on & set(keys):
            raise OSError("backend unreachable")
        return super()._set_from(keys, views)


@pytest.mark.parametrize("path", ["prefix", "members"])
@pytest.mark.parametrize("verify_checksums", [True, False])
def test_merged_backups_flag_only_the_pages_stored_per_op(
    verify_checksums: bool, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four backups in one merged batch, chunks of 3 pages that straddle them: a page whose
    write fails (or, with checksums, whose checksum write fails) ends its own op's stored
    prefix there and no other op's; a chunk whose batch_set raises fails the pages of every op
    in it (FAILED only for an op with nothing stored), the other chunks' pages stay stored.
    Both ways: the Full-only fast path `run_backups` takes (a spy requires it) and the
    per-member path any group takes, with the same acks and counters."""
    taken: list[str] = []
    prefix_path = StorageRunner._run_prefix_backups  # pyright: ignore[reportPrivateUsage]
    if path == "prefix":

        def spy(self: StorageRunner, tasks: list[BackupTask], name: str) -> None:
            taken.append(name)
            prefix_path(self, tasks, name)

        monkeypatch.setattr(StorageRunner, "_run_prefix_backups", spy)
    else:

        def refuse(self: StorageRunner, tasks: list[BackupTask], name: str) -> None:
            self._run_member_backups(tasks)  # pyright: ignore[reportPrivateUsage]

        monkeypatch.setattr(StorageRunner, "_run_prefix_backups", refuse)
    tiers = make_tiers("full", host_pages=32)
    inner = MemoryStorage(capacity_bytes=1 << 24)
    keys = [prefix_keys(tiers, 4, salt=s) for s in range(4)]
    # op 0: its page 2 fails; op 1: stored whole; op 2: its page 0's checksum (or page) fails;
    # op 3: page 3 sits in a chunk (pages 3 of op 2, 0..1 of op 3 / 2..3 of op 3) that raises.
    fail = {keys[0][2], checksum_key(keys[2][0]) if verify_checksums else keys[2][0]}
    storage = _SetRaising(inner, raise_on=frozenset({keys[3][3]}))
    storage.set_rules(FaultRules(fail_keys=frozenset(fail)))
    acks: dict[int, tuple[AckStatus, int, BaseException | None]] = {}
    stats = ControllerStats()
    runner = StorageRunner(
        group=tiers.group,
        storage=storage,
        stats=stats,
        finish=lambda op, status, done, error: acks.__setitem__(op, (status, done, error)),
        clock=time.monotonic,
        batch_pages=3,
        call_timeout_s=None,
        verify_checksums=verify_checksums,
    )
    tasks = _four_page_tasks(tiers, keys)
    runner.run_backups(tasks)
    # Chunks of to_set (16 slots): [0.0 0.1 0.2] [0.3 1.0 1.1] [1.2 1.3 2.0] [2.1 2.2 2.3]
    # [3.0 3.1 3.2] [3.3]: the last raises.
    assert acks[10][:2] == (AckStatus.PARTIAL, 2) and acks[10][2] is None
    assert acks[11] == (AckStatus.DONE, 4, None)
    assert acks[12][:2] == (AckStatus.PARTIAL, 0) and acks[12][2] is None
    assert acks[13][:2] == (AckStatus.PARTIAL, 3) and isinstance(acks[13][2], OSError)
    assert inner.batch_exists(keys[1]) == 4 and inner.batch_exists(keys[3]) == 3
    assert inner.batch_exists(keys[0]) == 2
    assert taken == (["full"] if path == "prefix" else [])
    # 16 pages set in 6 calls: 2 fail (the fault rules), the last call (one page) raises.
    snap = stats.snapshot()
    assert snap.storage_faults[FaultReason.WRITE_FAILED] == 2
    assert snap.storage_faults[FaultReason.ERROR] == 1
    page_bytes = tiers.group.page_bytes("full")
    assert snap.pages[Direction.STORAGE_SET] == 13
    assert snap.bytes[Direction.STORAGE_SET] == 13 * page_bytes
    assert snap.backup_skipped_pages == 0


@pytest.mark.parametrize("inline", [True, False])
def test_a_trusted_prefetch_skips_the_checks_and_lands_the_same_pages(
    inline: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`submit_prefetch(trusted=True)` (the tiers' path) does not run `check_keyed_pages` and
    lands what the checked path lands, inline or on the worker; the checked path still
    refuses a bad op before anything changes."""
    tiers = make_tiers("full")
    storage = MemoryStorage(capacity_bytes=1 << 24)
    keys = prefix_keys(tiers, N)
    with TierController(tiers.group, storage=storage) as controller:
        expected = write_and_back_up(
            controller, tiers, keys, [1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5]
        )
        wipe_host(tiers, list(range(10, 16)))
        checks = record_calls(monkeypatch, tiers.group, "check_keyed_pages")
        host = list(range(10, 16))
        op = PrefetchOp(keys=keys, host_pages=all_pages(tiers, host), num_tokens=24)
        op_id = controller.submit_prefetch(op, inline=inline, trusted=True)
        assert op_id is not None and not checks
        ack = controller.wait(op_id, TIMEOUT_S)
        assert ack is not None and ack.status is AckStatus.DONE and ack.num_pages_done == N
        load_and_check(controller, tiers, host, [8, 9, 10, 11, 12, 13], expected, N)
        bad = PrefetchOp(keys=[b"", *keys[1:]], host_pages=all_pages(tiers, host), num_tokens=24)
        with pytest.raises(InvalidOperation):
            controller.submit_prefetch(bad, inline=inline)
        assert [len(c.args[0]) for c in checks] == [N]  # the checked submit's keys
        assert controller.prefetch_inflight_pages() == {"full": 0}
        controller.check_integrity()


class _ExistsRaising(FaultInjectingStorage):
    """A `batch_exists` holding one of `raise_exists` raises, a `batch_set` holding one of
    `raise_set` raises (each whole call fails)."""

    def __init__(
        self, inner: Storage, *, raise_exists: frozenset[bytes], raise_set: frozenset[bytes]
    ) -> None:
        super().__init__(inner)
        self.raise_exists = raise_exists
        self.raise_set = raise_set

    def _exists_prefix(self, keys: Sequence[bytes]) -> int:
        if self.raise_exists & set(keys):
            raise OSError("index unreachable")
        return super()._exists_prefix(keys)

    def _set_from(self, keys: Sequence[bytes], views: list[memoryview]) -> list[WriteResult]:
        if self.raise_set & set(keys):
            raise OSError("backend unreachable")
        return super()._set_from(keys, views)


def _four_page_tasks(tiers: Tiers, keys: list[list[bytes]]) -> list[BackupTask]:
    """One backup task per key list (op ids 10, 11, ...), task i over host pages 4i .. 4i+3."""
    return [
        BackupTask(
            op_id=10 + i,
            keys=tuple(k),
            pages=tiers.group.check_keyed_pages(k, all_pages(tiers, list(range(4 * i, 4 * i + 4)))),
        )
        for i, k in enumerate(keys)
    ]


def _runner(
    tiers: Tiers,
    storage: Storage,
    acks: dict[int, tuple[AckStatus, int, BaseException | None]],
    *,
    batch_pages: int,
) -> StorageRunner:
    return storage_runner(
        tiers,
        storage,
        lambda op, status, done, error: acks.__setitem__(op, (status, done, error)),
        batch_pages=batch_pages,
    )


@pytest.mark.parametrize("path", ["prefix", "members"])
def test_a_raising_batch_exists_fails_its_backup_alone(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three merged backups: op 11's batch_exists raises (FAILED with the error, nothing of it
    set), op 12's only batch_set raises (FAILED: nothing stored), op 10 is stored whole. Both
    ways: the Full-only fast path and any group's path, the same acks and counters."""
    taken: list[str] = []
    prefix_path = StorageRunner._run_prefix_backups  # pyright: ignore[reportPrivateUsage]

    def spy(self: StorageRunner, tasks: list[BackupTask], name: str) -> None:
        taken.append(name)
        prefix_path(self, tasks, name)

    def members(self: StorageRunner, tasks: list[BackupTask], name: str) -> None:
        self._run_member_backups(tasks)  # pyright: ignore[reportPrivateUsage]

    monkeypatch.setattr(StorageRunner, "_run_prefix_backups", spy if path == "prefix" else members)
    tiers = make_tiers("full", host_pages=32)
    inner = MemoryStorage(capacity_bytes=1 << 24)
    keys = [prefix_keys(tiers, 4, salt=s) for s in range(3)]
    storage = _ExistsRaising(
        inner, raise_exists=frozenset({keys[1][0]}), raise_set=frozenset({keys[2][0]})
    )
    acks: dict[int, tuple[AckStatus, int, BaseException | None]] = {}
    runner = _runner(tiers, storage, acks, batch_pages=4)
    tasks = _four_page_tasks(tiers, keys)
    runner.run_backups(tasks)
    assert acks[10] == (AckStatus.DONE, 4, None)
    for op in (11, 12):
        assert acks[op][:2] == (AckStatus.FAILED, 0) and isinstance(acks[op][2], OSError)
    assert [inner.batch_exists(k) for k in keys] == [4, 0, 0]
    snap = runner.stats.snapshot()
    assert snap.storage_faults[FaultReason.ERROR] == 2
    assert snap.pages[Direction.STORAGE_SET] == 4
    assert snap.backup_skipped_pages == 0
    assert taken == (["full"] if path == "prefix" else [])


@pytest.mark.parametrize("path", ["prefix", "members"])
def test_a_raising_batch_exists_ends_the_prefetch_with_nothing_read(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefetch whose batch_exists raises: PARTIAL with 0 pages and the error, one ERROR
    fault, no batch_get; the same both ways (Full-only fast path, any group's path)."""
    taken = _prefetch_path(path, monkeypatch)
    tiers = make_tiers("full")
    inner = MemoryStorage(capacity_bytes=1 << 24)
    keys = prefix_keys(tiers, N)
    acks: dict[int, tuple[AckStatus, int, BaseException | None]] = {}
    _runner(tiers, inner, acks, batch_pages=2).run_backups(
        [BackupTask(op_id=1, keys=tuple(keys), pages={"full": tuple(range(N))})]
    )
    assert acks[1] == (AckStatus.DONE, N, None)
    storage = _ExistsRaising(inner, raise_exists=frozenset({keys[0]}), raise_set=frozenset())
    runner = _runner(tiers, storage, acks, batch_pages=2)
    task = PrefetchTask(
        op_id=2,
        keys=tuple(keys),
        pages={"full": tuple(range(10, 10 + N))},
        policy=PrefetchPolicy.WAIT_COMPLETE,
        deadline=None,
    )
    runner.run_prefetches([task])
    assert acks[2][:2] == (AckStatus.PARTIAL, 0) and isinstance(acks[2][2], OSError)
    assert task.ready_pages == 0
    snap = runner.stats.snapshot()
    assert snap.storage_faults[FaultReason.ERROR] == 1
    assert snap.pages[Direction.STORAGE_GET] == 0
    assert storage.stats().latency["get"].count == 0
    assert taken == (["full"] if path == "prefix" else [])
