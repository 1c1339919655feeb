"""`TierController.submit_load_pages`: the tiers' trusted load-backs given as page ids move the
same bytes, with the same handles, acks and counters, as `submit_load(trusted=True)` of the same
pages as token slots, inline and on the worker, merged or not; a merged batch that raises is
retried op by op."""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.hybrid_cache import (
    AckStatus,
    ControllerClosed,
    ControllerParams,
    LayerLoadFailed,
    LoadHandle,
    LoadOp,
    OpKind,
    PageMove,
    PagePairs,
    QueueFull,
    TierController,
    WriteOp,
)
from kvstrata.pool_host import HostLayout
from kvstrata.testkit import tiers as tk

TIMEOUT_S = 10.0
HOST_PAGES = [5, 6, 7, 8]  # written from device pages 1..4 before every load


def page_ids(tiers: tk.Tiers, device: list[int], host: list[int]) -> dict[str, PagePairs]:
    """The same pages in every member, as page ids."""
    as_ids = np.array(device, dtype=np.int64), np.array(host, dtype=np.int64)
    return dict.fromkeys(tiers.group.member_names, as_ids)


def page_moves(tiers: tk.Tiers, device: list[int], host: list[int]) -> dict[str, PageMove]:
    """The same pages in every member, as token slots."""
    return {
        name: PageMove(
            device=tk.page_indices(device, tiers.member_page_size(name)),
            host=tk.page_indices(host, tiers.member_page_size(name)),
        )
        for name in tiers.group.member_names
    }


def filled(shape: tk.Shape, layout: HostLayout) -> tk.Tiers:
    """Tiers whose host pages HOST_PAGES hold device pages 1..4, the device pages 9..15 then
    scrambled (what the loads below overwrite)."""
    tiers = tk.make_tiers(shape, layout=layout)
    with TierController(tiers.group) as controller:
        op = WriteOp(moves=page_moves(tiers, [1, 2, 3, 4], HOST_PAGES))
        ack = controller.wait(controller.submit_write(op), TIMEOUT_S)
        assert ack is not None and ack.ok
    for name, pool in tk.device_pools(tiers).items():
        tk.scramble(pool, tk.page_indices(list(range(9, 16)), tiers.member_page_size(name)), seed=3)
    return tiers


def device_bytes(tiers: tk.Tiers) -> list[bytes]:
    return [
        b.view(torch.uint8).numpy().tobytes()
        for pool in tk.device_pools(tiers).values()
        for b in pool.layer_buffers()
    ]


def submit(
    how: str, controller: TierController, tiers: tk.Tiers, device: list[int], host: list[int]
) -> LoadHandle:
    if how == "pages":
        return controller.submit_load_pages(page_ids(tiers, device, host), inline=True)
    op = LoadOp(moves=page_moves(tiers, device, host))
    return controller.submit_load(op, inline=True, trusted=True)


def outcome(
    how: str,
    shape: tk.Shape,
    layout: HostLayout,
    inline: bool,
    loads: list[tuple[list[int], list[int]]],
) -> tuple[object, ...]:
    """What the loads did: each ack (status, pages), every layer's arrival, the stats (times
    aside) and the device bytes."""
    tiers = filled(shape, layout)
    acks = []
    with TierController(tiers.group, params=ControllerParams(run_inline=inline)) as controller:
        for device, host in loads:
            handle = submit(how, controller, tiers, device, host)
            assert handle.wait_all(TIMEOUT_S)
            assert all(handle.layer_arrived(layer) for layer in tiers.group.layer_ids)
            ack = controller.wait(handle.op_id, TIMEOUT_S)
            assert ack is not None
            acks.append((ack.op_id, ack.status, ack.num_pages))
        controller.check_integrity()
        snap = controller.stats.snapshot()
    counters = (snap.submitted, snap.finished, snap.merged, snap.pages, snap.bytes, snap.waits)
    return acks, counters, device_bytes(tiers)


@pytest.mark.parametrize("inline", [True, False])
@pytest.mark.parametrize("layout", [HostLayout.page_first, HostLayout.layer_first], ids=str)
@pytest.mark.parametrize("shape", tk.SHAPES)
@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_page_loads_move_what_submit_load_moves(
    shape: tk.Shape, layout: HostLayout, inline: bool, data: st.DataObject
) -> None:
    loads = []
    for _ in range(data.draw(st.integers(1, 3))):
        n = data.draw(st.integers(0, 4))
        device = data.draw(st.permutations(range(9, 16)))[:n]
        host = data.draw(st.lists(st.sampled_from(HOST_PAGES), min_size=n, max_size=n))
        loads.append((device, host))
    pages = outcome("pages", shape, layout, inline, loads)
    assert pages == outcome("moves", shape, layout, inline, loads)
    # The loaded pages hold what was written from device pages 1..4.
    tiers = filled(shape, layout)
    with TierController(tiers.group) as controller:
        submit("pages", controller, tiers, [9, 10], [6, 8]).wait_all(TIMEOUT_S)
    for name, pool in tk.device_pools(tiers).items():
        size = tiers.member_page_size(name)
        want = tk.snapshot(pool, tk.page_indices([2, 4], size))
        tk.assert_pages_equal(pool, tk.page_indices([9, 10], size), want, what=name)


class Gate:
    """Holds a wrapped function until opened (the worker inside its batch)."""

    def __init__(self, fn: Callable[..., object]) -> None:
        self.fn = fn
        self.entered = threading.Event()
        self.opened = threading.Event()

    def __call__(self, *args: object, **kwargs: object) -> object:
        self.entered.set()
        assert self.opened.wait(TIMEOUT_S)
        return self.fn(*args, **kwargs)


def test_queued_page_loads_merge_and_a_failing_op_fails_alone() -> None:
    tiers = filled("swa", HostLayout.page_first)
    load_pages = tiers.group.load_pages
    calls: list[list[int]] = []

    def refuse_device_page_12(
        name: str, device: np.ndarray, host: np.ndarray, completion: object
    ) -> object:
        calls.append(device.tolist())
        if 12 in device.tolist():
            raise OSError("copy engine fault")
        return load_pages(name, device, host, completion)  # type: ignore[arg-type]

    gate = Gate(refuse_device_page_12)
    tiers.group.load_pages = gate  # type: ignore[method-assign]
    params = ControllerParams(run_inline=False)
    with TierController(tiers.group, params=params) as controller:
        held = controller.submit_load_pages(page_ids(tiers, [9], [8]))
        assert gate.entered.wait(TIMEOUT_S)  # the worker is busy: the loads queue together
        handles = [
            controller.submit_load_pages(page_ids(tiers, [d], [h]))
            for d, h in ((10, 5), (12, 6), (13, 7))
        ]
        gate.opened.set()
        assert held.wait_all(TIMEOUT_S)
        acks = [controller.wait(h.op_id, TIMEOUT_S) for h in handles]
        status = [a.status if a is not None else None for a in acks]
        assert status == [AckStatus.DONE, AckStatus.FAILED, AckStatus.DONE]
        assert controller.stats.snapshot().merged[OpKind.LOAD] == 2
        with pytest.raises(LayerLoadFailed):
            handles[1].wait_all(TIMEOUT_S)
        assert handles[0].wait_all(TIMEOUT_S) and handles[2].wait_all(TIMEOUT_S)
        controller.check_integrity()
    # The merged walk raised at its first member's call, then each op ran alone.
    assert calls.index([10, 12, 13]) < calls.index([10]) < calls.index([12]) < calls.index([13])
    for name, pool in tk.device_pools(tiers).items():
        size = tiers.member_page_size(name)
        want = tk.snapshot(pool, tk.page_indices([1, 3], size))
        tk.assert_pages_equal(pool, tk.page_indices([10, 13], size), want, what=name)


def test_a_batch_of_moves_and_page_ids_runs_op_by_op() -> None:
    tiers = filled("full", HostLayout.page_first)
    gate = Gate(tiers.group.load_pages)
    tiers.group.load_pages = gate  # type: ignore[method-assign]
    params = ControllerParams(run_inline=False, max_merge_ops=8)
    with TierController(tiers.group, params=params) as controller:
        held = controller.submit_load_pages(page_ids(tiers, [9], [8]))
        assert gate.entered.wait(TIMEOUT_S)  # the next two queue together
        moved = controller.submit_load(LoadOp(moves=page_moves(tiers, [10], [5])), trusted=True)
        paged = controller.submit_load_pages(page_ids(tiers, [11], [6]))
        gate.opened.set()
        assert held.wait_all(TIMEOUT_S)
        for handle in (moved, paged):
            ack = controller.wait(handle.op_id, TIMEOUT_S)
            assert ack is not None and ack.ok and ack.num_pages == 1
        assert controller.stats.snapshot().merged[OpKind.LOAD] == 0
        controller.check_integrity()
    pool = tk.device_pools(tiers)["full"]
    want = tk.snapshot(pool, tk.page_indices([1, 2], tiers.page_size))
    tk.assert_pages_equal(pool, tk.page_indices([10, 11], tiers.page_size), want, what="full")


def test_page_loads_take_queue_room_and_are_refused_when_closed() -> None:
    tiers = tk.make_tiers("full")
    gate = Gate(tiers.group.load_pages)
    tiers.group.load_pages = gate  # type: ignore[method-assign]
    params = ControllerParams(run_inline=False, queue_capacity=1, max_merge_ops=1)
    with TierController(tiers.group, params=params) as controller:
        held = controller.submit_load_pages(page_ids(tiers, [9], [8]))
        assert gate.entered.wait(TIMEOUT_S)
        queued = controller.submit_load_pages(page_ids(tiers, [10], [5]))
        before = controller.stats.snapshot().submitted
        with pytest.raises(QueueFull):
            controller.submit_load_pages(page_ids(tiers, [11], [6]))
        assert controller.stats.snapshot().submitted == before
        gate.opened.set()
        for handle in (held, queued):
            ack = controller.wait(handle.op_id, TIMEOUT_S)
            assert ack is not None and ack.ok
        controller.check_integrity()
    controller = TierController(tiers.group)
    controller.close()
    with pytest.raises(ControllerClosed):
        controller.submit_load_pages(page_ids(tiers, [1], [0]), inline=True)
    assert controller.stats.snapshot().submitted[OpKind.LOAD] == 0
