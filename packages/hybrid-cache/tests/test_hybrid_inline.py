"""Ops the caller waits for at once run on its own thread on a CPU group (`run_inline`):
the same bytes and acks as a worker's, no hand-off; queued as before when asked not to."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from kvstrata.hybrid_cache import (
    AckStatus,
    BackupOp,
    ControllerClosed,
    ControllerParams,
    InvalidOperation,
    LoadOp,
    OpKind,
    PageMove,
    TierController,
    WriteOp,
)
from kvstrata.pool_host import HostLayout
from kvstrata.storage import MemoryStorage, PageKeyer
from kvstrata.storage.base import WriteResult
from kvstrata.testkit.spies import Gate, record_calls
from kvstrata.testkit.tiers import (
    assert_pages_equal,
    device_pools,
    make_tiers,
    page_indices,
    scramble,
    snapshot,
)

TIMEOUT_S = 10.0


def full_move(tiers_page: int, device: list[int], host: list[int]) -> dict[str, PageMove]:
    return {
        "full": PageMove(
            device=page_indices(device, tiers_page), host=page_indices(host, tiers_page)
        )
    }


def test_a_cpu_group_runs_inline_by_default_and_the_flag_overrides() -> None:
    tiers = make_tiers("full")
    with TierController(tiers.group) as controller:
        assert controller.runs_inline
    params = ControllerParams(run_inline=False)
    with TierController(tiers.group, params=params) as controller:
        assert not controller.runs_inline


def test_inline_writes_and_load_run_on_the_callers_thread_bit_identical(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tiers = make_tiers("full")
    pool = device_pools(tiers)["full"]
    page = tiers.member_page_size("full")
    calls = record_calls(monkeypatch, tiers.group, "backup")
    record_calls(monkeypatch, tiers.group, "load_layers", into=calls)
    with TierController(tiers.group) as controller:
        before = snapshot(pool, page_indices([1, 2, 3], page))
        ops = [WriteOp(moves=full_move(page, [p], [h])) for p, h in ((1, 4), (2, 5), (3, 6))]
        ids = controller.submit_writes(ops, inline=True)
        assert all(i is not None for i in ids)
        # Done before the call returned: the acks wait without any worker.
        acks = controller.poll_acks()
        assert [a.op_id for a in acks] == ids and all(a.ok for a in acks)
        assert controller.stats.snapshot().merged[OpKind.WRITE] == 2  # one merged copy
        scramble(pool, page_indices([1, 2, 3], page), seed=3)
        handle = controller.submit_load(
            LoadOp(moves=full_move(page, [7, 8, 9], [4, 5, 6])), inline=True
        )
        assert all(handle.layer_arrived(layer) for layer in tiers.pools.layer_ids)
        ack = controller.wait(handle.op_id, 0.0)
        assert ack is not None and ack.ok and ack.num_pages_done == 3
        assert_pages_equal(pool, page_indices([7, 8, 9], page), before, what="inline cycle")
        controller.check_integrity()
    threads = [c.thread for c in calls]
    assert [c.method for c in calls] == ["backup", "load_layers"]
    assert all(t == threading.current_thread().name for t in threads), threads


def test_without_inline_the_same_submits_go_to_the_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tiers = make_tiers("full")
    page = tiers.member_page_size("full")
    seen = record_calls(monkeypatch, tiers.group, "backup")
    params = ControllerParams(run_inline=False)
    with TierController(tiers.group, params=params) as controller:
        ids = controller.submit_writes([WriteOp(moves=full_move(page, [1], [0]))], inline=True)
        assert ids[0] is not None
        ack = controller.wait(ids[0], TIMEOUT_S)
        assert ack is not None and ack.ok
        controller.check_integrity()
    assert [c.thread for c in seen] == ["kvstrata-tier-write"]


def test_an_inline_op_that_fails_is_acked_failed_and_nothing_escapes() -> None:
    tiers = make_tiers("full")
    page = tiers.member_page_size("full")
    with TierController(tiers.group) as controller:
        # Two device pages into one host page: well-formed, refused by the host pool.
        ids = controller.submit_writes(
            [
                WriteOp(moves=full_move(page, [1], [0])),
                WriteOp(moves=full_move(page, [3, 6], [7, 7])),
            ],
            inline=True,
        )
        acks = {a.op_id: a for a in controller.poll_acks()}
        assert acks[ids[0]].ok  # type: ignore[index]
        bad = acks[ids[1]]  # type: ignore[index]
        assert bad.status is AckStatus.FAILED and "appears twice" in str(bad.error)
        controller.check_integrity()


def test_submit_writes_validates_every_op_before_any_is_admitted() -> None:
    tiers = make_tiers("full")
    page = tiers.member_page_size("full")
    with TierController(tiers.group) as controller:
        good = WriteOp(moves=full_move(page, [1], [0]))
        bad = WriteOp(moves={"full": PageMove(device=torch.tensor([1]), host=torch.tensor([0]))})
        with pytest.raises(InvalidOperation):
            controller.submit_writes([good, bad], inline=True)
        assert controller.stats.snapshot().submitted[OpKind.WRITE] == 0
        assert controller.num_pending() == 0
        controller.close()
        with pytest.raises(ControllerClosed):
            controller.submit_writes([good], inline=True)


@pytest.mark.parametrize("as_pages", [False, True], ids=["moves", "pages"])
def test_submit_writes_past_the_queue_room_refuses_the_rest(
    as_pages: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`submit_writes` and `submit_write_pages` (the tiers' page ids) alike."""
    tiers = make_tiers("full")
    page = tiers.member_page_size("full")
    gate = Gate(TIMEOUT_S)
    monkeypatch.setattr(tiers.group, "backup", gate.wrap(tiers.group.backup))
    params = ControllerParams(run_inline=False, queue_capacity=2, max_merge_ops=1)
    with TierController(tiers.group, params=params) as controller:
        first = controller.submit_write(WriteOp(moves=full_move(page, [1], [0])))
        assert gate.entered.wait(TIMEOUT_S)
        if as_pages:
            one = np.ones(1, dtype=np.int64)
            ids = controller.submit_write_pages([{"full": (one * p, one * p)} for p in (2, 3, 4)])
        else:
            ids = controller.submit_writes(
                [WriteOp(moves=full_move(page, [p], [p])) for p in (2, 3, 4)]
            )
        assert ids[0] is not None and ids[1] is not None and ids[2] is None
        controller.check_integrity()
        gate.opened.set()
        for op_id in (first, ids[0], ids[1]):
            ack = controller.wait(op_id, TIMEOUT_S)
            assert ack is not None and ack.ok
        controller.check_integrity()


@pytest.mark.parametrize("method", ["check_moves", "count_moves"])
def test_moves_are_counted_and_copied_unless_told_not_to(method: str) -> None:
    """`check_moves` and the trusted path's `count_moves` return the same: the page count, and
    copies of the moves unless the op runs before the submit returns (`copy=False`)."""
    tiers = make_tiers("full")
    page = tiers.member_page_size("full")
    moves = full_move(page, [1, 2], [0, 1])
    count = getattr(tiers.group, method)
    copied, num_pages = count(moves)
    borrowed, _ = count(moves, copy=False)
    assert num_pages == 2
    for side in ("device", "host"):
        assert torch.equal(getattr(copied["full"], side), getattr(moves["full"], side))
        assert getattr(copied["full"], side).data_ptr() != getattr(moves["full"], side).data_ptr()
        assert getattr(borrowed["full"], side).data_ptr() == getattr(moves["full"], side).data_ptr()


def test_check_moves_checks_either_way() -> None:
    tiers = make_tiers("full")
    page = tiers.member_page_size("full")
    # The checks run either way, before anything is queued.
    for copy in (True, False):
        with pytest.raises(InvalidOperation):
            tiers.group.check_moves(full_move(page, [0], [0]), copy=copy)  # device page 0
        with pytest.raises(InvalidOperation):
            tiers.group.check_moves(full_move(page, [1], [10**6]), copy=copy)


def test_keyed_pages_are_checked_as_a_whole() -> None:
    tiers = make_tiers("full")
    group = tiers.group
    num_host = group.num_host_pages("full")
    assert group.check_keyed_pages([b"a", b"b"], {"full": [3, None]}) == {"full": (3, None)}
    assert group.check_keyed_pages([b"a", b"b"], {"full": [3, 1]}) == {"full": (3, 1)}
    for keys, pages in (
        ([b"a", "b"], [0, 1]),  # a str key
        ([b"a", b""], [0, 1]),  # an empty key
        ([b"a", b"b"], [0]),  # one page short
        ([b"a", b"b"], [0, num_host]),  # out of range
        ([b"a", b"b"], [-1, None]),
        ([b"a", b"b"], [2, 2]),  # twice
    ):
        with pytest.raises(InvalidOperation):
            group.check_keyed_pages(keys, {"full": pages})  # pyright: ignore[reportArgumentType]
    assert group.storage_keys("full", [b"a", b"b"]) == [
        group.storage_key("full", b"a"),
        group.storage_key("full", b"b"),
    ]
    views = group.set_sources("full", [2, 0])
    assert [bytes(v) for v in views] == [bytes(group.set_source("full", p)) for p in (2, 0)]


def test_storage_keys_of_a_secondary_member_carry_its_name() -> None:
    group = make_tiers("swa", layout=HostLayout.layer_first).group
    for name in group.member_names:
        assert group.storage_keys(name, [b"k1", b"k2"]) == [
            group.storage_key(name, b"k1"),
            group.storage_key(name, b"k2"),
        ]
        # layer_first: staged copies, one per page, still the page's bytes
        assert [bytes(v) for v in group.set_sources(name, [1])] == [
            bytes(group.set_source(name, 1))
        ]
    assert len({group.storage_key(n, b"k1") for n in group.member_names}) == 2


class _ThreadNoting(MemoryStorage):
    """A memory storage that notes the thread of each set."""

    def __init__(self) -> None:
        super().__init__(capacity_bytes=1 << 24)
        self.threads: list[str] = []

    def _set_from(self, keys: Sequence[bytes], views: list[memoryview]) -> list[WriteResult]:
        self.threads.append(threading.current_thread().name)
        return super()._set_from(keys, views)


@pytest.mark.parametrize("trusted", [False, True], ids=["checked", "trusted"])
@pytest.mark.parametrize("memory", [True, False], ids=["in-process", "io-store"])
@pytest.mark.parametrize("run_inline", [True, False])
def test_inline_backups_run_on_the_callers_thread_and_queue_otherwise(
    run_inline: bool, memory: bool, trusted: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inline only on an inline controller over in-process memory storage: a store with I/O
    (file, Ray) keeps its backups on the worker, where the I/O overlaps the caller. The
    tiers' `trusted=True` stores the same pages without `check_keyed_pages`."""
    tiers = make_tiers("full")
    checks = record_calls(monkeypatch, tiers.group, "check_keyed_pages")
    page = tiers.member_page_size("full")
    storage = _ThreadNoting()
    storage.in_process_memory = memory
    inline_here = run_inline and memory
    keyer = PageKeyer(page_size=tiers.page_size, namespace=b"inline-backups")
    keys = keyer.page_keys((torch.arange(3 * tiers.page_size) + 7).numpy())
    params = ControllerParams(run_inline=run_inline)
    with TierController(tiers.group, storage=storage, params=params) as controller:
        (write,) = controller.submit_writes(
            [WriteOp(moves=full_move(page, [1, 2, 3], [4, 5, 6]))], inline=True
        )
        assert write is not None
        ack = controller.wait(write, TIMEOUT_S)
        assert ack is not None and ack.ok
        pages: dict[str, list[int | None]] = {"full": [4, 5, 6]}
        one = controller.submit_backup(
            BackupOp(keys=keys[:1], host_pages={"full": [4]}), inline=True, trusted=trusted
        )
        ids = controller.submit_backups(
            [
                BackupOp(keys=keys, host_pages=pages),
                BackupOp(keys=keys[1:], host_pages={"full": [5, 6]}),
            ],
            inline=True,
            trusted=trusted,
        )
        assert len(checks) == (0 if trusted else 3)
        assert all(i is not None for i in ids)
        if inline_here:  # done before the calls returned: the acks wait without a worker
            acks = controller.poll_acks()
            assert sorted(a.op_id for a in acks) == sorted([one, *ids])  # type: ignore[type-var]
        else:
            acks = [controller.wait(i, TIMEOUT_S) for i in (one, *ids)]  # type: ignore[arg-type]
        assert all(a is not None and a.status is AckStatus.DONE for a in acks)
        assert storage.batch_exists(keys) == 3
        controller.check_integrity()
    me = threading.current_thread().name
    assert storage.threads
    assert all((t == me) == inline_here for t in storage.threads), storage.threads


@pytest.mark.parametrize("run_inline", [True, False])
def test_trusted_submits_move_the_same_bytes_without_the_checks(
    run_inline: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`trusted=True` (the tiers' path) skips `check_moves` and the host pool's page checks
    (`count_moves`, `backup_planned`, `load_layers_planned`) and moves what the checked path
    moves, inline or on the workers; the checked path still refuses a bad op."""
    tiers = make_tiers("full")
    pool = device_pools(tiers)["full"]
    page = tiers.member_page_size("full")
    checks = record_calls(monkeypatch, tiers.group, "check_moves")
    host = tiers.group.member("full").host
    plans = record_calls(monkeypatch, host, "plan_d2h")
    record_calls(monkeypatch, host, "plan_h2d", into=plans)
    params = ControllerParams(run_inline=run_inline)
    with TierController(tiers.group, params=params) as controller:
        before = snapshot(pool, page_indices([1, 2, 3], page))
        ops = [WriteOp(moves=full_move(page, [p], [h])) for p, h in ((1, 4), (2, 5), (3, 6))]
        ids = controller.submit_writes(ops, inline=True, trusted=True)
        acks = [controller.wait(i, TIMEOUT_S) for i in ids if i is not None]
        assert len(acks) == 3 and all(a is not None and a.ok and a.num_pages == 1 for a in acks)
        scramble(pool, page_indices([1, 2, 3], page), seed=4)
        handle = controller.submit_load(
            LoadOp(moves=full_move(page, [7, 8, 9], [4, 5, 6])), inline=True, trusted=True
        )
        ack = controller.wait(handle.op_id, TIMEOUT_S)
        assert ack is not None and ack.ok and ack.num_pages_done == 3
        assert handle.wait_all(TIMEOUT_S)
        assert_pages_equal(pool, page_indices([7, 8, 9], page), before, what="trusted cycle")
        assert not checks and not plans
        with pytest.raises(InvalidOperation):
            controller.submit_writes([WriteOp(moves=full_move(page, [0], [1]))], inline=True)
        assert len(checks) == 1
        # The checked path still has the host pool plan (and check) its pages.
        (op_id,) = controller.submit_writes([WriteOp(moves=full_move(page, [7], [1]))])
        assert op_id is not None
        ack = controller.wait(op_id, TIMEOUT_S)
        assert ack is not None and ack.ok
        assert [c.method for c in plans] == ["plan_d2h"]
        controller.check_integrity()
