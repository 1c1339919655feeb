"""`TierController.submit_write_pages`: the tiers' trusted writes given as page ids move the
same bytes, with the same acks and counters, as `submit_writes` of the same pages as token
slots, inline and on the worker; a merged batch that raises is retried op by op."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvstrata.hybrid_cache import (
    AckStatus,
    ControllerClosed,
    ControllerParams,
    LoadOp,
    OpKind,
    PageMove,
    PagePairs,
    TierController,
    WriteOp,
)
from kvstrata.testkit import tiers as tk
from kvstrata.testkit.spies import Gate, record_calls

TIMEOUT_S = 10.0


def pairs(device: list[int], host: list[int]) -> dict[str, PagePairs]:
    return {"full": (np.array(device, dtype=np.int64), np.array(host, dtype=np.int64))}


def host_bytes(tiers: tk.Tiers, host_pages: list[int]) -> list[bytes]:
    host = tiers.group.member("full").host
    return [bytes(host.page_view(p)) for p in host_pages]


@pytest.mark.parametrize("inline", [True, False])
def test_write_pages_move_what_submit_writes_moves(inline: bool) -> None:
    ops = [([1, 2], [4, 5]), ([3], [9]), ([6, 7], [0, 1])]
    got: dict[str, list[bytes]] = {}
    for how in ("pages", "moves"):
        tiers = tk.make_tiers("full")
        pool = tk.device_pools(tiers)["full"]
        page = tiers.member_page_size("full")
        tk.scramble(pool, tk.page_indices([1, 2, 3, 6, 7], page), seed=11)
        params = ControllerParams(run_inline=inline)
        with TierController(tiers.group, params=params) as controller:
            if how == "pages":
                ids = controller.submit_write_pages([pairs(d, h) for d, h in ops], inline=True)
            else:
                writes = [
                    WriteOp(
                        moves={
                            "full": PageMove(
                                device=tk.page_indices(d, page), host=tk.page_indices(h, page)
                            )
                        }
                    )
                    for d, h in ops
                ]
                ids = controller.submit_writes(writes, inline=True, trusted=True)
            assert all(i is not None for i in ids)
            acks = [controller.wait(i, TIMEOUT_S) for i in ids if i is not None]
            assert all(a is not None and a.ok for a in acks)
            assert [a.num_pages for a in acks if a is not None] == [2, 1, 2]
            snap = controller.stats.snapshot()
            assert snap.submitted[OpKind.WRITE] == 3
            controller.check_integrity()
        got[how] = host_bytes(tiers, [4, 5, 9, 0, 1])
        # The host pages hold the device pages' bytes.
        before = tk.snapshot(pool, tk.page_indices([1, 2, 3, 6, 7], page))
        tk.scramble(pool, tk.page_indices([1, 2, 3, 6, 7], page), seed=5)
        with TierController(tiers.group) as controller:
            handle = controller.submit_load(
                LoadOp(
                    moves={
                        "full": PageMove(
                            device=tk.page_indices([1, 2, 3, 6, 7], page),
                            host=tk.page_indices([4, 5, 9, 0, 1], page),
                        )
                    }
                ),
                inline=True,
            )
            assert handle.wait_all(TIMEOUT_S)
        tk.assert_pages_equal(pool, tk.page_indices([1, 2, 3, 6, 7], page), before, what=how)
    assert got["pages"] == got["moves"]


def test_inline_write_pages_run_merged_on_the_callers_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tiers = tk.make_tiers("full")
    calls = record_calls(monkeypatch, tiers.group, "backup_pages")
    with TierController(tiers.group) as controller:
        ids = controller.submit_write_pages([pairs([1], [4]), pairs([2], [5])], inline=True)
        acks = controller.poll_acks()  # done before the call returned
        assert [a.op_id for a in acks] == ids and all(a.ok for a in acks)
        assert controller.stats.snapshot().merged[OpKind.WRITE] == 1
        controller.check_integrity()
        controller.close()
        with pytest.raises(ControllerClosed):
            controller.submit_write_pages([pairs([3], [6])], inline=True)
    assert [c.thread for c in calls] == [threading.current_thread().name]  # one merged copy


def test_a_merged_page_write_that_raises_is_retried_op_by_op() -> None:
    tiers = tk.make_tiers("full")
    backup_pages = tiers.group.backup_pages

    def refuse_page_9(name: str, device: np.ndarray, host: np.ndarray) -> int:
        if 9 in host.tolist():
            raise OSError("copy engine fault")
        return backup_pages(name, device, host)

    tiers.group.backup_pages = refuse_page_9  # type: ignore[method-assign]
    with TierController(tiers.group) as controller:
        ids = controller.submit_write_pages(
            [pairs([1], [4]), pairs([2], [9]), pairs([3], [5])], inline=True
        )
        acks = {a.op_id: a for a in controller.poll_acks()}
        status = [acks[i].status for i in ids if i is not None]
        assert status == [AckStatus.DONE, AckStatus.FAILED, AckStatus.DONE]
        controller.check_integrity()


def test_a_merged_batch_of_moves_and_page_ids_writes_in_submit_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two queued writes of one host page, the older given as moves, the newer as page ids,
    merged into one batch on the worker: the host page ends with the newer one's bytes, as
    when both are moves (queue order, whatever API each came through)."""
    tiers = tk.make_tiers("full")
    pool = tk.device_pools(tiers)["full"]
    page = tiers.member_page_size("full")
    tk.scramble(pool, tk.page_indices([1, 2, 3], page), seed=11)
    newer_bytes = tk.snapshot(pool, tk.page_indices([2], page))
    gate = Gate(TIMEOUT_S)
    monkeypatch.setattr(tiers.group, "backup", gate.wrap(tiers.group.backup))

    def move(device: int, host: int) -> WriteOp:
        return WriteOp(
            moves={
                "full": PageMove(
                    device=tk.page_indices([device], page), host=tk.page_indices([host], page)
                )
            }
        )

    with TierController(tiers.group, params=ControllerParams(run_inline=False)) as controller:
        first = controller.submit_write(move(3, 7))  # holds the worker: the next two queue
        assert gate.entered.wait(TIMEOUT_S)
        older = controller.submit_writes([move(1, 4)], trusted=True)[0]
        newer = controller.submit_write_pages([pairs([2], [4])])[0]
        gate.opened.set()
        for op_id in (first, older, newer):
            ack = controller.wait(op_id, TIMEOUT_S) if op_id is not None else None
            assert ack is not None and ack.ok
        assert controller.stats.snapshot().merged[OpKind.WRITE] == 1  # one batch of the two
        tk.scramble(pool, tk.page_indices([2], page), seed=5)
        handle = controller.submit_load(
            LoadOp(
                moves={
                    "full": PageMove(
                        device=tk.page_indices([2], page), host=tk.page_indices([4], page)
                    )
                }
            ),
            inline=True,
        )
        assert handle.wait_all(TIMEOUT_S)
    tk.assert_pages_equal(pool, tk.page_indices([2], page), newer_bytes, what="host page 4")
