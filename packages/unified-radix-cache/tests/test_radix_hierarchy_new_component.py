"""Tiers as components: a component kind the tier modules have never seen (defined here) carries
its host copy through write, device eviction, load-back and host eviction through its own
`ComponentTransfer` hooks, with no change to tier_core / tier_writes / tier_prefetch /
tier_loads / host_tier / hierarchy; and those modules name no model family in their code."""

from __future__ import annotations

import ast
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

import kvstrata.unified_radix_cache as package
from kvstrata.hybrid_cache import PoolGroup, TierController
from kvstrata.hybrid_cache.router import HybridPool, PoolMember
from kvstrata.pool import MambaPool, MHAKVPool
from kvstrata.testkit.tiers import (
    assert_pages_equal,
    extra_host_copy,
    make_tiers,
    scramble,
    snapshot,
)
from kvstrata.unified_radix_cache import (
    ComponentInsert,
    FullComponent,
    MambaComponent,
    MambaInsert,
    RadixKey,
    UnifiedRadixCache,
)
from kvstrata.unified_radix_cache.components.transfer import (
    ComponentTransfer,
    TierAccess,
    TransferLeg,
)
from kvstrata.unified_radix_cache.errors import InvalidConfig
from kvstrata.unified_radix_cache.hierarchy import HierarchicalCache
from kvstrata.unified_radix_cache.node import TreeNode
from kvstrata.unified_radix_cache.tier_metrics import TierCacheCollector
from kvstrata.unified_radix_cache.tiers import TierParams, WritePolicy

P = 4
TAG = "tag"


class TagComponent(MambaComponent):
    """A toy kind: one tag slot per node (say a summary vector of the node's run), kept in a
    pool of its own. Its device side reuses the state component's tree hooks; its tier side is
    `TagTransfer`, which no tier module knows."""

    name = TAG

    def __init__(self, allocator: object, pool: object, *, tiered: bool = True) -> None:
        super().__init__(allocator, pool)  # pyright: ignore[reportArgumentType]
        self.hooks = TagTransfer(self) if tiered else None

    def tier_transfer(self) -> ComponentTransfer | None:  # pyright: ignore[reportIncompatibleMethodOverride]
        return self.hooks


class TagTransfer(ComponentTransfer):
    """Writes carry the node's tag; a load brings it back into a fresh device slot (refused
    when the tag pool is out: no eviction); storage never holds tags. Counts its calls."""

    def __init__(self, component: TagComponent) -> None:
        self.component = component
        self.name = component.name
        self.calls: Counter[str] = Counter()

    def plan_write(self, tiers: TierAccess, node: TreeNode, end: int) -> TransferLeg | None:
        self.calls["plan_write"] += 1
        tag = self.component
        if tag.slot(node) is None or tag.host_value(node) is not None:
            return None
        return TransferLeg(name=self.name, size=1)

    def write_source(self, tiers: TierAccess, node: TreeNode, leg: TransferLeg) -> torch.Tensor:
        self.calls["write_source"] += 1
        slot = self.component.slot(node)
        assert slot is not None
        return torch.tensor([slot], dtype=torch.int64)

    def commit_write(self, tiers: TierAccess, leg: TransferLeg, node: TreeNode, end: int) -> None:
        self.calls["commit_write"] += 1
        assert leg.host is not None
        if not tiers.set_host(self.name, node, int(leg.host.item())):
            tiers.free_component_host(self.name, leg.host)

    def prefetch_pages(
        self, tiers: TierAccess, anchor: TreeNode, start: int, keys: Sequence[bytes]
    ) -> int:
        return 0

    def plan_load(self, tiers: TierAccess, node: TreeNode, start: int, end: int) -> TransferLeg:
        self.calls["plan_load"] += 1
        host = self.component.host_value(node)
        if self.component.slot(node) is not None or not isinstance(host, int):
            return TransferLeg(name=self.name)
        return TransferLeg(name=self.name, size=1, host=torch.tensor([host], dtype=torch.int64))

    def alloc_device(self, tiers: TierAccess, leg: TransferLeg) -> torch.Tensor | None:
        self.calls["alloc_device"] += 1
        return self.component.allocator.alloc(leg.size)

    def load_move(
        self, tiers: TierAccess, leg: TransferLeg, node: TreeNode, device: torch.Tensor, start: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        self.calls["load_move"] += 1
        if leg.device is None or leg.host is None:
            return None
        return leg.device, leg.host

    def load_input(self, leg: TransferLeg) -> ComponentInsert | None:
        return None if leg.device is None else MambaInsert(slot=int(leg.device.item()))


class Toy:
    """A Full + tag tree over a small attention + state model's pools, whose state member is
    renamed "tag" in the pool group, tiered by `HierarchicalCache`."""

    def __init__(self, *, tiered: bool = True) -> None:
        tiers = make_tiers("mamba", page_size=P, host_pages=32)
        system = tiers.system
        assert system.mamba_allocator is not None and system.mamba_pool is not None
        self.tag = TagComponent(system.mamba_allocator, system.mamba_pool, tiered=tiered)
        self.tree = UnifiedRadixCache([FullComponent(system.kv_allocator), self.tag], P)
        layers = tiers.pools

        def rename(name: str) -> str:
            return TAG if name == "mamba" else name

        pools = HybridPool(
            members=[
                PoolMember(name=rename(m.name), pool=m.pool, rule=m.rule, layer_ids=m.layer_ids)
                for m in layers.members
            ],
            routes=[
                (i, layers.route(i)._replace(member=rename(layers.route(i).member)))
                for i in layers.layer_ids
            ],
        )
        hosts = {rename(name): host for name, host in tiers.hosts.items()}
        self.controller = TierController(PoolGroup(pools, hosts))
        full_pool, tag_pool = hosts["full"].device_pool, hosts[TAG].device_pool
        assert isinstance(full_pool, MHAKVPool) and isinstance(tag_pool, MambaPool)
        self.full_pool, self.tag_pool = full_pool, tag_pool
        self.tag_host = hosts[TAG].make_allocator()
        self.cache = HierarchicalCache(
            self.tree,
            controller=self.controller,
            host_allocator=hosts["full"].make_allocator(),
            params=TierParams(write_policy=WritePolicy.WRITE_THROUGH),
            component_hosts={TAG: self.tag_host},
        )


@pytest.fixture
def toy() -> Iterator[Toy]:
    t = Toy()
    try:
        yield t
    finally:
        t.controller.close()


def _insert(toy: Toy, tokens: list[int]) -> tuple[TreeNode, torch.Tensor, torch.Tensor]:
    """Insert `tokens` with fresh KV slots and a fresh tag slot (adopted by the tree)."""
    slots = toy.cache.alloc_tokens(len(tokens))
    tag = toy.cache.alloc_state()
    assert slots is not None and tag is not None
    result = toy.cache.insert(RadixKey(tokens), slots, inputs={TAG: MambaInsert(slot=int(tag))})
    assert TAG in result.adopted_states and result.inserted_len == len(tokens)
    return result.last_node, slots, tag


def test_a_new_kind_carries_its_host_copy_through_write_evict_load(toy: Toy) -> None:
    cache, tree, hooks = toy.cache, toy.tree, toy.tag.hooks
    assert hooks is not None
    tokens = list(range(1, 3 * P + 1))
    node, slots, tag = _insert(toy, tokens)
    kv_before, tag_before = snapshot(toy.full_pool, slots), snapshot(toy.tag_pool, tag)
    cache.drain()
    cache.check_integrity()
    # The write carried the tag: the node has a host tag, its bytes those of the device tag.
    host_tag = extra_host_copy(node)
    assert isinstance(host_tag, int) and toy.tag.host_held_size == 1
    assert toy.tag_host.available_size() == toy.tag_host.size - 1
    group = toy.controller.group
    assert cache.counters.bytes_d2h == 3 * group.page_bytes("full") + group.page_bytes(TAG)
    # Device eviction: the node stays for its host copy; its device tag goes with its pages.
    cache.evict_device(tree.evictable_size())
    assert not node.on_device and toy.tag.slot(node) is None
    assert toy.tag.free_size() == toy.tag.capacity()
    cache.check_integrity()
    scramble(toy.tag_pool, tag, seed=1)
    scramble(toy.full_pool, slots, seed=2)
    # The host hit ends at the node (its tag is restorable), and the load brings both back.
    m = cache.match_prefix(RadixKey([*tokens, 99]))
    assert m.device.prefix_len == 0 and m.host_hit_len == 3 * P
    back = cache.load_back(m.host_node)
    assert back.loaded_len == 3 * P and back.match.prefix_len == 3 * P
    loaded = toy.tag.slot(back.match.last_node)
    assert loaded is not None
    assert_pages_equal(toy.tag_pool, torch.tensor([loaded]), tag_before, what="tag")
    assert_pages_equal(toy.full_pool, back.match.device_indices, kv_before, what="kv")
    assert cache.counters.bytes_h2d == 3 * group.page_bytes("full") + group.page_bytes(TAG)
    cache.check_integrity()
    assert {k: hooks.calls[k] for k in ("write_source", "commit_write", "load_move")} == {
        "write_source": 1,
        "commit_write": 1,
        "load_move": 1,
    }
    # The host gauge of the new kind is there under its default name.
    metrics = {m.name: m for m in TierCacheCollector(cache).collect()}
    held = metrics["kvstrata_tiered_cache_host_tag_slots"].samples
    assert {s.labels["state"]: s.value for s in held} == {
        "free": toy.tag_host.size - 1,
        "held": 1,
    }
    # Host eviction frees the host tag with the node's pages.
    cache.evict_device(tree.evictable_size())
    cache.evict_host(10**6)
    assert tree.num_nodes == 0 and toy.tag_host.available_size() == toy.tag_host.size
    cache.check_integrity()


def test_a_new_kind_refusing_its_device_slot_refuses_the_load(toy: Toy) -> None:
    cache, tree = toy.cache, toy.tree
    tokens = list(range(1, 2 * P + 1))
    node, _, _ = _insert(toy, tokens)
    cache.drain()
    cache.evict_device(tree.evictable_size())
    hoard = toy.tag.allocator.alloc(toy.tag.allocator.available_size())
    assert hoard is not None
    refused = cache.counters.load_backs_refused
    back = cache.load_back(node)
    # No tag slot and no eviction in this kind's `alloc_device`: nothing loads, nothing leaks.
    assert back.loaded_len == 0 and cache.counters.load_backs_refused == refused + 1
    assert not node.on_device and extra_host_copy(node) is not None
    cache.check_integrity({TAG: len(hoard)})
    toy.tag.allocator.free(hoard)
    assert cache.load_back(node).loaded_len == 2 * P
    cache.check_integrity()


def test_a_component_without_tier_hooks_is_refused() -> None:
    t = Toy.__new__(Toy)
    with pytest.raises(InvalidConfig, match="tier hooks"):
        Toy.__init__(t, tiered=False)
    t.controller.close()


TIER_MODULES = (
    "tier_core.py",
    "tier_writes.py",
    "tier_prefetch.py",
    "tier_loads.py",
    "tier_room.py",
    "tier_metrics.py",
    "host_tier.py",
    "host_walks.py",
    "hierarchy.py",
    "tiers.py",
)


def _code_words(tree: ast.Module) -> Iterator[str]:
    """Every identifier, imported module and string of a module's code, docstrings (a string
    standing alone as a statement: module, class, function and attribute docstrings) aside."""
    docstrings = {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            yield node.id
        elif isinstance(node, ast.Attribute):
            yield node.attr
        elif isinstance(node, ast.FunctionDef | ast.ClassDef | ast.AsyncFunctionDef):
            yield node.name
        elif isinstance(node, ast.arg):
            yield node.arg
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
            yield from (alias.name for alias in node.names)
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
        ):
            yield node.value


@pytest.mark.parametrize("module", TIER_MODULES)
def test_the_tier_modules_name_no_model_family(module: str) -> None:
    source = (Path(package.__file__).parent / module).read_text()
    named = sorted(
        {w for w in _code_words(ast.parse(source)) if "swa" in w.lower() or "mamba" in w.lower()}
    )
    assert named == [], f"{module} names model families in its code: {named}"
