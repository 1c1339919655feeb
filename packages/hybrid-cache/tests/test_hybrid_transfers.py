"""Write (D2H) and load (H2D) through the tier controller: bit-identical cycles across pools,
per-layer waits, merging, bounded queues, and workers that survive failures."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest
import torch

from kvstrata.hybrid_cache import (
    AckStatus,
    ControllerClosed,
    ControllerParams,
    InvalidOperation,
    LayerLoadFailed,
    LoadHandle,
    LoadOp,
    OpKind,
    PageMove,
    QueueFull,
    TierController,
    UnknownLayer,
    UnknownOperation,
    WriteOp,
)
from kvstrata.pool_host import HostLayout
from kvstrata.testkit.pools import DEVICES
from kvstrata.testkit.spies import Gate
from kvstrata.testkit.tiers import (
    SHAPES,
    Shape,
    Tiers,
    assert_pages_equal,
    device_pools,
    make_tiers,
    page_indices,
    scramble,
    snapshot,
)

TIMEOUT_S = 10.0


def moves_for(
    tiers: Tiers, device_pages: dict[str, list[int]], host_pages: dict[str, list[int]]
) -> dict[str, PageMove]:
    return {
        name: PageMove(
            device=page_indices(device_pages[name], tiers.member_page_size(name)),
            host=page_indices(host_pages[name], tiers.member_page_size(name)),
        )
        for name in device_pages
    }


def same_pages(tiers: Tiers, pages: list[int]) -> dict[str, list[int]]:
    return dict.fromkeys(tiers.group.member_names, pages)


def hold_worker_in_a_write(tiers: Tiers, controller: TierController) -> tuple[Gate, int]:
    """Gate the group's backups and submit a write of device page 1 to host page 0; returns
    the gate and the write's op id once the worker is inside it (held until `gate.opened`)."""
    gate = Gate(TIMEOUT_S)
    tiers.group.backup = gate.wrap(tiers.group.backup)  # type: ignore[method-assign]
    op_id = controller.submit_write(WriteOp(moves=moves_for(tiers, {"full": [1]}, {"full": [0]})))
    assert gate.entered.wait(TIMEOUT_S)
    return gate, op_id


def per_layer(
    load_layers: Callable[..., list[object]], *, before_layer: dict[int, Callable[[], object]]
) -> Callable[..., list[object]]:
    """Wrap PoolGroup.load_layers so each layer is its own call, running `before_layer[i]`
    (block, raise) before layer i's copy."""

    def wrapped(
        name: str, host: torch.Tensor, device: torch.Tensor, completion: object
    ) -> list[object]:
        loads: list[object] = []
        for layer in completion.layer_ids:  # type: ignore[attr-defined]
            if layer in before_layer:
                before_layer[layer]()
            sub = _OneLayer(completion, layer)
            loads += load_layers(name, host, device, sub)
        return loads

    return wrapped


class _OneLayer:
    """A completion exposing one layer of `inner` and forwarding its mark."""

    def __init__(self, inner: object, layer: int) -> None:
        self.inner = inner
        self.layer_ids = [layer]

    def mark_loaded(self, layer_id: int, event: object = None) -> None:
        self.inner.mark_loaded(layer_id, event)  # type: ignore[attr-defined]

    def fail(self, error: BaseException) -> None:
        self.inner.fail(error)  # type: ignore[attr-defined]


@pytest.fixture
def full() -> Iterator[tuple[Tiers, TierController]]:
    tiers = make_tiers("full")
    with TierController(tiers.group) as controller:
        yield tiers, controller
        controller.check_integrity()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("layout", [HostLayout.page_first, HostLayout.layer_first])
def test_write_evict_load_cycles_are_bit_identical(
    shape: Shape, layout: HostLayout, device: str
) -> None:
    """On CUDA the copies run on the host pools' copy streams: wait_layer makes the current
    stream wait for them, and a done ack means the bytes have landed."""
    tiers = make_tiers(shape, layout=layout, device=device)
    pools = device_pools(tiers)
    with TierController(tiers.group) as controller:
        for cycle, (src, dst, host) in enumerate(
            [([1, 2, 3], [7, 8, 9], [0, 1, 2]), ([4, 9], [10, 3], [5, 30]), ([12], [1], [31])]
        ):
            moves = moves_for(tiers, same_pages(tiers, src), same_pages(tiers, host))
            before = {
                name: snapshot(pools[name], page_indices(src, tiers.member_page_size(name)))
                for name in pools
            }
            ack = controller.wait(controller.submit_write(WriteOp(moves=moves)), TIMEOUT_S)
            assert ack is not None and ack.status is AckStatus.DONE, ack
            for name, pool in pools.items():
                scramble(pool, page_indices(src, tiers.member_page_size(name)), seed=cycle)
            back = moves_for(tiers, same_pages(tiers, dst), same_pages(tiers, host))
            handle = controller.submit_load(LoadOp(moves=back))
            for layer in tiers.pools.layer_ids:
                assert handle.wait_layer(layer, TIMEOUT_S)
            ack = controller.wait(handle.op_id, TIMEOUT_S)
            assert ack is not None and ack.ok, ack
            assert ack.num_pages == ack.num_pages_done == len(src) * len(pools)
            for name, pool in pools.items():
                slots = page_indices(dst, tiers.member_page_size(name))
                assert_pages_equal(pool, slots, before[name], what=f"{shape}/{name} cycle {cycle}")
            controller.check_integrity()


def test_load_moves_only_the_members_named() -> None:
    tiers = make_tiers("mamba")
    pools = device_pools(tiers)
    with TierController(tiers.group) as controller:
        moves = moves_for(tiers, same_pages(tiers, [2]), same_pages(tiers, [4]))
        assert controller.wait(controller.submit_write(WriteOp(moves=moves)), TIMEOUT_S)
        untouched = snapshot(pools["full"], page_indices([5], tiers.page_size))
        state = snapshot(pools["mamba"], page_indices([2], 1))
        scramble(pools["mamba"], page_indices([5], 1), seed=1)
        handle = controller.submit_load(
            LoadOp(
                moves={"mamba": PageMove(device=page_indices([5], 1), host=page_indices([4], 1))}
            )
        )
        # Attention layers are not part of this load: ready at once.
        assert handle.layer_arrived(1) and handle.layer_arrived(3)
        assert handle.wait_all(TIMEOUT_S)
        assert controller.wait(handle.op_id, TIMEOUT_S)
        assert_pages_equal(pools["mamba"], page_indices([5], 1), state, what="mamba slot")
        assert_pages_equal(pools["full"], page_indices([5], tiers.page_size), untouched, what="kv")


def test_each_layer_waits_only_for_its_own_copy(full: tuple[Tiers, TierController]) -> None:
    tiers, controller = full
    moves = moves_for(tiers, {"full": [1, 2]}, {"full": [0, 1]})
    assert controller.wait(controller.submit_write(WriteOp(moves=moves)), TIMEOUT_S)
    release = threading.Event()
    tiers.group.load_layers = per_layer(  # type: ignore[method-assign]
        tiers.group.load_layers, before_layer={2: lambda: release.wait(TIMEOUT_S)}
    )
    handle = controller.submit_load(
        LoadOp(moves=moves_for(tiers, {"full": [3, 4]}, {"full": [0, 1]}))
    )
    assert handle.wait_layer(0, TIMEOUT_S)
    assert handle.wait_layer(1, TIMEOUT_S)
    assert not handle.wait_layer(2, 0.05), "layer 2 cannot have arrived: its copy is held"
    assert not handle.layer_arrived(3)
    assert controller.poll_acks() == []
    release.set()
    assert handle.wait_layer(3, TIMEOUT_S)
    ack = controller.wait(handle.op_id, TIMEOUT_S)
    assert ack is not None and ack.ok
    with pytest.raises(UnknownLayer):
        handle.wait_layer(99)


def test_consecutive_writes_are_merged_into_one_transfer(
    full: tuple[Tiers, TierController],
) -> None:
    tiers, controller = full
    gate, first = hold_worker_in_a_write(tiers, controller)
    # The worker is held inside op `first`: these wait in the queue and go together.
    later = [
        controller.submit_write(WriteOp(moves=moves_for(tiers, {"full": [p]}, {"full": [p]})))
        for p in (2, 3, 4, 5)
    ]
    assert controller.queue_depth(OpKind.WRITE) == 4
    gate.opened.set()
    acks = [controller.wait(i, TIMEOUT_S) for i in [first, *later]]
    assert all(a is not None and a.ok for a in acks)
    assert gate.calls == 2, "the four queued writes should have been one backup call"
    assert controller.stats.snapshot().merged[OpKind.WRITE] == 3
    pool = device_pools(tiers)["full"]
    for p in (2, 3, 4, 5):  # and the merged copy put every page where its own op said
        host = tiers.hosts["full"]
        flat = torch.empty(1, host.page_size_bytes, dtype=torch.uint8)
        pool.read_pages(torch.tensor([p]), flat)
        assert bytes(host.page_view(p)) == flat.numpy().tobytes()


def test_merged_loads_run_one_layer_walk_and_each_op_is_acked() -> None:
    tiers = make_tiers("swa")
    pools = device_pools(tiers)
    with TierController(tiers.group) as controller:
        moves = moves_for(tiers, same_pages(tiers, [1, 2, 3]), same_pages(tiers, [0, 1, 2]))
        assert controller.wait(controller.submit_write(WriteOp(moves=moves)), TIMEOUT_S)
        expected = {
            n: snapshot(p, page_indices([1, 2, 3], tiers.page_size)) for n, p in pools.items()
        }
        gate = Gate(TIMEOUT_S)
        tiers.group.load_layers = gate.wrap(tiers.group.load_layers)  # type: ignore[method-assign]

        def load(dst: int, host: int) -> LoadHandle:
            moves = moves_for(tiers, same_pages(tiers, [dst]), same_pages(tiers, [host]))
            return controller.submit_load(LoadOp(moves=moves))

        handles = [load(5, 0)]
        assert gate.entered.wait(TIMEOUT_S)  # the worker is inside the first load ...
        handles += [load(6, 1), load(7, 2)]  # ... so these two wait together and merge
        gate.opened.set()
        for handle in handles:
            assert handle.wait_all(TIMEOUT_S)
            ack = controller.wait(handle.op_id, TIMEOUT_S)
            assert ack is not None and ack.ok
        # Layers alternate full, swa, full, swa: a walk is 4 one-layer calls. The first op
        # walks alone, the other two merged walk together: 8 calls, not 12.
        assert gate.calls == 8
        for name, pool in pools.items():
            for k, dst in enumerate((5, 6, 7)):
                got = snapshot(pool, page_indices([dst], tiers.page_size))
                want = [e.view(-1, tiers.page_size, *e.shape[1:])[k] for e in expected[name]]
                for g, w in zip(got, want, strict=True):
                    assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))


def test_full_queue_refuses_and_changes_nothing() -> None:
    tiers = make_tiers("full")
    params = ControllerParams(queue_capacity=2, max_merge_ops=1)
    with TierController(tiers.group, params=params) as controller:
        gate, running = hold_worker_in_a_write(tiers, controller)
        move = moves_for(tiers, {"full": [1]}, {"full": [0]})
        queued = [controller.submit_write(WriteOp(moves=move)) for _ in range(2)]
        before = controller.stats.snapshot()
        with pytest.raises(QueueFull) as info:
            controller.submit_write(WriteOp(moves=move))
        assert info.value.capacity == 2 and info.value.kind == "write"
        assert controller.stats.snapshot().submitted == before.submitted
        assert controller.num_pending() == 3
        controller.check_integrity()
        gate.opened.set()
        for op_id in [running, *queued]:
            ack = controller.wait(op_id, TIMEOUT_S)
            assert ack is not None and ack.ok
        # Room again: the next id follows the last accepted one (the refused submit took none).
        assert controller.submit_write(WriteOp(moves=move)) == queued[-1] + 1


def test_a_failing_op_fails_alone_and_the_worker_keeps_serving(
    full: tuple[Tiers, TierController],
) -> None:
    tiers, controller = full
    gate, held = hold_worker_in_a_write(tiers, controller)
    good = controller.submit_write(WriteOp(moves=moves_for(tiers, {"full": [2]}, {"full": [1]})))
    # Two device pages into one host page: well-formed, refused by the host pool on the worker.
    bad = controller.submit_write(
        WriteOp(moves=moves_for(tiers, {"full": [3, 6]}, {"full": [7, 7]}))
    )
    also_good = controller.submit_write(
        WriteOp(moves=moves_for(tiers, {"full": [4]}, {"full": [2]}))
    )
    gate.opened.set()
    acks = {i: controller.wait(i, TIMEOUT_S) for i in (held, good, bad, also_good)}
    assert acks[bad] is not None and acks[bad].status is AckStatus.FAILED
    assert acks[bad].error is not None and "appears twice" in str(acks[bad].error)
    assert all(acks[i] is not None and acks[i].ok for i in (held, good, also_good))
    # The worker is alive and serves the next op.
    after = controller.submit_write(WriteOp(moves=moves_for(tiers, {"full": [5]}, {"full": [3]})))
    ack = controller.wait(after, TIMEOUT_S)
    assert ack is not None and ack.ok


def test_a_worker_whose_batch_raises_reports_and_keeps_serving(
    full: tuple[Tiers, TierController], caplog: pytest.LogCaptureFixture
) -> None:
    tiers, controller = full
    original = controller.stats.count_merged
    calls = {"n": 0}

    def broken_once(kind: OpKind, num_ops: int) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("bookkeeping bug")
        original(kind, num_ops)

    # Raised outside any op's own try: the worker's last line of defence must ack it.
    controller.stats.count_merged = broken_once  # type: ignore[method-assign]
    move = moves_for(tiers, {"full": [1]}, {"full": [0]})
    op = controller.submit_write(WriteOp(moves=move))
    ack = controller.wait(op, TIMEOUT_S)
    assert ack is not None and ack.status is AckStatus.FAILED
    assert isinstance(ack.error, RuntimeError)
    assert controller.stats.snapshot().worker_errors[OpKind.WRITE] == 1
    assert "write worker" in caplog.text
    ack = controller.wait(controller.submit_write(WriteOp(moves=move)), TIMEOUT_S)
    assert ack is not None and ack.ok
    controller.check_integrity()


def test_a_failed_load_wakes_its_waiters(full: tuple[Tiers, TierController]) -> None:
    tiers, controller = full

    def fault() -> None:
        raise OSError("copy engine fault")

    tiers.group.load_layers = per_layer(  # type: ignore[method-assign]
        tiers.group.load_layers, before_layer={2: fault}
    )
    handle = controller.submit_load(LoadOp(moves=moves_for(tiers, {"full": [3]}, {"full": [0]})))
    assert handle.wait_layer(1, TIMEOUT_S)
    with pytest.raises(LayerLoadFailed) as info:
        handle.wait_layer(3, TIMEOUT_S)
    assert isinstance(info.value.__cause__, OSError)
    ack = controller.wait(handle.op_id, TIMEOUT_S)
    assert ack is not None and ack.status is AckStatus.FAILED and handle.failed


def test_submits_are_validated_before_anything_is_queued(
    full: tuple[Tiers, TierController],
) -> None:
    tiers, controller = full
    idx = page_indices([1], tiers.page_size)
    with pytest.raises(InvalidOperation, match="no member"):
        controller.submit_write(WriteOp(moves={"swa": PageMove(device=idx, host=idx)}))
    with pytest.raises(InvalidOperation, match="host"):
        controller.submit_write(WriteOp(moves={"full": PageMove(device=idx, host=idx[:2])}))
    with pytest.raises(InvalidOperation, match="whole pages"):
        controller.submit_load(LoadOp(moves={"full": PageMove(device=idx[:3], host=idx[:3])}))
    with pytest.raises(InvalidOperation, match="integers"):
        controller.submit_load(LoadOp(moves={"full": PageMove(device=idx.float(), host=idx)}))
    page0 = page_indices([0], tiers.page_size)
    with pytest.raises(InvalidOperation, match="device indices must lie in"):
        controller.submit_write(WriteOp(moves={"full": PageMove(device=page0, host=idx)}))
    far = page_indices([99], tiers.page_size)
    with pytest.raises(InvalidOperation, match="host indices must lie in"):
        controller.submit_write(WriteOp(moves={"full": PageMove(device=idx, host=far)}))
    assert controller.num_pending() == 0
    assert sum(controller.stats.snapshot().submitted.values()) == 0


def test_acks_are_handed_out_once(full: tuple[Tiers, TierController]) -> None:
    tiers, controller = full
    move = moves_for(tiers, {"full": [1]}, {"full": [0]})
    ids = [controller.submit_write(WriteOp(moves=move)) for _ in range(3)]
    ack = controller.wait(ids[1], TIMEOUT_S)
    assert ack is not None and ack.op_id == ids[1]
    with pytest.raises(UnknownOperation):
        controller.wait(ids[1])
    for i in (ids[0], ids[2]):
        assert controller.wait(i, TIMEOUT_S) is not None
    assert controller.poll_acks() == []
    with pytest.raises(UnknownOperation):
        controller.wait(12345)


def test_close_refuses_new_work_and_is_idempotent() -> None:
    tiers = make_tiers("full")
    controller = TierController(tiers.group)
    move = moves_for(tiers, {"full": [1]}, {"full": [0]})
    op = controller.submit_write(WriteOp(moves=move))
    assert controller.close(TIMEOUT_S)
    assert controller.close(TIMEOUT_S)
    # Queued work finished before the workers exited; its ack is still there.
    acks = controller.poll_acks()
    assert [a.op_id for a in acks] == [op] and acks[0].ok
    with pytest.raises(ControllerClosed):
        controller.submit_write(WriteOp(moves=move))
    controller.check_integrity()
