"""`ComponentTransfer`: how one component's data moves between the tiers of a `HierarchicalCache`.

The transfer kinds (tier_writes.py, tier_prefetch.py, tier_loads.py) move Full pages themselves
and ask each other component of the tree for its part of every transfer through these hooks, so
adding a component kind needs no change to them. A component offers its hooks with
`TreeComponent.tier_transfer()` (None: the component cannot be tiered); its name is also the
name of its member in the controller's pool group, and its host slots come from the host
allocator `HierarchicalCache(component_hosts={name: ...})` gives it.

| transfer | hook                                   | what it decides                              |
|----------|----------------------------------------|----------------------------------------------|
| write    | `plan_write`                           | what goes down with a page run (host slots)  |
|          | `write_source`                         | the device slots it is read from             |
|          | `commit_write`                         | the nodes that take the host slots           |
| backup   | `backup_pages`                         | its host page beside each stored page        |
|          | `remembered`                           | stored pages a later prefetch may end at     |
| prefetch | `prefetch_pages` / `plan_prefetch`     | how far a prefetch may go, what it fetches   |
|          | `commit_prefetch`                      | the nodes that take what arrived             |
| load     | `plan_load` / `alloc_device`           | what comes back (device slots to allocate)   |
|          | `load_move` / `load_input`             | the move, and the insert input at the ack    |
|          | `load_device_held`                     | device slots the load holds (integrity)      |

One transfer's part for one component is a `TransferLeg`: the host slots it holds until its ack
commits them (write, prefetch), the device slots it holds (load), and where in the key they go.
The tier code allocates, frees, counts and checks legs generically (host slots through
`TierAccess.alloc_component_host`, which host-evicts for that pool when short; device slots
through the component's `give_back`); the hooks only decide.

A per-node state at the end of a run (Mamba) and a per-token copy of a sliding window (SWA) are
the two kinds in this package: components/mamba.py and components/swa.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

    import torch

    from kvstrata.unified_radix_cache.node import ComponentValue, TreeNode


def runs_back(node: TreeNode, start: int, end: int) -> Iterator[tuple[TreeNode, int, int]]:
    """`(probe, first, last)` for each node on the path ending at `node` (whose run ends at key
    position `end`), from `node` towards the root, while its run ends past `start`: the node's
    run is key[first:last]."""
    probe = node
    while probe.parent is not None and end > start:
        first = end - probe.num_tokens
        yield probe, first, end
        end = first
        probe = probe.parent


class TierAccess(Protocol):
    """What a component's transfer hooks may call on the tiered cache (`TierCore`)."""

    @property
    def page_size(self) -> int: ...

    def split_node(self, node: TreeNode, num_tokens: int) -> TreeNode:
        """Split `node` after `num_tokens` tokens (the device tree's split; both tiers)."""
        ...

    def prefix_slots(self, node: TreeNode) -> torch.Tensor:
        """The Full device slots of the prefix ending at on-device `node`."""
        ...

    def set_host(self, name: str, node: TreeNode, value: ComponentValue) -> bool:
        """Give `node` component `name`'s host copy `value` (`HostTier.set_host`)."""
        ...

    def free_component_host(self, name: str, slots: torch.Tensor) -> None:
        """Hand host slots of component `name` back to its host allocator."""
        ...

    def evict_device_component(self, name: str, amount: int) -> None:
        """Evict at least `amount` of component `name`'s device data (the tree's order)."""
        ...

    def knows_stored(self, page_key: bytes) -> bool:
        """Whether a backup of this cache stored a page key a prefetch may end at (the keys
        `ComponentTransfer.remembered` chose)."""
        ...


@dataclass(frozen=True, kw_only=True)
class ComponentInsert:
    """Base of the per-component inputs to `insert(..., inputs={name: ...})` (re-exported by
    components/base.py, where the tree hooks that take them are)."""


@dataclass(kw_only=True, eq=False)
class TransferLeg:
    """One component's part of one transfer in flight.

    `size`: host slots a write or prefetch wants (allocated by the tier code into `host`), or
    device slots a load wants (allocated by `alloc_device` into `device`). `host`: the host
    slots the transfer holds (until its commit, or those a load reads). `ranges`: the key ranges
    (node runs, ascending) `host` covers. `first`: a prefetch's first page carrying this
    component's data. `keys`: the page keys whose stored data a prefetch fetches (forgotten
    when they do not arrive). `start`: a load's first key position whose data comes back.
    `moved`: host slots a load reads (for the byte counters)."""

    name: str
    size: int = 0
    host: torch.Tensor | None = None
    device: torch.Tensor | None = None
    ranges: tuple[tuple[int, int], ...] = ()
    first: int = 0
    keys: tuple[bytes, ...] = ()
    start: int = 0
    moved: int = 0


class ComponentTransfer(ABC):
    """The tier hooks of one component (see the module docstring for when each runs).

    `name`: the component's name (its pool group member). `gauge`: the name and help of the
    host slot gauge `TierCacheCollector` exports for it (`kvstrata_tiered_cache_<name>`)."""

    name: str
    gauge: ClassVar[tuple[str, str]] = ("", "")

    def metric(self) -> tuple[str, str]:
        """The gauge name and help (default: `host_<name>_slots`)."""
        name, doc = self.gauge
        if name:
            return name, doc
        return f"host_{self.name}_slots", f"Host tier {self.name} slots by state."

    # -- device -> host writes ----------------------------------------------------------------
    @abstractmethod
    def plan_write(self, tiers: TierAccess, node: TreeNode, end: int) -> TransferLeg | None:
        """What a write of the prefix ending at device node `node` (`end` tokens) carries for
        this component (`size` host slots; None: nothing). May split nodes, allocates nothing.
        A write whose host slots cannot be had goes without this leg."""

    @abstractmethod
    def write_source(self, tiers: TierAccess, node: TreeNode, leg: TransferLeg) -> torch.Tensor:
        """The device slots of this member the write reads into `leg.host` (`node` locked)."""

    @abstractmethod
    def commit_write(self, tiers: TierAccess, leg: TransferLeg, node: TreeNode, end: int) -> None:
        """The write arrived: give `leg.host` to the nodes on the path ending at `node` (at key
        position `end`); slots no node takes go back (`free_component_host`)."""

    def backup_start(self, leg: TransferLeg) -> int | None:
        """Where the storage backup after this write must start at the latest (its host pages
        may lie before the write's new pages). Default: no constraint."""
        return None

    # -- host -> storage backups --------------------------------------------------------------
    def backup_pages(
        self, tiers: TierAccess, node: TreeNode, first: int, num_keys: int
    ) -> list[int | None]:
        """Per page `first..num_keys - 1` of the prefix ending at host-locked `node`: the host
        page of this member to store beside it, or None. Default: none."""
        return [None] * (num_keys - first)

    def remembered(self, stored: Sequence[int], done: int) -> list[int]:
        """Of the page indices `stored` (this member's pages storage acknowledged, all below
        `done`): those a later prefetch may end at. Default: all."""
        return list(stored)

    # -- storage -> host prefetches -----------------------------------------------------------
    def prefetch_pages(
        self, tiers: TierAccess, anchor: TreeNode, start: int, keys: Sequence[bytes]
    ) -> int:
        """How many leading pages of `keys` (the pages after the host prefix ending at
        `anchor`, at `start`) a prefetch may bring: pages past the last one this component can
        restore from storage could never be a hit. 0: no prefetch. Default: all."""
        return len(keys)

    def plan_prefetch(self, tiers: TierAccess, start: int, keys: Sequence[bytes]) -> TransferLeg:
        """What a prefetch of `keys` (from key position `start`) fetches for this component:
        `size` host slots from page `first` on, the page keys `keys` it reads. Default:
        nothing."""
        return TransferLeg(name=self.name, first=len(keys))

    def commit_prefetch(
        self, tiers: TierAccess, leg: TransferLeg, node: TreeNode, end: int
    ) -> None:
        """Every page of the prefetch arrived: give `leg.host` to the nodes ending at `node`
        (`end`). Default: as a write (`commit_write`)."""
        self.commit_write(tiers, leg, node, end)

    # -- host -> device loads -----------------------------------------------------------------
    @abstractmethod
    def plan_load(self, tiers: TierAccess, node: TreeNode, start: int, end: int) -> TransferLeg:
        """What a load of key[start:end] (ending at host-locked `node`) brings back for this
        component: `size` device slots to allocate (`alloc_device`), the host slots it reads."""

    def alloc_device(self, tiers: TierAccess, leg: TransferLeg) -> torch.Tensor | None:
        """`leg.size` device slots of this component, evicting its own device data when short;
        None when none can be had (the load is refused). Default: the leg needs none."""
        raise AssertionError(f"component {self.name!r} allocates no device slots for a load")

    @abstractmethod
    def load_move(
        self, tiers: TierAccess, leg: TransferLeg, node: TreeNode, device: torch.Tensor, start: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The (device, host) slots of this member the load moves; `device` the Full device
        slots it allocated for key[start:]. None: nothing of this member moves."""

    @abstractmethod
    def load_input(self, leg: TransferLeg) -> ComponentInsert | None:
        """The insert input (`ComponentInsert`) the load's commit hands the tree, or None."""

    def load_device_held(self, leg: TransferLeg, num_slots: int) -> int:
        """Device slots of this component the load holds outside the tree until its ack
        (`num_slots`: the Full slots it holds). Default: `leg.device`."""
        return 0 if leg.device is None else len(leg.device)
