"""Factories for tests of the tier controller and the tiers above it.

`make_tiers(shape)` builds a small model of one of the three shapes the router knows (full only,
full + SWA, attention + Mamba), on CPU by default: device pools whose every byte is seeded noise
(so every token slot of every layer differs and a misplaced copy shows), one host mirror per
pool, the HybridPool and the PoolGroup. `snapshot` / `assert_pages_equal` compare what a member
holds in given slots, buffer by buffer, so a reload can be checked bit-for-bit against what was
written before.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from kvstrata.allocator import MambaSlotAllocator, PagedAllocator, SWAAllocator
from kvstrata.hybrid_cache import ControllerParams, HybridPool, PoolGroup, TierController
from kvstrata.hybrid_cache.group import AnyHostPool
from kvstrata.pool import MambaPool, MambaSpec, MHAKVPool, MHASpec, SWAKVPool, SWASpec
from kvstrata.pool_host import HostLayout, MambaHostPool, MHAHostPool
from kvstrata.storage import PageKeyer, Storage
from kvstrata.testkit.host_pools import page_tokens
from kvstrata.testkit.pools import fill_random_bytes
from kvstrata.unified_radix_cache import (
    EvictRequest,
    FullComponent,
    MambaComponent,
    RadixKey,
    SWAComponent,
    UnifiedRadixCache,
)
from kvstrata.unified_radix_cache.hierarchy import HierarchicalCache
from kvstrata.unified_radix_cache.tiers import TierParams, WritePolicy

Shape = Literal["full", "swa", "mamba"]
SHAPES: tuple[Shape, ...] = ("full", "swa", "mamba")


@dataclass(frozen=True, kw_only=True, eq=False)
class Tiers:
    """A model's device pools, their host mirrors, the router and the pool group."""

    shape: Shape
    pools: HybridPool
    hosts: dict[str, AnyHostPool]
    group: PoolGroup
    page_size: int

    def member_page_size(self, member: str) -> int:
        return self.hosts[member].page_size


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
    """A small model of `shape` on `device` with distinct bytes in every device slot.

    full:  4 MHA layers.
    swa:   layers 0, 2 full and 1, 3 sliding-window (window 2 pages), SWA pool as large as full.
    mamba: attention layers 1, 3 in an MHA pool; mamba layers 0, 2 in a MambaPool with
           `device_pages` state slots (its host mirror has `host_pages` slots).
    """
    size = device_pages * page_size
    head = {"num_kv_heads": 2, "head_dim": 8, "dtype": torch.bfloat16}
    if shape == "full":
        pool = MHAKVPool(
            MHASpec(num_layers=4, **head), size=size, page_size=page_size, device=device
        )
        pools = HybridPool.full(pool)
        device_pools: dict[str, MHAKVPool | MambaPool] = {"full": pool}
    elif shape == "swa":
        spec = SWASpec(
            full=MHASpec(num_layers=2, **head),
            swa=MHASpec(num_layers=2, **head),
            full_layer_ids=(0, 2),
            swa_layer_ids=(1, 3),
            sliding_window=2 * page_size,
        )
        swa = SWAKVPool(spec, size=size, swa_size=size, page_size=page_size, device=device)
        pools = HybridPool.swa(swa)
        device_pools = {"full": swa.full_pool, "swa": swa.swa_pool}
    else:
        kv = MHAKVPool(MHASpec(num_layers=2, **head), size=size, page_size=page_size, device=device)
        mamba_spec = MambaSpec(
            num_layers=2,
            conv_dim=6,
            conv_kernel=4,
            num_heads=2,
            head_dim=4,
            state_size=3,
            conv_dtype=torch.bfloat16,
            ssm_dtype=torch.float32,
        )
        mamba = MambaPool(mamba_spec, size=device_pages, device=device)
        pools = HybridPool.with_mamba(
            attention=kv, attention_layer_ids=(1, 3), mamba=mamba, mamba_layer_ids=(0, 2)
        )
        device_pools = {"full": kv, "mamba": mamba}
    hosts: dict[str, AnyHostPool] = {}
    for i, (name, pool) in enumerate(device_pools.items()):
        fill_random_bytes(pool, seed=seed * 10 + i)
        if isinstance(pool, MambaPool):
            hosts[name] = MambaHostPool(pool, layout=layout, size=host_pages)
        else:
            hosts[name] = MHAHostPool(pool, layout=layout, size=host_pages * page_size)
    return Tiers(
        shape=shape,
        pools=pools,
        hosts=hosts,
        group=PoolGroup(pools, hosts),
        page_size=page_size,
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
    """A full-only model on both tiers: one tree holding device and host values (`tree`,
    `cache.tier`), the cache and its controller."""

    tiers: Tiers
    device_pool: MHAKVPool
    allocator: PagedAllocator
    cache: HierarchicalCache

    @property
    def tree(self) -> UnifiedRadixCache:
        return self.cache.device_tree


def make_hierarchy(
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
) -> Hierarchy:
    """A `HierarchicalCache` over `make_tiers("full")`: a paged device allocator of
    `device_pages` pages (page 0 reserved), a host allocator of `host_pages` pages, and a
    controller (with `storage` when given). Close `h.cache.controller` when done."""
    tiers = make_tiers(
        "full",
        page_size=page_size,
        device_pages=device_pages,
        host_pages=host_pages,
        seed=seed,
        device=device,
    )
    pool = tiers.pools.members[0].pool
    assert isinstance(pool, MHAKVPool), "make_tiers('full') has one MHA pool"
    allocator = PagedAllocator(size=pool.size, page_size=page_size, device=device)
    tree = UnifiedRadixCache([FullComponent(allocator)], page_size=page_size)
    host = tiers.hosts["full"]
    controller = TierController(tiers.group, storage=storage, params=controller_params)
    cache = HierarchicalCache(
        tree,
        controller=controller,
        host_allocator=host.make_allocator(),
        params=params or TierParams(write_policy=write_policy, prefetch_threshold=page_size),
    )
    return Hierarchy(tiers=tiers, device_pool=pool, allocator=allocator, cache=cache)


@dataclass(frozen=True, kw_only=True, eq=False)
class MambaHierarchy:
    """An attention + Mamba model on both tiers: one Full + Mamba tree holding device and host
    values (host token slots and host state slots), the cache and its controller (with a
    storage when one was given)."""

    tiers: Tiers
    device_pool: MHAKVPool
    mamba_pool: MambaPool
    allocator: PagedAllocator
    states: MambaSlotAllocator
    cache: HierarchicalCache

    @property
    def tree(self) -> UnifiedRadixCache:
        return self.cache.device_tree


def make_mamba_hierarchy(
    *,
    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH,
    page_size: int = 4,
    device_pages: int = 16,
    host_pages: int = 32,
    storage: Storage | None = None,
    params: TierParams | None = None,
    controller_params: ControllerParams | None = None,
    seed: int = 0,
) -> MambaHierarchy:
    """A `HierarchicalCache` over `make_tiers("mamba")` on CPU: a paged device allocator of
    `device_pages` pages (page 0 reserved), `device_pages` device state slots, host
    allocators of `host_pages` pages and `host_pages` state slots, and a controller (with
    `storage` when given). Close the controller when done."""
    tiers = make_tiers(
        "mamba", page_size=page_size, device_pages=device_pages, host_pages=host_pages, seed=seed
    )
    pools = device_pools(tiers)
    kv, mamba = pools["full"], pools["mamba"]
    assert isinstance(kv, MHAKVPool) and isinstance(mamba, MambaPool), "make_tiers('mamba')"
    allocator = PagedAllocator(size=kv.size, page_size=page_size, device="cpu")
    states = MambaSlotAllocator(size=mamba.size, device="cpu")
    tree = UnifiedRadixCache(
        [FullComponent(allocator), MambaComponent(states, mamba)], page_size=page_size
    )
    cache = HierarchicalCache(
        tree,
        controller=TierController(tiers.group, storage=storage, params=controller_params),
        host_allocator=tiers.hosts["full"].make_allocator(),
        component_hosts={"mamba": tiers.hosts["mamba"].make_allocator()},
        params=params or TierParams(write_policy=write_policy, prefetch_threshold=page_size),
    )
    return MambaHierarchy(
        tiers=tiers,
        device_pool=kv,
        mamba_pool=mamba,
        allocator=allocator,
        states=states,
        cache=cache,
    )


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
    page = keyer.page_size
    keys = keyer.page_keys(tokens[: len(slots)])
    for i in range(len(slots) // page):
        rows = slots[i * page : (i + 1) * page]
        for b, buf in enumerate(pool.layer_buffers()):
            got, want = (
                buf[rows].view(torch.uint8),
                _page_noise(keys[i], buf, page).view(torch.uint8),
            )
            assert torch.equal(got, want), f"{what}: page {i} buffer {b} holds other KV"


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


def serve_mamba(h: MambaHierarchy, tokens: list[int], *, check: bool = True) -> int:
    """One request as an engine runs it: begin (match, load back), check that the hit's KV and
    the request's copy of the boundary state are the ones computed for that prefix, compute the
    rest (KV + state), finish (insert + write policy), wait for every transfer. Returns the
    hit length (device + host + storage)."""
    cache = h.cache
    ids = torch.tensor(tokens, dtype=torch.int64)
    req = cache.begin_request(RadixKey(ids))
    hit = req.cached_len
    assert hit == req.hit.total_len
    assert_prefix_kv(h.device_pool, cache.keyer, ids, req.kv_indices[:hit], what="hit KV")
    if hit:
        assert req.state_slot is not None, "a hit always comes with the request's state copy"
        assert_prefix_state(h.mamba_pool, cache.keyer, ids[:hit], req.state_slot, what="hit")
    else:
        assert req.state_slot is None
        req.state_slot = h.states.alloc(1)
        if req.state_slot is None:
            h.tree.evict(EvictRequest(targets={"mamba": 1}))
            req.state_slot = h.states.alloc(1)
        assert req.state_slot is not None
    need = len(tokens) - hit
    if need > h.allocator.available_size():
        cache.evict_device(need - h.allocator.available_size())
    slots = h.allocator.alloc(need)
    assert slots is not None
    full = torch.cat([req.kv_indices, slots])
    write_prefix_kv(h.device_pool, cache.keyer, ids, full, hit)
    write_prefix_state(h.mamba_pool, cache.keyer, ids, req.state_slot)
    req.extend(slots)
    cache.cache_finished_request(req)
    cache.drain()
    if check:  # (not while a test hoards host state slots outside the tree)
        cache.check_integrity()
    return hit


@dataclass(frozen=True, kw_only=True, eq=False)
class SWAHierarchy:
    """A full + sliding-window model on both tiers: one Full + SWA tree holding device values
    and host values (host full slots and, for nodes that lay in a window, host SWA slots), the
    cache and its controller (with a storage when one was given)."""

    tiers: Tiers
    full_pool: MHAKVPool
    swa_pool: MHAKVPool
    allocator: SWAAllocator
    cache: HierarchicalCache

    @property
    def tree(self) -> UnifiedRadixCache:
        return self.cache.device_tree

    @property
    def window(self) -> int:
        """The sliding window in tokens (two pages)."""
        return 2 * self.tiers.page_size


def make_swa_hierarchy(
    *,
    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH,
    page_size: int = 4,
    device_pages: int = 16,
    host_pages: int = 32,
    params: TierParams | None = None,
    controller_params: ControllerParams | None = None,
    storage: Storage | None = None,
    seed: int = 0,
) -> SWAHierarchy:
    """A `HierarchicalCache` over `make_tiers("swa")` on CPU (window 2 pages): an
    `SWAAllocator` of `device_pages` full and SWA pages (page 0 reserved), and host allocators
    of `host_pages` pages for each of the full and SWA host pools; the controller has
    `storage` when given. Close the controller when done."""
    tiers = make_tiers(
        "swa", page_size=page_size, device_pages=device_pages, host_pages=host_pages, seed=seed
    )
    pools = device_pools(tiers)
    full, swa = pools["full"], pools["swa"]
    assert isinstance(full, MHAKVPool) and isinstance(swa, MHAKVPool), "make_tiers('swa')"
    allocator = SWAAllocator(size=full.size, swa_size=swa.size, page_size=page_size, device="cpu")
    tree = UnifiedRadixCache(
        [FullComponent(allocator), SWAComponent(allocator, sliding_window=2 * page_size)],
        page_size=page_size,
    )
    cache = HierarchicalCache(
        tree,
        controller=TierController(tiers.group, storage=storage, params=controller_params),
        host_allocator=tiers.hosts["full"].make_allocator(),
        component_hosts={"swa": tiers.hosts["swa"].make_allocator()},
        params=params or TierParams(write_policy=write_policy, prefetch_threshold=page_size),
    )
    return SWAHierarchy(tiers=tiers, full_pool=full, swa_pool=swa, allocator=allocator, cache=cache)


def serve_swa(h: SWAHierarchy, tokens: list[int], *, check: bool = True) -> int:
    """One request as an engine runs it: begin (match, load back), check that the hit's full KV
    and the SWA KV of its last window are the ones computed for that prefix, compute the rest
    (full and SWA KV of the new tokens), finish (insert + write policy), wait for every
    transfer. Returns the hit length (device + host + storage)."""
    cache = h.cache
    ids = torch.tensor(tokens, dtype=torch.int64)
    req = cache.begin_request(RadixKey(ids))
    hit = req.cached_len
    assert hit == req.hit.total_len
    hit_slots = req.kv_indices[:hit]
    assert_prefix_kv(h.full_pool, cache.keyer, ids, hit_slots, what="hit full KV")
    lo = max(hit - h.window, 0)
    window = h.allocator.translate(hit_slots[lo:])
    assert bool((window > 0).all()), "a hit's last window keeps its SWA slots"
    assert_window_kv(h.swa_pool, cache.keyer, ids[:hit], window, lo, what="hit SWA KV")
    need = len(tokens) - hit
    if need > h.allocator.available_size():
        cache.evict_device(need - h.allocator.available_size())
    slots = h.allocator.alloc(need)
    assert slots is not None
    full = torch.cat([req.kv_indices, slots])
    write_prefix_kv(h.full_pool, cache.keyer, ids, full, hit)
    write_prefix_kv(h.swa_pool, cache.keyer, ids, h.allocator.translate(full), hit)
    req.extend(slots)
    cache.cache_finished_request(req)
    cache.drain()
    if check:
        cache.check_integrity()
    return hit


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
