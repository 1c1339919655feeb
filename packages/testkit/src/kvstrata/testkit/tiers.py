"""Factories for tests of the tier controller and the tiers above it, built through
`kvstrata.build` (the construction layer engines use), so tests run what engines run.

`make_tiers(shape)` builds a small model of one of the three shapes the router knows (full only,
full + SWA, attention + Mamba) with `build_memory_system`, and its host mirrors with
`build_host_pools`, on CPU by default: device pools whose every byte is seeded noise (so every
token slot of every layer differs and a misplaced copy shows), one host mirror per pool, the
HybridPool and the PoolGroup. `make_hierarchy(shape)` adds the controller and the
`HierarchicalCache` with `build_tiers`. `snapshot` / `assert_pages_equal` compare what a member
holds in given slots, buffer by buffer, so a reload can be checked bit-for-bit against what was
written before; `serve` runs one request through the engine-facing `PrefixCache` protocol and
checks every hit against the stand-in forward (`write_prefix_kv`, `write_prefix_state`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Literal, TypeVar, get_args

import torch
from hypothesis import strategies as st

from kvstrata.allocator import MambaSlotAllocator, PagedAllocator, SWAAllocator
from kvstrata.build import (
    MambaModel,
    MemorySystem,
    MHAModel,
    SWAModel,
    TieredSystem,
    build_host_pools,
    build_memory_system,
    build_tiers,
)
from kvstrata.hybrid_cache import ControllerParams, HybridPool, PoolGroup
from kvstrata.hybrid_cache.group import AnyHostPool
from kvstrata.hybrid_cache.metrics import ControllerStats
from kvstrata.hybrid_cache.storage_io import Finish, StorageRunner
from kvstrata.pool import MambaPool, MHAKVPool
from kvstrata.pool_host import HostLayout
from kvstrata.storage import PageKeyer, Storage
from kvstrata.testkit.host_pools import page_tokens
from kvstrata.testkit.pools import fill_random_bytes
from kvstrata.testkit.refusals import tree_state
from kvstrata.unified_radix_cache import CacheRequest, RadixKey, UnifiedRadixCache
from kvstrata.unified_radix_cache.hierarchy import HierarchicalCache
from kvstrata.unified_radix_cache.node import ComponentValue, TreeNode
from kvstrata.unified_radix_cache.tiers import TierLoad, TierParams, WritePolicy

Shape = Literal["full", "swa", "mamba"]
SHAPES: tuple[Shape, ...] = get_args(Shape)
T = TypeVar("T")

#: The `kvstrata.build` family of each shape.
FAMILY: Mapping[Shape, str] = {"full": "mha", "swa": "swa", "mamba": "mamba"}


@dataclass(frozen=True, kw_only=True, eq=False)
class Tiers:
    """A model's device pools, their host mirrors, the router and the pool group. `system` is
    the built device side (allocators and tree too, unused by controller tests)."""

    shape: Shape
    system: MemorySystem
    pools: HybridPool
    hosts: dict[str, AnyHostPool]
    group: PoolGroup
    page_size: int

    def member_page_size(self, member: str) -> int:
        return self.hosts[member].page_size


def tiny_model(shape: Shape, page_size: int) -> MHAModel | SWAModel | MambaModel:
    """The small model of `shape` (bf16 KV of 2 heads x 8 dims):

    full:  4 MHA layers.
    swa:   layers 0, 2 full and 1, 3 sliding-window (window 2 pages).
    mamba: attention layers 1, 3; mamba layers 0, 2 (bf16 conv state, fp32 SSM state).
    """
    head = {"num_kv_heads": 2, "head_dim": 8, "dtype": torch.bfloat16}
    if shape == "full":
        return MHAModel(num_layers=4, **head)
    if shape == "swa":
        return SWAModel(
            full_layer_ids=(0, 2), swa_layer_ids=(1, 3), sliding_window=2 * page_size, **head
        )
    return MambaModel(
        attention_layer_ids=(1, 3),
        mamba_layer_ids=(0, 2),
        conv_dim=6,
        conv_kernel=4,
        num_heads=2,
        state_head_dim=4,
        state_size=3,
        conv_dtype=torch.bfloat16,
        ssm_dtype=torch.float32,
        **head,
    )


def make_system(
    shape: Shape,
    *,
    page_size: int = 4,
    device_pages: int = 16,
    device: str = "cpu",
    enable_events: bool = False,
) -> MemorySystem:
    """`build_memory_system` for `tiny_model(shape)`: `device_pages` pages of KV (page 0
    reserved); the SWA pool as large as the full one; `device_pages` Mamba state slots; with
    `enable_events`, the tree queues KV events."""
    return build_memory_system(
        family=FAMILY[shape],
        model=tiny_model(shape, page_size),
        capacity_tokens=device_pages * page_size,
        page_size=page_size,
        device=device,
        swa_ratio=1.0,
        mamba_slots=device_pages if shape == "mamba" else None,
        enable_events=enable_events,
    )


def make_tiers(
    shape: Shape,
    *,
    page_size: int = 4,
    device_pages: int = 16,
    host_pages: int = 32,
    layout: HostLayout = HostLayout.page_first,
    seed: int = 0,
    device: str = "cpu",
) -> Tiers:
    """A small model of `shape` (`tiny_model`) on `device` with distinct bytes in every device
    slot, and host mirrors of `host_pages` pages each (Mamba: `host_pages` state slots for
    `device_pages` device ones)."""
    system = make_system(shape, page_size=page_size, device_pages=device_pages, device=device)
    return _tiers(shape, system, host_pages=host_pages, layout=layout, seed=seed)


def _tiers(
    shape: Shape, system: MemorySystem, *, host_pages: int, layout: HostLayout, seed: int
) -> Tiers:
    page_size = system.page_size
    hosts = build_host_pools(system, host_tokens=host_pages * page_size, layout=layout)
    _seed_pools(hosts, seed)
    return Tiers(
        shape=shape,
        system=system,
        pools=system.layers,
        hosts=hosts,
        group=PoolGroup(system.layers, hosts),
        page_size=page_size,
    )


def _seed_pools(hosts: Mapping[str, AnyHostPool], seed: int) -> None:
    """Seeded noise in every byte of every member's device pool (member i: seed * 10 + i)."""
    for i, host in enumerate(hosts.values()):
        fill_random_bytes(host.device_pool, seed=seed * 10 + i)


def storage_runner(
    tiers: Tiers, storage: Storage, finish: Finish, *, batch_pages: int
) -> StorageRunner:
    """A `StorageRunner` over `tiers`' group and `storage` (checksums on, no call timeout, its
    own stats) that hands each op's ack to `finish(op_id, status, pages done, error)`: a test
    runs prefetch and backup tasks through it on its own thread."""
    return StorageRunner(
        group=tiers.group,
        storage=storage,
        stats=ControllerStats(),
        finish=finish,
        clock=time.monotonic,
        batch_pages=batch_pages,
        call_timeout_s=None,
        verify_checksums=True,
    )


def page_indices(pages: list[int], page_size: int) -> torch.Tensor:
    """Token indices of whole pages, in order (for a Mamba member page_size is 1: slots)."""
    return page_tokens(pages, page_size)


def snapshot(pool: MHAKVPool | MambaPool, slots: torch.Tensor) -> list[torch.Tensor]:
    """Copies of every buffer's rows at `slots` (token or state slots), for later comparison."""
    return [buf[slots.to(buf.device)].cpu() for buf in pool.layer_buffers()]


def assert_pages_equal(
    pool: MHAKVPool | MambaPool,
    slots: torch.Tensor,
    expected: list[torch.Tensor],
    *,
    what: str = "",
) -> None:
    """Every buffer's rows at `slots` equal `expected` bit for bit."""
    got = snapshot(pool, slots)
    assert len(got) == len(expected), "buffer count changed"
    for b, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert torch.equal(g.view(torch.uint8), e.view(torch.uint8)), (
            f"{what}: buffer {b} differs after reload"
        )


def scramble(pool: MHAKVPool | MambaPool, slots: torch.Tensor, *, seed: int) -> None:
    """Overwrite `slots` of every buffer with other bytes (a slot freed and reused)."""
    gen = torch.Generator().manual_seed(10_000 + seed)
    for buf in pool.layer_buffers():
        rows = buf[slots]
        noise = torch.randint(
            0, 256, rows.view(torch.uint8).shape, generator=gen, dtype=torch.uint8
        )
        buf[slots.to(buf.device)] = noise.to(buf.device).view(rows.dtype).view(rows.shape)


def device_pools(tiers: Tiers) -> Mapping[str, MHAKVPool | MambaPool]:
    """Each member's device pool."""
    return {m.name: m.pool for m in tiers.pools.members}  # pyright: ignore[reportReturnType]


@dataclass(frozen=True, kw_only=True, eq=False)
class Hierarchy:
    """A model of `tiers.shape` on both tiers, built by `build_tiers`: one tree holding device
    and host values (`tree`, `cache.tier`), the cache (a `PrefixCache`) and its controller (with
    a storage when one was given). The per-shape pools and allocators are properties that
    assert the shape has them."""

    tiers: Tiers
    tiered: TieredSystem

    @property
    def shape(self) -> Shape:
        return self.tiers.shape

    @property
    def system(self) -> MemorySystem:
        return self.tiered.system

    @property
    def cache(self) -> HierarchicalCache:
        return self.tiered.cache

    @property
    def tree(self) -> UnifiedRadixCache:
        return self.system.tree

    @property
    def allocator(self) -> PagedAllocator | SWAAllocator:
        """The full-attention slot allocator (an SWA model's hands out SWA slots in step)."""
        return self.system.kv_allocator

    @property
    def device_pool(self) -> MHAKVPool:
        """The full-attention device pool."""
        return _mha(self.tiers.hosts["full"].device_pool)

    @property
    def full_pool(self) -> MHAKVPool:
        return self.device_pool

    @property
    def swa_pool(self) -> MHAKVPool:
        return _mha(self.tiers.hosts["swa"].device_pool)

    @property
    def swa_allocator(self) -> SWAAllocator:
        return _present(self.system.swa_allocator, "SWA allocator", self.shape)

    @property
    def window(self) -> int:
        """The sliding window in tokens (two pages)."""
        return _present(self.system.sliding_window, "sliding window", self.shape)

    @property
    def mamba_pool(self) -> MambaPool:
        return _present(self.system.mamba_pool, "Mamba pool", self.shape)

    @property
    def states(self) -> MambaSlotAllocator:
        return _present(self.system.mamba_allocator, "state allocator", self.shape)


def _present(value: T | None, what: str, shape: Shape) -> T:
    assert value is not None, f"a {shape} model has no {what}"
    return value


def _mha(pool: object) -> MHAKVPool:
    assert isinstance(pool, MHAKVPool), "full and SWA members are MHA pools"
    return pool


def make_hierarchy(
    shape: Shape = "full",
    *,
    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH,
    page_size: int = 4,
    device_pages: int = 16,
    host_pages: int = 32,
    storage: Storage | None = None,
    params: TierParams | None = None,
    controller_params: ControllerParams | None = None,
    seed: int = 0,
    device: str = "cpu",
    enable_events: bool = False,
    tree: Callable[[MemorySystem], UnifiedRadixCache] | None = None,
) -> Hierarchy:
    """`build_tiers` over `make_system(shape)` (its tree replaced by `tree(system)` when given,
    e.g. a subclass over the system's allocators): `device_pages` device pages (page 0 reserved;
    Mamba: as many state slots), host mirrors of `host_pages` pages (Mamba: state slots), and a
    controller (with `storage` when given) under `params` (default: `write_policy`, prefetch
    threshold one page). Device bytes are seeded noise; `enable_events`: the tree queues KV
    events. Close `h.cache.controller` when done."""
    system = make_system(
        shape,
        page_size=page_size,
        device_pages=device_pages,
        device=device,
        enable_events=enable_events,
    )
    if tree is not None:
        system = replace(system, tree=tree(system))
    tiered = build_tiers(
        system,
        host_tokens=host_pages * page_size,
        storage=storage,
        params=params or TierParams(write_policy=write_policy, prefetch_threshold=page_size),
        controller_params=controller_params,
    )
    _seed_pools(tiered.host_pools, seed)
    tiers = Tiers(
        shape=shape,
        system=system,
        pools=system.layers,
        hosts=dict(tiered.host_pools),
        group=tiered.controller.group,
        page_size=page_size,
    )
    return Hierarchy(tiers=tiers, tiered=tiered)


def returning_prompts(page_size: int) -> list[list[int]]:
    """24 prompts over six 3-page prefixes: each prefix, it extended by 2 pages, an earlier
    prefix again and another one extended, so that a small device (about 8 pages) and host
    (about 16) overflow and host hits load back (taking device room and host locks)."""
    base = [list(range(100 * i + 1, 100 * i + 1 + 3 * page_size)) for i in range(6)]
    out: list[list[int]] = []
    for i, prefix in enumerate(base):
        out.append(prefix)
        out.append([*prefix, *range(1000 + 10 * i, 1000 + 10 * i + 2 * page_size)])
        out.append(base[i // 2])
        out.append([*base[(i + 3) % 6], *range(2000 + 10 * i, 2000 + 10 * i + 2 * page_size)])
    return out


def page_prompts(page_size: int) -> st.SearchStrategy[list[list[int]]]:
    """1 to 25 prompts over a small alphabet in whole pages (1 to 4 pages, each of one token
    0-2) plus the token an engine computes (9): prefixes are shared, a small device (about 6
    pages) fills and evicts, and host hits load back."""
    return st.lists(
        st.lists(st.integers(0, 2), min_size=1, max_size=4).map(
            lambda pages: [t for p in pages for t in [p] * page_size] + [9]
        ),
        min_size=1,
        max_size=25,
    )


def serve_bare(h: Hierarchy, tokens: list[int], *, drain: bool) -> tuple[int, int, int]:
    """One request with no KV computed or checked (unlike `serve`): begin (its load, if any,
    committed: `begin_request` promises it), device slots for the rest but the last token in
    whole pages, finish; `drain`: then wait for every transfer. Returns the hit's device,
    host and storage lengths."""
    cache = h.cache
    page = h.tiers.page_size
    req = cache.begin_request(RadixKey(tokens))
    hit = req.hit
    load = hit.load
    assert load is None or (isinstance(load, TierLoad) and load.done), "load left uncommitted"
    slots = cache.alloc_tokens(-(-(len(tokens) - 1 - req.cached_len) // page) * page)
    assert slots is not None
    req.extend(slots)
    cache.cache_finished_request(req)
    if drain:
        cache.drain()
    return hit.device_len, hit.host_len, hit.storage_len


def tiers_picture(h: Hierarchy) -> tuple[object, object]:
    """Both tiers (`refusals.tree_state`, less its metrics: they include seconds) and the
    cache's transfer counters, less the seconds waited: equal for hierarchies in one state."""
    return (
        replace(tree_state(h.tree, h.cache), metrics=()),
        replace(h.cache.counters, transfer_wait_seconds=0.0),
    )


def assert_served_alike(
    a: Hierarchy, b: Hierarchy, prompts: Iterable[list[int]], *, drain: bool
) -> None:
    """Serves each prompt through `a` and `b` (`serve_bare`), asserting after each the same
    hits, the same `tiers_picture` and both caches' integrity; closes both controllers when
    done (also on a failure)."""
    try:
        for tokens in prompts:
            assert serve_bare(a, tokens, drain=drain) == serve_bare(b, tokens, drain=drain)
            assert tiers_picture(a) == tiers_picture(b)
            a.cache.check_integrity()
            b.cache.check_integrity()
    finally:
        a.cache.controller.close()
        b.cache.controller.close()


def scramble_free_device(h: Hierarchy, *, seed: int) -> None:
    """Overwrite every free device slot with other bytes (full KV, the SWA slots in step, free
    Mamba state slots): whatever is read from them next must have been loaded anew."""
    taken = h.allocator.alloc(h.allocator.available_size())
    if taken is not None and len(taken):
        scramble(h.device_pool, taken, seed=seed)
        if h.shape == "swa":
            scramble(h.swa_pool, h.swa_allocator.translate(taken), seed=seed + 1)
        h.allocator.free(taken)
    if h.shape == "mamba":
        states = h.states.alloc(h.states.available_size())
        if states is not None and len(states):
            scramble(h.mamba_pool, states, seed=seed + 2)
            h.states.free(states)


def extra_host_copy(node: TreeNode) -> ComponentValue:
    """The host copy on `node` of the tree's one component besides Full (index 1: SWA or
    Mamba), or None."""
    return None if node.comp_hosts is None else node.comp_hosts[1]


def drop_all_but_storage(h: Hierarchy, *, seed: int) -> None:
    """Evict every device and host copy (the tree ends empty), scramble the free device slots
    and zero every host page: what comes back must come from storage. Checks integrity."""
    h.cache.evict_device(h.tree.evictable_size())
    h.cache.evict_host(10**6)
    assert h.tree.num_nodes == 0, "nothing is locked, so everything can go"
    scramble_free_device(h, seed=seed)
    for pool in h.tiers.hosts.values():
        zeros = bytes(pool.page_size_bytes)
        for page in range(pool.size // pool.page_size):
            pool.write_page_from(page, zeros)
    h.cache.check_integrity()


def check_hit(h: Hierarchy, tokens: torch.Tensor, req: CacheRequest) -> int:
    """`req` just began for `tokens`: its hit is at most `len(tokens) - 1` tokens, the tiers
    it came from add up, and what it holds is what the stand-in forward computed for that
    prefix, bit for bit: the full KV; an SWA model's last window of SWA KV (every slot of it
    present); a Mamba model's copy of the state at the hit's end (no state without a hit).
    Returns the hit length."""
    hit = req.cached_len
    assert hit == req.hit.total_len and hit < len(tokens), "a hit is at most N - 1 tokens"
    keyer = h.cache.keyer
    assert_prefix_kv(h.device_pool, keyer, tokens, req.kv_indices[:hit], what="hit KV")
    if h.shape == "swa":
        lo = max(hit - h.window, 0)
        window = h.swa_allocator.translate(req.kv_indices[lo:hit])
        assert bool((window > 0).all()), "a hit's last window keeps its SWA slots"
        assert_window_kv(h.swa_pool, keyer, tokens[:hit], window, lo, what="hit SWA KV")
    if h.shape == "mamba":
        if hit:
            assert req.state_slot is not None, "a hit comes with the request's state copy"
            assert_prefix_state(h.mamba_pool, keyer, tokens[:hit], req.state_slot, what="hit")
        else:
            assert req.state_slot is None, "no hit, no state"
    return hit


def compute(h: Hierarchy, tokens: torch.Tensor, req: CacheRequest, slots: torch.Tensor) -> None:
    """The stand-in forward of the next `len(slots)` tokens of `tokens` (whole pages) after
    those `req` has slots for: their full (and SWA) KV into `slots`, a Mamba model's state
    after them into `req.state_slot`; then `req.extend(slots)`."""
    start = len(req.kv_indices)
    end = start + len(slots)
    keyer = h.cache.keyer
    full = torch.cat([req.kv_indices, slots])
    write_prefix_kv(h.device_pool, keyer, tokens[:end], full, start)
    if h.shape == "swa":
        write_prefix_kv(h.swa_pool, keyer, tokens[:end], h.swa_allocator.translate(full), start)
    if h.shape == "mamba":
        assert req.state_slot is not None, "a Mamba request computes into its own state slot"
        write_prefix_state(h.mamba_pool, keyer, tokens[:end], req.state_slot)
    req.extend(slots)


def serve(h: Hierarchy, tokens: list[int], *, check: bool = True) -> int:
    """One request as an engine runs it, through the `PrefixCache` protocol: begin (match,
    load back), `check_hit`, a state slot for a Mamba request without a hit, allocate-or-evict
    and `compute` the rest, finish (insert + write policy), wait for every transfer, and
    (`check`) both tiers' integrity. Returns the hit length (device + host + storage)."""
    cache = h.cache
    ids = torch.tensor(tokens, dtype=torch.int64)
    req = cache.begin_request(RadixKey(ids))
    hit = check_hit(h, ids, req)
    if h.shape == "mamba" and req.state_slot is None:
        req.state_slot = cache.alloc_state()
        assert req.state_slot is not None
    slots = cache.alloc_tokens(len(tokens) - hit)
    assert slots is not None
    compute(h, ids, req, slots)
    cache.cache_finished_request(req)
    cache.drain()
    if check:  # (not while a test hoards host slots outside the tree)
        cache.check_integrity()
    return hit


def _page_noise(key: bytes, buf: torch.Tensor, page_size: int) -> torch.Tensor:
    """The bytes of one page of `buf` for the page named `key` (a chained page key)."""
    gen = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") & ((1 << 63) - 1))
    rows = buf[:page_size]
    noise = torch.randint(0, 256, rows.view(torch.uint8).shape, generator=gen, dtype=torch.uint8)
    return noise.view(rows.dtype).view(rows.shape)


def write_prefix_kv(
    pool: MHAKVPool, keyer: PageKeyer, tokens: torch.Tensor, slots: torch.Tensor, start: int
) -> None:
    """The stand-in forward: write KV for `tokens[start:]` into `slots[start:]` (whole pages),
    every page's bytes a function of its chained page key, so each token's KV is distinct and
    depends on the whole prefix before it, and equal prefixes always carry equal KV."""
    page = keyer.page_size
    keys = keyer.page_keys(tokens)
    for i in range(start // page, len(tokens) // page):
        rows = slots[i * page : (i + 1) * page]
        for buf in pool.layer_buffers():
            buf[rows] = _page_noise(keys[i], buf, page)


def assert_prefix_kv(
    pool: MHAKVPool, keyer: PageKeyer, tokens: torch.Tensor, slots: torch.Tensor, *, what: str
) -> None:
    """The KV at `slots` (one per token of a whole-page prefix of `tokens`) is exactly what
    `write_prefix_kv` wrote for that prefix, bit for bit."""
    assert_window_kv(pool, keyer, tokens[: len(slots)], slots, 0, what=what)


def _state_noise(key: bytes, buf: torch.Tensor) -> torch.Tensor:
    """The bytes of one state row of `buf` for the prefix whose last page key is `key`."""
    seed = int.from_bytes(key[8:16], "little") & ((1 << 63) - 1)
    gen = torch.Generator().manual_seed(seed)
    row = buf[:1]
    noise = torch.randint(0, 256, row.view(torch.uint8).shape, generator=gen, dtype=torch.uint8)
    return noise.view(row.dtype).view(row.shape)


def write_prefix_state(
    pool: MambaPool, keyer: PageKeyer, tokens: torch.Tensor, slot: torch.Tensor
) -> None:
    """The stand-in Mamba forward: the state after whole-page prefix `tokens` goes into state
    slot `slot`, every buffer's bytes a function of the prefix's last chained page key (so each
    prefix's state is distinct and equal prefixes carry equal states)."""
    last = keyer.page_keys(tokens)[-1]
    rows = slot.reshape(-1)[:1]
    for buf in pool.layer_buffers():
        buf[rows] = _state_noise(last, buf)


def assert_prefix_state(
    pool: MambaPool, keyer: PageKeyer, tokens: torch.Tensor, slot: torch.Tensor, *, what: str
) -> None:
    """State slot `slot` holds exactly what `write_prefix_state` wrote for `tokens`."""
    last = keyer.page_keys(tokens)[-1]
    rows = slot.reshape(-1)[:1]
    for b, buf in enumerate(pool.layer_buffers()):
        got, want = buf[rows].view(torch.uint8), _state_noise(last, buf).view(torch.uint8)
        assert torch.equal(got, want), f"{what}: state buffer {b} holds another prefix's state"


def assert_window_kv(
    pool: MHAKVPool,
    keyer: PageKeyer,
    tokens: torch.Tensor,
    slots: torch.Tensor,
    start: int,
    *,
    what: str,
) -> None:
    """The KV at `slots` (one per token of `tokens[start:]`, whole pages) is exactly what
    `write_prefix_kv` wrote for those tokens of that prefix, bit for bit."""
    page = keyer.page_size
    keys = keyer.page_keys(tokens)
    for n, i in enumerate(range(start // page, len(tokens) // page)):
        rows = slots[n * page : (n + 1) * page]
        for b, buf in enumerate(pool.layer_buffers()):
            got = buf[rows].view(torch.uint8)
            want = _page_noise(keys[i], buf, page).view(torch.uint8)
            assert torch.equal(got, want), f"{what}: page {i} buffer {b} holds other KV"
