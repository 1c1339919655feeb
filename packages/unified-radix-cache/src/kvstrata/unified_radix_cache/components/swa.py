"""`SWAComponent`: sliding-window KV, the second pool of models that interleave full and
sliding-window attention layers.

A token's SWA slot is addressed through its full slot (the SWA allocator's full-to-SWA map),
so the component's data on a node is the node's full slot array while its SWA slots are live,
and None once they are freed (a tombstone: the full KV stays, the node keeps its place).

    prefix:  [ tombstone | tombstone |  live  |  live  ]   a match may end here only if the
                                      <---- >= window ---->  live run behind it covers a window

- match: a node may end the match when the live tokens since the last tombstone reach
  `sliding_window` (or there is no tombstone on the path at all);
- lock: from the anchor upward until one window is covered; the receipt records how many
  tokens that is, so unlock releases exactly that span even if nodes in it split meanwhile;
- eviction: own LRU list over unlocked live nodes; an internal node becomes a tombstone, an
  unlocked leaf leaves the tree (its full slots with it);
- insert: a tombstone the key runs over is revived from the caller's slots when the caller still
  holds live SWA slots there (one a running request holds keeps its full slots and takes the
  caller's SWA pages under them); the new leaf is split at `evicted_len` (rounded up to a page):
  the part whose SWA slots the request already dropped is stored as a tombstone.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import numpy.typing as npt
import torch

from kvstrata.unified_radix_cache.components.base import ComponentInsert, LRUListComponent
from kvstrata.unified_radix_cache.components.transfer import (
    ComponentTransfer,
    TierAccess,
    TransferLeg,
    runs_back,
)
from kvstrata.unified_radix_cache.errors import IntegrityError, InvalidConfig, InvalidInsert

if TYPE_CHECKING:
    from collections.abc import Sequence

    from kvstrata.unified_radix_cache.node import TreeNode
    from kvstrata.unified_radix_cache.results import LockReceipt


class SWASlotSink(Protocol):
    """What SWAComponent needs of `kvstrata.allocator.SWAAllocator`."""

    @property
    def device(self) -> torch.device: ...

    @property
    def swa_size(self) -> int: ...

    def free_swa(self, indices: torch.Tensor, /) -> None: ...

    def swa_available_size(self) -> int: ...

    def translate(self, indices: torch.Tensor, /) -> torch.Tensor: ...

    def move_swa(self, dst: torch.Tensor, src: torch.Tensor, /) -> None: ...


@dataclass(frozen=True, kw_only=True)
class SWAInsert(ComponentInsert):
    """The caller already freed the SWA slots of key positions `[0, evicted_len)` (tokens that
    slid out of the window during decode or chunked prefill)."""

    evicted_len: int = 0


class SWAComponent(LRUListComponent):
    """Sliding-window KV slots over an SWA allocator (the same one FullComponent frees into)."""

    name = "swa"
    priority = 1

    def __init__(self, allocator: SWASlotSink, *, sliding_window: int) -> None:
        if sliding_window < 1:
            raise InvalidConfig(f"sliding_window must be >= 1, got {sliding_window}")
        super().__init__(allocator.device)
        self.allocator = allocator
        self.sliding_window = sliding_window
        self._transfer = SWATransfer(self)

    def capacity(self) -> int:
        return int(self.allocator.swa_size)

    def free_size(self) -> int:
        return int(self.allocator.swa_available_size())

    def node_size(self, node: TreeNode) -> int:
        assert node.comp_values is not None
        return len(node.value) if node.comp_values[self.index] is not None else 0

    def is_live(self, node: TreeNode) -> bool:
        assert node.comp_values is not None
        return node.comp_values[self.index] is not None

    # -- match ------------------------------------------------------------------------------
    def match_end(self, path: list[TreeNode]) -> int:
        i = self.index
        window = self.sliding_window
        best = 0
        live_run: float = float("inf")  # no tombstone yet: every prefix has its window
        for k, node in enumerate(path, 1):
            assert node.comp_values is not None
            if node.comp_values[i] is None:
                live_run = 0
            else:
                live_run += len(node.value)
            if live_run >= window:
                best = k
        return best

    # -- structure ------------------------------------------------------------------------
    def on_split(self, upper: TreeNode, lower: TreeNode) -> None:
        i = self.index
        assert upper.comp_values is not None and lower.comp_values is not None
        assert upper.comp_locks is not None and lower.comp_locks is not None
        upper.comp_locks[i] = lower.comp_locks[i]
        if lower.comp_values[i] is not None:
            upper.comp_values[i] = upper.value
            lower.comp_values[i] = lower.value
            if lower in self.lru:
                self.lru.insert_before(upper, lower)

    def check_insert_input(self, inp: ComponentInsert, num_tokens: int) -> None:
        if not isinstance(inp, SWAInsert):
            raise InvalidInsert(f"the swa input must be an SWAInsert, got {type(inp).__name__}")
        if not 0 <= inp.evicted_len <= num_tokens:
            raise InvalidInsert(f"SWAInsert.evicted_len {inp.evicted_len} outside 0..{num_tokens}")

    def on_insert_overlap(
        self,
        node: TreeNode,
        start: int,
        value: npt.NDArray[np.int64],
        inp: ComponentInsert | None,
        cached_len: int,
    ) -> bool:
        i = self.index
        assert node.comp_values is not None
        if node.comp_values[i] is not None:
            return False  # live already: the caller's slots are duplicates
        evicted_len = inp.evicted_len if isinstance(inp, SWAInsert) else 0
        if start < max(cached_len, evicted_len):
            return False  # the caller has no live SWA slots there (or they are the tree's own)
        size = len(node.value)
        if node.lock_ref:
            # A running request reads the node's full slots: never swap them under it. The
            # caller's SWA pages (same tokens, same positions: the same KV) move under the
            # node's full slots instead, so whoever takes this prefix (the caller too: its
            # slots become the node's) finds its window; the caller's full slots stay
            # duplicates. Without this the caller's window would read the padding slot.
            return self._adopt_swa_under(node, value[start : start + size])
        tree = self.tree
        tree.component("full").queue_free(node.value)  # old full slots; their SWA ones are gone
        node.value = value[start : start + size].copy()
        node.comp_values[i] = node.value
        self.evictable_size += size
        self.lru.touch(node)
        return True

    def _adopt_swa_under(self, node: TreeNode, own: npt.NDArray[np.int64]) -> bool:
        """Revive tombstone `node` in place with the SWA pages of the caller's full slots
        `own` (when all of them still have one). Always False: the caller's full slots are
        still duplicates to free."""
        i = self.index
        assert node.comp_values is not None
        src = torch.from_numpy(own)
        dst = torch.from_numpy(node.value)
        if self.device.type != "cpu":
            src, dst = src.to(self.device), dst.to(self.device)
        if bool((self.allocator.translate(src) == 0).any()):
            return False
        self.allocator.move_swa(dst, src)
        node.comp_values[i] = node.value
        self.evictable_size += len(node.value)
        self.lru.touch(node)
        return False

    def on_insert_new(self, node: TreeNode, start: int, inp: ComponentInsert | None) -> None:
        i = self.index
        assert node.comp_values is not None
        evicted_len = inp.evicted_len if isinstance(inp, SWAInsert) else 0
        size = len(node.value)
        if evicted_len > start:
            page = self.tree.page_size
            boundary = -(-evicted_len // page) * page - start  # tokens of the node to tombstone
            if boundary >= size:
                self._pending.append(node.value)  # free_swa skips slots already without one
                return
            upper = self.tree.split_node(node, boundary)
            self._pending.append(upper.value)
            size = len(node.value)
        node.comp_values[i] = node.value
        self.evictable_size += size
        self.lru.touch(node)

    def on_revive(self, node: TreeNode, start: int, inp: ComponentInsert | None) -> None:
        """Hierarchical mode: off-device `node` just took device slots (a load-back or an insert
        over it). When its SWA slots hold its window KV (`start` at or past the input's
        `evicted_len`) it joins the LRU; otherwise it becomes a tombstone and its SWA slots are
        queued for `free_swa` (the full ones stay)."""
        i = self.index
        assert node.comp_values is not None and node.comp_values[i] is None, (
            f"SWAComponent: revived node {node.id} already has SWA data"
        )
        evicted_len = inp.evicted_len if isinstance(inp, SWAInsert) else 0
        if start >= evicted_len:
            node.comp_values[i] = node.value
            self.evictable_size += len(node.value)
            self.lru.touch(node)
        else:
            self._pending.append(node.value)

    # -- host tier ----------------------------------------------------------------------------
    def window_restorable(self, node: TreeNode) -> bool:
        """Whether the sliding window before the end of `node` can be restored: each node of
        it on the device with live SWA slots, or off the device with a host SWA copy (a path
        without a gap back to the root counts too). O(nodes in the window)."""
        covered = 0
        probe = node
        while probe.parent is not None and covered < self.sliding_window:
            if not (
                self.is_live(probe) if len(probe.value) else self.host_value(probe) is not None
            ):
                return False
            covered += probe.num_tokens
            probe = probe.parent
        return True

    def host_copy(self, node: TreeNode) -> npt.NDArray[np.int64] | None:
        """The host SWA slots of `node` (one per token), or None."""
        value = self.host_value(node)
        assert value is None or isinstance(value, np.ndarray)
        return value

    def host_hit_may_end(self, node: TreeNode) -> bool:
        """A host hit ends only at a node with a host value whose window is restorable."""
        return node.host_value is not None and self.window_restorable(node)

    def tier_transfer(self) -> SWATransfer:
        return self._transfer

    # -- eviction -------------------------------------------------------------------------
    def release(self, node: TreeNode, node_goes: bool) -> int:
        i = self.index
        assert node.comp_values is not None and node.comp_locks is not None
        assert node.comp_locks[i] == 0, f"SWAComponent: releasing locked node {node.id}"
        size = len(node.value)
        self.evictable_size -= size
        self.lru.discard(node)
        node.comp_values[i] = None
        if not node_goes:
            self._pending.append(node.value)
        return size

    def give_back(self, slots: torch.Tensor) -> None:
        self.allocator.free_swa(slots)

    # -- locking ----------------------------------------------------------------------------
    def lock(self, anchor: TreeNode) -> int | None:
        """Lock live nodes upward from `anchor` until one window is covered (stopping at a
        tombstone). Boundary: the number of tokens locked, or None if none."""
        i = self.index
        window = self.sliding_window
        locked = 0
        node = anchor
        while node.parent is not None and locked < window:
            assert node.comp_values is not None and node.comp_locks is not None
            if node.comp_values[i] is None:
                break
            size = len(node.value)
            self.lock_node(node, size)
            locked += size
            node = node.parent
        return locked or None

    def unlock(self, anchor: TreeNode, boundary: int | None) -> None:
        if boundary is None:
            return
        released = 0
        node = anchor
        while released < boundary:
            assert node.parent is not None, "SWAComponent: unlock ran past the root"
            size = len(node.value)
            self.unlock_node(node, size)
            released += size
            node = node.parent
        assert released == boundary, "SWAComponent: receipt boundary is not a node boundary"

    # -- integrity ------------------------------------------------------------------------
    def check_node(self, node: TreeNode) -> None:
        assert node.comp_values is not None
        data = node.comp_values[self.index]
        if data is not None and data is not node.value:
            raise IntegrityError(f"node {node.id}: SWA data is not the node's full slots")
        self.check_listed(node, data is not None)

    def check_locks(self, receipts: Iterable[LockReceipt]) -> None:
        i = self.index
        expected: dict[int, int] = {}
        for receipt in receipts:
            boundary = receipt.boundaries[i]
            if boundary is None:
                continue
            covered = 0
            node = receipt.anchor
            while covered < boundary and node.parent is not None:
                expected[node.id] = expected.get(node.id, 0) + 1
                covered += len(node.value)
                node = node.parent
            if covered != boundary:
                raise IntegrityError(
                    f"receipt {receipt.receipt_id}: SWA span {covered} != {boundary}"
                )
        self.check_lock_counts(expected)


class SWATransfer(ComponentTransfer):
    """The tier hooks of an `SWAComponent` (member "swa" of the pool group, host pool of the
    tree's page size): the SWA pages of the last sliding window before a prefix's end move with
    its pages, translated through the allocator's full-to-SWA map.

    - write: the window's SWA pages still live on the device and not yet on the host (whole
      nodes: the node the window starts inside is split), none when the window is not live as a
      whole (a copy could never make a hit);
    - backup: the host SWA page of each backed-up node beside its page; only the last window
      before the stored end names a prefix a prefetch may end at;
    - prefetch: only up to the deepest page whose last window's SWA pages a backup stored, plus
      those SWA pages;
    - load: SWA slots come in step with the full ones; the window's SWA pages come back, the
      nodes before it as SWA tombstones (`SWAInsert.evicted_len`).
    """

    gauge = (
        "host_swa_tokens",
        "Host tier SWA token slots by state (full + sliding-window models only).",
    )

    def __init__(self, component: SWAComponent) -> None:
        self.component = component
        self.name = component.name

    def window_pages(self, page_size: int) -> int:
        """The pages the sliding window spans (whole pages)."""
        return -(-self.component.sliding_window // page_size)

    # -- writes ---------------------------------------------------------------------------
    def plan_write(self, tiers: TierAccess, node: TreeNode, end: int) -> TransferLeg | None:
        ranges = self._window_ranges(tiers, node, end)
        if not ranges:
            return None
        return TransferLeg(name=self.name, size=sum(hi - lo for lo, hi in ranges), ranges=ranges)

    def _window_ranges(
        self, tiers: TierAccess, node: TreeNode, end: int
    ) -> tuple[tuple[int, int], ...]:
        """The key ranges (node runs, ascending) of the last sliding window before `end` (whole
        pages; the path ending at device node `node`) whose SWA pages a write must copy: live on
        the device and without a host SWA copy yet. Empty when the window is not live on the
        device as a whole. Splits the node the window starts inside, so host SWA copies cover
        whole nodes. O(nodes in the window)."""
        swa = self.component
        page = tiers.page_size
        lo = max(0, end - self.window_pages(page) * page)
        ranges: list[tuple[int, int]] = []
        pos, probe = end, node
        while pos > lo:
            if probe.parent is None:
                break
            if not swa.is_live(probe):
                return ()
            first = pos - probe.num_tokens
            if first < lo:
                tiers.split_node(probe, lo - first)  # probe keeps [lo, pos)
                first = lo
            if swa.host_copy(probe) is None:
                ranges.append((first, pos))
            pos = first
            probe = probe.parent
        return tuple(reversed(ranges))

    def write_source(self, tiers: TierAccess, node: TreeNode, leg: TransferLeg) -> torch.Tensor:
        prefix = tiers.prefix_slots(node)
        window = torch.cat([prefix[lo:hi] for lo, hi in leg.ranges])
        return self.component.allocator.translate(window)

    def commit_write(self, tiers: TierAccess, leg: TransferLeg, node: TreeNode, end: int) -> None:
        assert leg.host is not None
        self._commit_ranges(tiers, node, end, leg.ranges, leg.host)

    def _commit_ranges(
        self,
        tiers: TierAccess,
        node: TreeNode,
        end: int,
        ranges: tuple[tuple[int, int], ...],
        host_swa: torch.Tensor,
    ) -> None:
        """Give the nodes covering the key `ranges` (on the path ending at `node`, at `end`)
        their slices of `host_swa`; a node that has host SWA slots already keeps them and the
        new ones go back to the allocator. Ranges start at node boundaries (nodes only split
        since)."""
        values = host_swa.numpy()
        offsets: list[int] = []
        base = 0
        for lo, hi in ranges:
            offsets.append(base)
            base += hi - lo
        k = len(ranges) - 1
        pos, probe = end, node
        while k >= 0 and probe.parent is not None:
            first = pos - probe.num_tokens
            lo, hi = ranges[k]
            if first < hi:
                assert lo <= first and pos <= hi, (
                    f"host SWA commit: node {probe.id} straddles the range {lo}..{hi}"
                )
                at = offsets[k] + first - lo
                part = values[at : at + probe.num_tokens].copy()
                if not tiers.set_host(self.name, probe, part):
                    tiers.free_component_host(self.name, torch.from_numpy(part))
                if first == lo:
                    k -= 1
            pos = first
            probe = probe.parent
        assert k < 0, "host SWA commit: the ranges run past the root"

    def backup_start(self, leg: TransferLeg) -> int | None:
        """The window's SWA pages may lie before the write's new pages."""
        return leg.ranges[0][0] if leg.ranges else None

    # -- backups ----------------------------------------------------------------------------
    def backup_pages(
        self, tiers: TierAccess, node: TreeNode, first: int, num_keys: int
    ) -> list[int | None]:
        """Per page, the host SWA page of the node holding it, or None without a copy."""
        page = tiers.page_size
        pages: list[int | None] = [None] * (num_keys - first)
        start = first * page
        for probe, lo, end in runs_back(node, start, num_keys * page):
            host_swa = self.component.host_copy(probe)
            if host_swa is not None:
                for at in range(max(lo, start), end, page):
                    pages[at // page - first] = int(host_swa[at - lo]) // page
        return pages

    def remembered(self, stored: Sequence[int], done: int) -> list[int]:
        """Only the last window before `done` makes a stored prefix's window restorable."""
        window_from = done - self.window_pages(self.component.tree.page_size)
        return [i for i in stored if i >= window_from]

    # -- prefetches ---------------------------------------------------------------------------
    def prefetch_pages(
        self, tiers: TierAccess, anchor: TreeNode, start: int, keys: Sequence[bytes]
    ) -> int:
        """The longest run of `keys` whose last window's SWA pages a backup of this cache
        stored, as far as it knows; a window reaching before `start` needs the host prefix's
        window restorable. O(len(keys) + nodes in the window)."""
        window = self.window_pages(tiers.page_size)
        before_ok = start == 0 or self.component.window_restorable(anchor)
        best = run = 0
        for e, page_key in enumerate(keys, start=1):
            run = run + 1 if tiers.knows_stored(page_key) else 0
            if run >= window or (run == e and before_ok):
                best = e
        return best

    def plan_prefetch(self, tiers: TierAccess, start: int, keys: Sequence[bytes]) -> TransferLeg:
        page = tiers.page_size
        num = len(keys)
        first = max(0, num - self.window_pages(page))
        return TransferLeg(
            name=self.name,
            size=(num - first) * page,
            first=first,
            keys=tuple(keys[first:]),
            ranges=((start + first * page, start + num * page),),
        )

    def commit_prefetch(
        self, tiers: TierAccess, leg: TransferLeg, node: TreeNode, end: int
    ) -> None:
        """Split the node the window starts inside, then give the window's nodes their SWA
        pages."""
        assert leg.host is not None
        lo = leg.ranges[0][0]
        pos, probe = end, node
        while pos > lo and probe.parent is not None:
            first = pos - probe.num_tokens
            if first < lo:
                tiers.split_node(probe, lo - first)  # probe keeps [lo, pos)
                break
            pos = first
            probe = probe.parent
        self._commit_ranges(tiers, node, end, ((lo, end),), leg.host)

    # -- loads ------------------------------------------------------------------------------
    def plan_load(self, tiers: TierAccess, node: TreeNode, start: int, end: int) -> TransferLeg:
        """SWA pages come back from where, going back from `end` over off-device nodes with
        host SWA copies, a sliding window is covered (never before `start`)."""
        swa = self.component
        pos, probe = end, node
        while (
            pos > start
            and end - pos < swa.sliding_window
            and probe.parent is not None
            and swa.host_copy(probe) is not None
        ):
            pos -= probe.num_tokens
            probe = probe.parent
        return TransferLeg(name=self.name, start=pos)

    def load_move(
        self, tiers: TierAccess, leg: TransferLeg, node: TreeNode, device: torch.Tensor, start: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        end = start + len(device)
        if leg.start >= end:
            return None
        translated = self.component.allocator.translate(device[leg.start - start :])
        return translated, self._host_slots(node, end, leg.start)

    def _host_slots(self, node: TreeNode, end: int, lo: int) -> torch.Tensor:
        """Host SWA slots of key[lo:end], the nodes ending at `node` (host-locked)."""
        parts: list[torch.Tensor] = []
        pos, probe = end, node
        while pos > lo:
            value = self.component.host_copy(probe)
            assert value is not None, f"node {probe.id} in a loaded window without host SWA"
            parts.append(torch.from_numpy(value))
            pos -= probe.num_tokens
            assert probe.parent is not None
            probe = probe.parent
        return torch.cat(parts[::-1])

    def load_input(self, leg: TransferLeg) -> ComponentInsert | None:
        """Only the window came back into the SWA slots: the rest is a tombstone."""
        return SWAInsert(evicted_len=leg.start)

    def load_device_held(self, leg: TransferLeg, num_slots: int) -> int:
        """SWA slots are allocated in step with the Full ones."""
        return num_slots
