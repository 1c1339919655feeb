"""Host -> device load-backs of a `HierarchicalCache` (`TierLoader`).

A load-back allocates device slots for the off-device part of a prefix (and a device state
slot, or SWA slots in step with the full ones), submits one layer-wise LoadOp and returns a
`TierLoad` the forward waits on per layer; the nodes get their device slots only on the ack.
"""

from __future__ import annotations

import time

import torch

from kvstrata.hybrid_cache import (
    Ack,
    LoadOp,
    PageMove,
    QueueFull,
)
from kvstrata.unified_radix_cache.components.base import ComponentInsert
from kvstrata.unified_radix_cache.components.mamba import MambaInsert
from kvstrata.unified_radix_cache.components.swa import SWAInsert
from kvstrata.unified_radix_cache.node import TreeNode
from kvstrata.unified_radix_cache.paths import key_of
from kvstrata.unified_radix_cache.results import (
    MatchResult,
)
from kvstrata.unified_radix_cache.tier_core import (
    FULL,
    MAMBA,
    NO_SLOTS,
    SWA,
    PendingLoad,
    TierCore,
    prefix_len,
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
        (`TierLoad.wait`, `poll`, `drain`). Nothing to load or no device room: a done handle
        with `loaded_len` 0 and the tree unchanged. Raises ForeignNode for a node not in the
        tree (e.g. host-evicted since the match)."""
        tree = self._core.device_tree
        key = key_of(tree, node)
        device = self._core.tier.match_key(key)
        anchor = device.last_node
        mamba = self._core.mamba
        host_state: int | None = None
        if mamba is not None or self._core.swa is not None:
            # The on-device run may reach past the device hit (nodes without a device state,
            # SWA tombstones): their pages stay; only the off-device pages move (with the
            # boundary state, or the window's SWA pages).
            anchor = node
            while anchor.parent is not None and not len(anchor.value):
                anchor = anchor.parent
            if mamba is not None and mamba.slot(node) is None:
                host_state = mamba.host_slot(node)
        start, end = prefix_len(anchor), len(key)
        swa_from = self._host_window_start(node, start, end)
        if start >= end and host_state is None:
            return self._done_load(LoadBack(0, device))
        device_receipt = tree.lock(anchor)
        host_receipt = self._core.tier.lock(node)
        slots: torch.Tensor | None = None
        state: torch.Tensor | None = None
        try:
            slots = self._room.alloc(end - start) if end > start else NO_SLOTS
            state = self._room.alloc_state() if host_state is not None else None
        except BaseException:
            # Nothing is in flight yet: release what this call took before re-raising.
            if slots is not None and len(slots):
                self._core.device_full.give_back(slots)
            self._core.tier.unlock(host_receipt)
            tree.unlock(device_receipt)
            raise
        handle = None
        if slots is not None and (host_state is None or state is not None):
            moves: dict[str, PageMove] = {}
            if end > start:
                host_slots = self._core.tier.host_slots(node)[start:end]
                moves[FULL] = PageMove(device=slots, host=host_slots)
            if state is not None and host_state is not None:
                moves[MAMBA] = PageMove(
                    device=state, host=torch.tensor([host_state], dtype=torch.int64)
                )
            if self._core.swa is not None and swa_from < end:
                assert slots is not None
                moves[SWA] = PageMove(
                    device=self._core.swa.allocator.translate(slots[swa_from - start :]),
                    host=self._host_swa_slots(node, end, swa_from),
                )
            self._writer.flush()  # the worker wakes for the load: the queued writes ride along
            try:
                handle = self._core.controller.submit_load(LoadOp(moves=moves), inline=wait_now)
            except QueueFull:
                handle = None
        if slots is None or handle is None:
            if slots is not None and len(slots):
                self._core.device_full.give_back(slots)
            if state is not None and mamba is not None:
                mamba.give_back(state)
            self._core.counters.load_backs_refused += 1
            self._core.tier.unlock(host_receipt)
            tree.unlock(device_receipt)
            return self._done_load(LoadBack(0, device))
        load = TierLoad(num_tokens=end - start, handle=handle, finish=self._finish_load)
        self._core.pending[handle.op_id] = PendingLoad(
            key=key,
            start=start,
            device_slots=slots,
            device_receipt=device_receipt,
            host_receipt=host_receipt,
            load=load,
            device_state=state,
            swa_from=swa_from,
        )
        return load

    def _host_window_start(self, node: TreeNode, start: int, end: int) -> int:
        """SWA: where the load of key[start:end] (ending at `node`) starts bringing SWA pages:
        back from `end` over off-device nodes with host SWA copies until a sliding window is
        covered (never before `start`). Nodes before it come back as SWA tombstones. `end`
        when the tree has no SWA."""
        swa = self._core.swa
        if swa is None:
            return end
        pos, probe = end, node
        while (
            pos > start
            and end - pos < swa.sliding_window
            and probe.parent is not None
            and swa.host_copy(probe) is not None
        ):
            pos -= probe.num_tokens
            probe = probe.parent
        return pos

    def _host_swa_slots(self, node: TreeNode, end: int, swa_from: int) -> torch.Tensor:
        """Host SWA slots of key[swa_from:end], the nodes ending at `node` (host-locked)."""
        parts: list[torch.Tensor] = []
        pos, probe = end, node
        while pos > swa_from:
            assert self._core.swa is not None
            value = self._core.swa.host_copy(probe)
            assert value is not None, f"node {probe.id} in a loaded window without host SWA"
            parts.append(torch.from_numpy(value))
            pos -= probe.num_tokens
            assert probe.parent is not None
            probe = probe.parent
        return torch.cat(parts[::-1])

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
        tree = self._core.device_tree
        anchor = pending.device_receipt.anchor
        if ack.ok:
            value = torch.cat(
                [tree.prefix_slots(anchor), pending.device_slots.to(tree.full_device)]
            )
            state = pending.device_state
            inputs: dict[str, ComponentInsert] | None = None
            if state is not None:
                inputs = {MAMBA: MambaInsert(slot=int(state.item()))}
            elif self._core.swa is not None:
                # Only the window came back into the SWA slots: the rest is a tombstone.
                inputs = {SWA: SWAInsert(evicted_len=pending.swa_from)}
            result = tree.insert(pending.key, value, cached_len=pending.start, inputs=inputs)
            duplicates = result.duplicates(value)
            if len(duplicates):
                self._core.device_full.give_back(duplicates)
            if state is not None and MAMBA not in result.adopted_states:
                self._room.give_back_state(state)
            num = len(pending.key) - pending.start
            self._core.counters.loaded_tokens += num
            swa_pages = (len(pending.key) - pending.swa_from) // self._core.page_size
            self._core.counters.bytes_h2d += (
                num // self._core.page_size * self._core.page_bytes
                + (self._core.state_bytes if state is not None else 0)
                + (swa_pages * self._core.swa_page_bytes if self._core.swa is not None else 0)
            )
            node = result.last_node
            pending.load.result = LoadBack(
                num, MatchResult(len(pending.key), tree.prefix_slots(node), node)
            )
        else:
            self._core.counters.failed_ops += 1
            if len(pending.device_slots):
                self._core.device_full.give_back(pending.device_slots)
            if pending.device_state is not None:
                self._room.give_back_state(pending.device_state)
            pending.load.result = LoadBack(
                0, MatchResult(pending.start, tree.prefix_slots(anchor), anchor)
            )
        self._core.tier.unlock(pending.host_receipt)
        tree.unlock(pending.device_receipt)
