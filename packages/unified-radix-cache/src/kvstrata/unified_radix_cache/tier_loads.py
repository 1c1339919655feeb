"""Host -> device load-backs of a `HierarchicalCache` (`TierLoader`).

A load-back allocates device slots for the off-device part of a prefix (and what each other
component's `plan_load` asks for: e.g. a device state slot; SWA slots come in step with the
full ones), submits one layer-wise LoadOp and returns a `TierLoad` the forward waits on per
layer; the nodes get their device slots only on the ack (with each component's `load_input`).
"""

from __future__ import annotations

import time

import torch

from kvstrata.hybrid_cache import Ack, PagePairs, QueueFull
from kvstrata.pool_host import vouched_pages
from kvstrata.unified_radix_cache.components.base import ComponentInsert
from kvstrata.unified_radix_cache.components.transfer import TransferLeg
from kvstrata.unified_radix_cache.node import TreeNode
from kvstrata.unified_radix_cache.paths import key_of
from kvstrata.unified_radix_cache.results import (
    MatchResult,
)
from kvstrata.unified_radix_cache.tier_core import (
    FULL,
    NO_SLOTS,
    PendingLoad,
    TierCore,
    prefix_len,
    run_above,
)
from kvstrata.unified_radix_cache.tier_room import DeviceRoom
from kvstrata.unified_radix_cache.tier_writes import TierWriter
from kvstrata.unified_radix_cache.tiers import (
    LoadBack,
    TierLoad,
)


class TierLoader:
    """The load-back transfers of a `HierarchicalCache`, over its shared `core`; `room`
    allocates the device slots (evicting by the write policy), `writer` sends its queued
    writes along when a load wakes the controller."""

    def __init__(self, core: TierCore, writer: TierWriter, room: DeviceRoom) -> None:
        self._core = core
        self._writer = writer
        self._room = room

    def start(self, node: TreeNode, *, wait_now: bool = False) -> TierLoad:
        """Start bringing the prefix ending at `node` (`TieredMatch.host_node`) back to the
        device: allocate device slots for its off-device part (evicting unlocked device data,
        never the prefix itself) and submit one layer-wise LoadOp. Returns at once; the caller
        waits per layer (`wait_layer`) and the nodes get their device slots only on the ack
        (`TierLoad.wait`, `poll`, `drain`), except that with `wait_now` on a controller that
        `runs_inline` the load runs on this thread and is committed before this returns (a
        done handle). Nothing to load or no device room: a done handle
        with `loaded_len` 0 and the tree unchanged. Raises ForeignNode for a node not in the
        tree (e.g. host-evicted since the match)."""
        core = self._core
        key = key_of(core.device_tree, node)
        # The device prefix the pages extend: the nearest on-device node above (device values
        # are prefix-closed). With Full only it is the device hit of `key` (no walk from the
        # root needed); with other components the on-device run may reach past the device hit
        # (nodes without a device state, SWA tombstones): their pages stay; only the off-device
        # pages move (with what each component brings back, e.g. the boundary state or the
        # window's SWA pages).
        anchor = node
        while anchor.parent is not None and not len(anchor.value):
            anchor = anchor.parent
        start, end = prefix_len(anchor), len(key)
        legs = [t.plan_load(core, node, start, end) for t in core.transfers.values()]
        if start >= end and not any(leg.size for leg in legs):
            return self._done_load(LoadBack(0, self._core.tier.match_key(key)))
        locks = core.lock_move(anchor, node)
        slots: torch.Tensor | None = None
        refused = False
        try:
            slots = self._room.alloc(end - start) if end > start else NO_SLOTS
            # Each component's device slots are taken even when the Full ones could not be
            # (its allocation may evict its own device data first, as it would for a request).
            for leg in legs:
                if refused or not leg.size:
                    continue
                leg.device = core.transfers[leg.name].alloc_device(core, leg)
                refused = leg.device is None
        except BaseException:
            # Nothing is in flight yet: release what this call took before re-raising.
            if slots is not None and len(slots):
                core.device_full.give_back(slots)
            self._give_back_legs(legs)
            core.unlock_move(locks)
            raise
        handle = None
        if slots is not None and not refused:
            # Page ids, made once here from the tree's own slots (no index tensor on the way).
            pages: dict[str, PagePairs] = {}
            if end > start:
                page = core.full_page
                host_slots = run_above(node, end - start, host=True)
                pages[FULL] = (vouched_pages(slots, page), host_slots[::page] // page)
            for leg in legs:
                move = core.transfers[leg.name].load_move(core, leg, node, slots, start)
                if move is not None:
                    pages[leg.name] = core.move_pages(leg.name, move[0], move[1])
                    leg.moved = len(move[1])
            self._writer.flush()  # the worker wakes for the load: the queued writes ride along
            try:
                # Trusted page ids: allocator slots over the group's pools (as TierWriter.flush).
                handle = core.controller.submit_load_pages(pages, inline=wait_now)
            except QueueFull:
                handle = None
        if slots is None or handle is None:
            if slots is not None and len(slots):
                core.device_full.give_back(slots)
            self._give_back_legs(legs)
            core.counters.load_backs_refused += 1
            core.unlock_move(locks)
            return self._done_load(LoadBack(0, self._core.tier.match_key(key)))
        load = TierLoad(num_tokens=end - start, handle=handle, finish=self._finish_load)
        pending = PendingLoad(
            key=key, start=start, locks=locks, legs=tuple(legs), device_slots=slots, load=load
        )
        if wait_now and core.controller.runs_inline:
            # The load ran on this thread (its ack is recorded): commit it now, as its wait
            # would. (The device room above may have polled and committed another load of the
            # same path meanwhile: `_commit_path` sees that and the insert commit runs.)
            ack = core.controller.wait(handle.op_id, 0)
            if ack is not None:
                self._commit(pending, ack, node)
                return load
        core.pending[handle.op_id] = pending
        return load

    def _give_back_legs(self, legs: list[TransferLeg]) -> None:
        """Free the device slots the legs of a load that never started took."""
        for leg in legs:
            if leg.device is not None:
                self._core.components[leg.name].give_back(leg.device)
                leg.device = None

    def load_back(self, node: TreeNode) -> LoadBack:
        """Blocking `start_load_back(node)` (an engine without a layer-wise forward): waits for
        the whole load and its commit. Returns the tokens loaded (0 when refused, failed or not
        acknowledged within `transfer_timeout_s`: a late ack still commits at `poll`) and the
        device match of the prefix (valid while `match.last_node` is locked)."""
        load = self.start(node, wait_now=True)
        result = load.wait(self._core.params.transfer_timeout_s)
        if result is not None:
            return result
        # Still in flight, not failed: its late ack commits it (or counts it in failed_ops).
        self._core.counters.transfer_timeouts += 1
        device = self._core.tier.match_key(key_of(self._core.device_tree, node))
        return LoadBack(0, device)

    def _done_load(self, result: LoadBack) -> TierLoad:
        return TierLoad(num_tokens=0, handle=None, finish=self._finish_load, result=result)

    def _finish_load(self, load: TierLoad, timeout_s: float | None) -> LoadBack | None:
        op_id = load.op_id
        if op_id is None or op_id not in self._core.pending:
            return load.result  # committed by a poll already
        began = time.perf_counter()
        ack = self._core.controller.wait(op_id, timeout_s)
        self._core.counters.transfer_wait_seconds += time.perf_counter() - began
        if ack is not None:
            self._core.on_ack(ack)
        return load.result

    def commit(self, pending: PendingLoad, ack: Ack) -> None:
        """Commit a load's acknowledgement (`TierCore.on_ack`): an ok load inserts its key
        with the loaded slots (the nodes the key runs over take them again), a failed one
        frees them; both release the load's locks."""
        self._commit(pending, ack, None)

    def _commit(self, pending: PendingLoad, ack: Ack, node: TreeNode | None) -> None:
        """`commit`; `node`: the node the key ends at, for a load committed in the call that
        started it (inline): a Full-only tree of the exact classes then revives the path from it
        (`HostWalks.revive_path`) instead of walking the key again (the same state), unless
        part of the path came back to the device meanwhile (then the insert below)."""
        tree = self._core.device_tree
        anchor = pending.device_receipt.anchor
        if (
            ack.ok
            and node is not None
            and not pending.legs
            and self._core.tier._one_frame  # Full-only, exact classes (no insert override)
            and self._commit_path(pending, node)
        ):
            pass  # revived along the path
        elif ack.ok:
            loaded = pending.device_slots
            if loaded.device != tree.full_device:
                loaded = loaded.to(tree.full_device)
            value = torch.cat([tree.prefix_slots(anchor), loaded])
            core = self._core
            inputs: dict[str, ComponentInsert] = {}
            for leg in pending.legs:
                inp = core.transfers[leg.name].load_input(leg)
                if inp is not None:
                    inputs[leg.name] = inp
            result = tree.insert(
                pending.key, value, cached_len=pending.start, inputs=inputs or None
            )
            duplicates = result.duplicates(value)
            if duplicates.numel():
                core.device_full.give_back(duplicates)
            for leg in pending.legs:
                if leg.device is not None and leg.name not in result.adopted_states:
                    core.components[leg.name].give_back(leg.device)
            num = len(pending.key) - pending.start
            core.counters.loaded_tokens += num
            core.counters.bytes_h2d += num // core.page_size * core.page_bytes + sum(
                core.leg_bytes(leg, leg.moved) for leg in pending.legs
            )
            node = result.last_node
            pending.load.result = LoadBack(
                num, MatchResult(len(pending.key), tree.prefix_slots(node), node)
            )
        else:
            self._core.counters.failed_ops += 1
            if len(pending.device_slots):
                self._core.device_full.give_back(pending.device_slots)
            for leg in pending.legs:
                if leg.device is not None:
                    self._core.components[leg.name].give_back(leg.device)
            pending.load.result = LoadBack(
                0, MatchResult(pending.start, tree.prefix_slots(anchor), anchor)
            )
        self._core.unlock_move(pending.locks)

    def _commit_path(self, pending: PendingLoad, node: TreeNode) -> bool:
        """An ok Full-only load whose key ends at `node`: the off-device nodes above it take
        the loaded slots (the insert's revive, without its walk); nothing is a duplicate.
        False, changing nothing, when those nodes no longer hold exactly the loaded tokens
        (`HostWalks.revive_path`)."""
        core = self._core
        tree = core.device_tree
        loaded = pending.device_slots
        if loaded.device.type != "cpu":
            loaded = loaded.cpu()
        # The insert's slot check and marks.
        if not core.tier.revive_path(node, loaded.numpy(), tree._slot_checker):
            return False
        num = len(pending.key) - pending.start
        core.counters.loaded_tokens += num
        core.counters.bytes_h2d += num // core.page_size * core.page_bytes
        pending.load.result = LoadBack(
            num, MatchResult(len(pending.key), tree.prefix_slots(node), node)
        )
        return True
