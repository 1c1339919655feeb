"""A load-back on a controller that runs it inline (CPU) completes in the call that starts it
(`TierLoader.start(wait_now=True)`: its ack taken at once, a Full-only tree's path revived
from the loaded node without walking the key) and leaves exactly the state the queued path
leaves (a worker runs the load, `wait` takes its ack, the commit inserts the key): the same
requests through both, with every transfer drained after each, give the same hits, trees
and counters."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.hybrid_cache import ControllerParams
from kvstrata.testkit.tiers import (
    Hierarchy,
    Shape,
    assert_served_alike,
    check_hit,
    compute,
    make_hierarchy,
    page_prompts,
    serve,
    serve_bare,
)
from kvstrata.unified_radix_cache import RadixKey
from kvstrata.unified_radix_cache.host_walks import HostWalks
from kvstrata.unified_radix_cache.node import TreeNode
from kvstrata.unified_radix_cache.tiers import TierParams

PAGE = 4
#: Three pages: a later request hits at most the first two.
FIRST = [1] * PAGE + [2] * PAGE + [3] * PAGE


def _pushed_off(h: Hierarchy, fillers: range, *prompts: list[int]) -> None:
    """Serves `FIRST` and `prompts` (testkit's `serve`), then two pages of each token in
    `fillers`: the device fills and the pages served first leave it (kept on the host)."""
    for tokens in (FIRST, *prompts):
        serve(h, tokens)
    for k in fillers:
        serve(h, [k] * (2 * PAGE))


def _pair(shape: Shape) -> tuple[Hierarchy, Hierarchy]:
    kw = {"page_size": PAGE, "device_pages": 6, "host_pages": 10}
    inline = make_hierarchy(shape, controller_params=ControllerParams(run_inline=True), **kw)
    queued = make_hierarchy(shape, controller_params=ControllerParams(run_inline=False), **kw)
    assert inline.cache.controller.runs_inline and not queued.cache.controller.runs_inline
    return inline, queued


@settings(max_examples=30, deadline=None)
@given(prompts=page_prompts(PAGE), shape=st.sampled_from(["full", "swa"]))
def test_an_inline_load_back_leaves_the_state_the_queued_one_leaves(
    prompts: list[list[int]], shape: Shape
) -> None:
    assert_served_alike(*_pair(shape), prompts, drain=True)


def test_an_inline_load_back_is_committed_when_start_returns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pushed off the device, a prefix comes back in one `start_load_back(wait_now=True)`:
    no transfer is left in flight, the nodes hold the loaded slots (revived along the path,
    no insert walk) and the handle's layers have all arrived; the queued controller needs
    the wait for the same (its commit inserts the key)."""
    revived: list[TreeNode] = []
    original = HostWalks.revive_path

    def spy(self: HostWalks, node: TreeNode, slots: Any, checker: Any) -> bool:
        revived.append(node)
        return original(self, node, slots, checker)

    monkeypatch.setattr(HostWalks, "revive_path", spy)
    for h in _pair("full"):
        revived.clear()
        try:
            first = [1] * PAGE + [2] * PAGE + [9]
            serve_bare(h, first, drain=True)
            for k in range(3, 6):  # the device fills: the first prompt's pages leave it
                serve_bare(h, [k] * (2 * PAGE) + [9], drain=True)
            match = h.cache.match_prefix(RadixKey(first), max_len=2 * PAGE)
            assert (match.device.prefix_len, match.host_hit_len) == (0, 2 * PAGE)
            load = h.cache.start_load_back(match.host_node, wait_now=True)
            assert load.num_tokens == 2 * PAGE
            assert load.wait_layer(0, 10.0)
            inline = h.cache.controller.runs_inline
            assert load.done == inline
            assert (h.cache.num_pending == 0) == inline
            back = load.wait(10.0)
            assert back is not None and back.loaded_len == 2 * PAGE
            assert back.match.last_node is match.host_node
            assert (
                back.match.device_indices.tolist() == h.tree.prefix_slots(match.host_node).tolist()
            )
            assert h.cache.num_pending == 0
            assert revived == ([match.host_node] if inline else [])
            h.cache.check_integrity()
        finally:
            h.cache.controller.close()


def test_a_load_back_waits_for_no_queued_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """A load conflicts with no write, so it waits for none: it reads only host pages the
    tree holds (committed, host-locked until its ack) into device slots just allocated, while
    a write reads device pages it holds locked into host slots no node holds before its ack.
    The queued writes still go to the controller with the load (`TierWriter.flush`: one
    wake-up, and the write timing, hence every answer, stays as it was), but on a queued
    controller the load is acknowledged, with the right bytes, while a write it sent along is
    still held inside its copy."""
    h = make_hierarchy(
        "full",
        page_size=PAGE,
        device_pages=6,
        host_pages=16,
        params=TierParams(prefetch_threshold=PAGE, write_batch=64),
        controller_params=ControllerParams(run_inline=False),
    )
    cache = h.cache
    try:
        _pushed_off(h, range(3, 6))
        ids = torch.tensor([7] * (2 * PAGE), dtype=torch.int64)
        req = cache.begin_request(RadixKey(ids))
        slots = cache.alloc_tokens(2 * PAGE)
        assert slots is not None
        compute(h, ids, req, slots)
        cache.cache_finished_request(req)
        assert cache.writer.num_unsent == 1  # queued (write_batch 64), not sent

        group = cache.controller.group
        original = group.backup_pages  # the tiers' writes copy page ids (submit_write_pages)
        entered, gate = threading.Event(), threading.Event()

        def held_backup(*args: Any, **kwargs: Any) -> Any:
            entered.set()
            assert gate.wait(10.0)
            return original(*args, **kwargs)

        monkeypatch.setattr(group, "backup_pages", held_backup)
        try:
            first_ids = torch.tensor(FIRST, dtype=torch.int64)
            back = cache.begin_request(RadixKey(first_ids))  # loads the first prompt back
            assert entered.wait(10.0) and cache.writer.num_unsent == 0  # sent with the load
            assert (back.hit.device_len, back.hit.host_len) == (0, 2 * PAGE)
            assert back.hit.load is not None and back.hit.load.done
            assert check_hit(h, first_ids, back) == 2 * PAGE  # the loaded KV, bit for bit
            assert not gate.is_set() and cache.num_pending == 1  # the write: still in its copy
        finally:
            gate.set()
        cache.drain()
        cache.abort_request(back)
        cache.check_integrity()
        assert cache.counters.failed_ops == 0
    finally:
        cache.controller.close()


@pytest.mark.parametrize("upper", [False, True], ids=["same-node", "its-parent"])
def test_an_inline_load_of_a_path_revived_meanwhile_commits_as_the_insert_does(
    upper: bool,
) -> None:
    """The device room of a load may poll (`DeviceRoom.evict`), and that poll may commit an
    earlier queued load of the same prefix (or of a shorter one): nodes the inline load
    planned to revive are on the device again when its ack comes. Its commit must then do
    what the insert commit does (the slots loaded twice go back, the tree keeps the first
    load's), not hand its slots to the wrong nodes."""
    h = make_hierarchy("full", page_size=PAGE, device_pages=8, host_pages=16)
    cache = h.cache
    spare: torch.Tensor | None = None
    try:
        _pushed_off(h, range(5, 9), [1] * PAGE + [4] * PAGE + [3] * PAGE)  # splits FIRST
        match = cache.match_prefix(RadixKey(FIRST), max_len=2 * PAGE)
        assert (match.device.prefix_len, match.host_hit_len) == (0, 2 * PAGE)
        node = match.host_node
        parent = node.parent
        assert parent is not None and parent.num_tokens == PAGE and not len(parent.value)
        queued = cache.start_load_back(parent if upper else node)  # a worker runs it
        deadline = time.monotonic() + 10.0
        while cache.controller.num_pending() and time.monotonic() < deadline:
            time.sleep(0.002)
        assert cache.controller.num_pending() == 0 and not queued.done  # its ack waits
        assert not len(node.value) and not len(parent.value)
        # No free device slot: the second load's room evicts, and its poll commits the first.
        spare = h.allocator.alloc(h.allocator.available_size())
        inline = cache.start_load_back(node, wait_now=True)
        assert queued.done and inline.done
        first_back = queued.wait()
        back = inline.wait()
        assert first_back is not None and first_back.loaded_len == (PAGE if upper else 2 * PAGE)
        assert back is not None and back.loaded_len == 2 * PAGE
        assert len(node.value) == PAGE and len(parent.value) == PAGE
        assert back.match.last_node is node
        assert back.match.device_indices.tolist() == h.tree.prefix_slots(node).tolist()
        assert cache.num_pending == 0
        if spare is not None:
            h.allocator.free(spare)
            spare = None
        cache.check_integrity()  # no slot leaked, no lock left
        assert serve(h, FIRST) == 2 * PAGE  # the tree's KV for the prefix, bit for bit
    finally:
        if spare is not None:
            h.allocator.free(spare)
        cache.controller.close()


@pytest.mark.parametrize("run_inline", [True, False], ids=["inline", "queued"])
def test_a_failed_load_back_in_begin_request_leaves_the_tree_as_it_was(
    run_inline: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load whose copy raises: committed (inline: inside `start_load_back`) as a failure,
    the same on both controllers: no hit, its device slots given back, its locks released,
    one failed op, and the prefix still on the host."""
    h = make_hierarchy(
        "full",
        page_size=PAGE,
        device_pages=8,
        host_pages=16,
        controller_params=ControllerParams(run_inline=run_inline),
    )
    cache = h.cache
    try:
        _pushed_off(h, range(5, 9))

        def broken(*_args: object, **_kwargs: object) -> None:
            raise OSError("copy engine fault")

        monkeypatch.setattr(cache.controller.group, "load_pages", broken)  # the tiers' loads
        req = cache.begin_request(RadixKey(FIRST))
        assert req.hit.load is not None and req.hit.load.done
        back = req.hit.load.wait()
        assert back is not None and back.loaded_len == 0
        assert (req.cached_len, req.hit.device_len, req.hit.host_len) == (0, 0, 0)
        assert cache.counters.failed_ops == 1 and cache.counters.loaded_tokens == 0
        assert cache.num_pending == 0
        cache.abort_request(req)
        match = cache.match_prefix(RadixKey(FIRST), max_len=2 * PAGE)
        assert (match.device.prefix_len, match.host_hit_len) == (0, 2 * PAGE)
        cache.check_integrity()  # the load's slots freed, no lock left
    finally:
        cache.controller.close()
