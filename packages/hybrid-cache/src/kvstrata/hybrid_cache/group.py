"""PoolGroup: a model's device pools and their host mirrors, moved together.

The tier controller works on members (`"full"`, `"swa"`, `"mamba"`): each is one device pool of
the `HybridPool` with the `HostPool` mirroring it. This module is the one place that speaks the
pool-host API (backup, per-layer load, page views), checks operation arguments against the
members, and names member pages in storage:

    member     storage key of page i          why
    primary    key_i                          the first PREFIX member (full KV): its keys are the
                                              chained page keys, as every other engine and the
                                              cluster index know them
    others     key_i + b"|" + member name     same prefix, other state: one entry per member
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, cast

import numpy as np
import numpy.typing as npt
import torch

from kvstrata.hybrid_cache.errors import InvalidOperation, InvalidPoolLayout, member_named
from kvstrata.hybrid_cache.ops import PageMove, PagePairs
from kvstrata.hybrid_cache.restore import RestoreKind, RestoreRule
from kvstrata.hybrid_cache.router import HybridPool
from kvstrata.pool import MambaPool, MHAKVPool, MLAKVPool
from kvstrata.pool.base import DevicePool
from kvstrata.pool_host import (
    HostLayout,
    HostPool,
    LayerCompletion,
    LayerLoad,
    PagePlan,
    vouched_pages,
)

MEMBER_KEY_SEPARATOR = b"|"

#: A host mirror of any device family (what PoolGroup accepts).
AnyHostPool = HostPool[MHAKVPool] | HostPool[MLAKVPool] | HostPool[MambaPool]


@dataclass(frozen=True, kw_only=True, eq=False)
class GroupMember:
    """One device pool, its host mirror, and what it needs to restore a prefix."""

    name: str
    device: DevicePool
    host: HostPool[DevicePool]
    rule: RestoreRule


class MemberLayer(NamedTuple):
    """Where a global layer lives: the member, and the layer id its pools take."""

    member: str
    local_layer_id: int


class GetTargets:
    """Where one batch_get lands: `buffers[k]` receives page `pages[k]`. Zero-copy host page
    views for page_first layouts; staging buffers (copied in by `commit`) for layer_first."""

    def __init__(self, host: HostPool[DevicePool], pages: Sequence[int]) -> None:
        self._host = host
        self._pages = list(pages)
        self.staged = host.layout is HostLayout.layer_first
        if self.staged:
            self.buffers = [memoryview(bytearray(host.page_size_bytes)) for _ in self._pages]
        else:
            self.buffers = host.page_views(self._pages)

    def commit(self, ok: Sequence[bool]) -> None:
        """Copy the staged pages that arrived intact into the host pool (no-op when zero-copy)."""
        if not self.staged:
            return
        for page, buf, good in zip(self._pages, self.buffers, ok, strict=True):
            if good:
                self._host.write_page_from(page, buf)


class PoolGroup:
    """The members of one model: a HybridPool's device pools with one HostPool mirror each.

    Holds references only. The host pools' own slot allocators stay with the caller (the tree
    allocates host pages; the controller only moves bytes into and out of them).
    """

    def __init__(self, pools: HybridPool, hosts: Mapping[str, AnyHostPool]) -> None:
        names = set(pools.member_names)
        if set(hosts) != names:
            raise InvalidPoolLayout(
                f"host mirrors given for {sorted(hosts)}, but the model's pools are {sorted(names)}"
            )
        members: dict[str, GroupMember] = {}
        for m in pools.members:
            given = hosts[m.name]
            if given.device_pool is not m.pool:
                raise InvalidPoolLayout(
                    f"the host pool given for {m.name!r} mirrors another device pool"
                )
            # Sound: the mirror was just checked to be built over exactly this device pool.
            host = cast(HostPool[DevicePool], given)
            members[m.name] = GroupMember(name=m.name, device=m.pool, host=host, rule=m.rule)
        self.pools = pools
        self._members = members
        self._rules = {name: m.rule for name, m in members.items()}
        self._primary = next(
            (n for n, m in members.items() if m.rule.kind is RestoreKind.PREFIX), None
        )
        self._routes: dict[int, MemberLayer] = {}
        for layer in pools.layer_ids:
            route = pools.route(layer)
            self._routes[layer] = MemberLayer(route.member, route.local_layer_id)

    # --- queries ---------------------------------------------------------------------------------

    @property
    def member_names(self) -> tuple[str, ...]:
        return tuple(self._members)

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return self.pools.layer_ids

    @property
    def rules(self) -> dict[str, RestoreRule]:
        return dict(self._rules)

    def member(self, name: str) -> GroupMember:
        return member_named(self._members, name, InvalidOperation, "group")

    def layer_route(self, layer_id: int) -> MemberLayer:
        return self._routes[layer_id]

    def num_host_pages(self, name: str) -> int:
        return self.member(name).host.num_pages

    def page_bytes(self, name: str) -> int:
        """Bytes of one page of `name`, all layers (one state slot for Mamba)."""
        return self.member(name).host.page_size_bytes

    def storage_key(self, name: str, key: bytes) -> bytes:
        """The storage key of member `name`'s page of prefix page key `key`."""
        if name == self._primary:
            return key
        return key + MEMBER_KEY_SEPARATOR + name.encode()

    def storage_keys(self, name: str, keys: Sequence[bytes]) -> list[bytes]:
        """`storage_key(name, k)` for each of `keys` (one check of the member for all)."""
        if name == self._primary:
            return list(keys)
        suffix = MEMBER_KEY_SEPARATOR + name.encode()
        return [key + suffix for key in keys]

    def page_volume(self, pages: Mapping[str, PagePairs]) -> tuple[int, int]:
        """(pages, bytes) of all layers of page ids `pages` (what `volume` gives for moves)."""
        num_pages = num_bytes = 0
        for name, (device, _) in pages.items():
            num_pages += len(device)
            num_bytes += len(device) * self._members[name].host.page_size_bytes
        return num_pages, num_bytes

    def layers_of(self, moves: Mapping[str, object]) -> frozenset[int]:
        """Global layer ids whose member appears in `moves`."""
        return frozenset(layer for layer, r in self._routes.items() if r.member in moves)

    def volume(self, moves: Mapping[str, PageMove]) -> tuple[int, int]:
        """(pages, bytes) of all layers of `moves`."""
        pages = 0
        num_bytes = 0
        for name, move in moves.items():
            host = self.member(name).host
            n = move.device.numel() // host.page_size
            pages += n
            num_bytes += n * host.page_size_bytes
        return pages, num_bytes

    # --- argument checks (raise before anything is queued) ---------------------------------------

    def check_moves(
        self, moves: Mapping[str, PageMove], *, copy: bool = True
    ) -> tuple[dict[str, PageMove], int]:
        """Validate a write or load: known members, 1-D integer index tensors of equal length,
        whole pages, in range (device page 0 excluded). Returns copies of the moves (the
        moves themselves with `copy=False`: an op run before its submit returns) and their
        page count. Alignment and repeated destinations are checked by the host pool on the
        worker, before any byte moves (a failed ack). O(1) Python calls per member."""
        checked: dict[str, PageMove] = {}
        num_pages = 0
        for name, move in moves.items():
            host = self.member(name).host
            for side, t in (("device", move.device), ("host", move.host)):
                if not isinstance(t, torch.Tensor) or t.dim() != 1:
                    raise InvalidOperation(f"{name}: {side} indices must be a 1-D tensor")
                if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
                    raise InvalidOperation(
                        f"{name}: {side} indices must be integers, got {t.dtype}"
                    )
            if move.device.numel() != move.host.numel():
                raise InvalidOperation(
                    f"{name}: {move.device.numel()} device indices but {move.host.numel()} host"
                )
            if move.device.numel() % host.page_size:
                raise InvalidOperation(
                    f"{name}: {move.device.numel()} indices are not whole pages of {host.page_size}"
                )
            device = self.member(name).device
            # Page 0 of a device pool is the padding target: it never holds data to move.
            _check_range(
                move.device, lo=device.page_size, hi=device.num_rows, what=f"{name} device"
            )
            _check_range(move.host, lo=0, hi=host.size, what=f"{name} host")
            # Copies: the caller may reuse its index tensors as soon as the submit returns.
            checked[name] = PageMove(
                device=_as_int64(move.device, copy), host=_as_int64(move.host, copy)
            )
            num_pages += move.device.numel() // host.page_size
        return checked, num_pages

    def count_moves(
        self, moves: Mapping[str, PageMove], *, copy: bool = True
    ) -> tuple[dict[str, PageMove], int]:
        """What `check_moves` returns, checking nothing: for moves the caller vouches for
        (`TierController.submit_writes(trusted=True)`: a caller's own allocator indices; the
        tiers' writes go as page ids, `submit_write_pages`, and never come here)."""
        counted: dict[str, PageMove] = {}
        num_pages = 0
        for name, move in moves.items():
            counted[name] = (
                PageMove(device=move.device.clone(), host=move.host.clone()) if copy else move
            )
            num_pages += len(move.device) // self._members[name].host.page_size
        return counted, num_pages

    def check_keyed_pages(
        self, keys: Sequence[bytes], host_pages: Mapping[str, Sequence[int | None]]
    ) -> dict[str, tuple[int | None, ...]]:
        """Validate a prefetch or backup: non-empty bytes keys, one list of `len(keys)` entries
        for every member, host pages in range and not repeated within a member."""
        # Whole-list checks in C (no Python loop per page on the valid path).
        if keys and (set(map(type, keys)) != {bytes} or b"" in keys):
            raise InvalidOperation("page keys must be non-empty bytes")
        missing = set(self._members) - set(host_pages)
        if missing:
            raise InvalidOperation(
                f"no host pages listed for {sorted(missing)}; list every member (None where a "
                "member needs no page)"
            )
        checked: dict[str, tuple[int | None, ...]] = {}
        for name, listed in host_pages.items():
            num_host = self.num_host_pages(name)
            pages: tuple[int | None, ...]
            present: Sequence[int]
            if None in listed:
                pages = tuple(None if p is None else int(p) for p in listed)
                present = [p for p in pages if p is not None]
            else:
                present = list(map(int, cast(Sequence[int], listed)))
                pages = tuple(present)
            if len(pages) != len(keys):
                raise InvalidOperation(f"{name}: {len(pages)} host pages for {len(keys)} keys")
            if present and (min(present) < 0 or max(present) >= num_host):
                raise InvalidOperation(f"{name}: host pages must lie in [0, {num_host})")
            if len(set(present)) != len(present):
                raise InvalidOperation(f"{name}: a host page is listed twice")
            checked[name] = pages
        return checked

    @staticmethod
    def keyed_pages(
        host_pages: Mapping[str, Sequence[int | None]],
    ) -> dict[str, tuple[int | None, ...]]:
        """What `check_keyed_pages` returns, checking nothing: for pages the caller vouches
        for (`TierController.submit_backups(trusted=True)`: the tiers' own host pages)."""
        return {name: tuple(listed) for name, listed in host_pages.items()}

    # --- moves -----------------------------------------------------------------------------------

    def backup(
        self,
        name: str,
        device_indices: torch.Tensor,
        host_indices: torch.Tensor,
        *,
        trusted: bool = False,
    ) -> None:
        """D2H of all layers of `name`'s pages; returns once the host bytes are complete.
        `trusted`: the indices are taken as whole aligned pages in range, no host page twice
        (`count_moves`), their page ids read without a check."""
        m = self.member(name)
        if trusted:
            page = m.host.page_size
            self.backup_pages(
                name, vouched_pages(device_indices, page), vouched_pages(host_indices, page)
            )
            return
        m.host.backup(m.device, device_indices, host_indices).wait()

    def backup_pages(
        self, name: str, device_pages: npt.NDArray[np.int64], host_pages: npt.NDArray[np.int64]
    ) -> int:
        """D2H of all layers of `name`'s device pages `device_pages[k]` into host pages
        `host_pages[k]` (page ids the caller vouches for, as `backup(trusted=True)` takes its
        indices: in range, no device page 0, no host page twice; nothing is checked or
        converted); returns once the host bytes are complete. Returns the bytes of one page
        of `name` (all layers)."""
        m = self._members[name]
        m.host.backup_planned(m.device, PagePlan(device_pages, host_pages)).wait()
        return m.host.page_size_bytes

    def load_layers(
        self,
        name: str,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        completion: LayerCompletion,
        *,
        trusted: bool = False,
    ) -> list[LayerLoad]:
        """H2D of `name`'s pages, one layer at a time, for the member-local layers
        `completion.layer_ids` in that order; each layer is marked on `completion` as it lands
        (on CUDA: as its copy is enqueued, with its event). Indices are checked once (not at
        all with `trusted`, as for `backup`)."""
        m = self.member(name)
        if trusted:
            page = m.host.page_size
            return self.load_pages(
                name,
                vouched_pages(device_indices, page),
                vouched_pages(host_indices, page),
                completion,
            )
        return m.host.load_layers(
            m.device,
            host_indices,
            device_indices,
            completion=completion,
            layer_ids=completion.layer_ids,
        )

    def load_pages(
        self,
        name: str,
        device_pages: npt.NDArray[np.int64],
        host_pages: npt.NDArray[np.int64],
        completion: LayerCompletion,
    ) -> list[LayerLoad]:
        """`load_layers(trusted=True)` of page ids: host page `host_pages[k]` of `name` into
        device page `device_pages[k]`, one layer at a time as `load_layers`, the pages taken as
        `backup_pages` takes them (in range, no device page 0, no device page twice; nothing
        is checked or converted: one host-pool page plan, all layers copied in one compiled
        call on CPU)."""
        m = self._members[name]
        return m.host.load_layers_planned(
            m.device,
            PagePlan(host_pages, device_pages),
            completion=completion,
            layer_ids=completion.layer_ids,
        )

    def completion(self, loaded_layers: frozenset[int]) -> LayerCompletion:
        """A per-layer completion over every global layer, the ones outside `loaded_layers`
        (members a load does not move) already marked."""
        completion = LayerCompletion(self.layer_ids)
        for layer in self.layer_ids:
            if layer not in loaded_layers:
                completion.mark_loaded(layer)
        return completion

    def get_targets(self, name: str, pages: Sequence[int]) -> GetTargets:
        return GetTargets(self.member(name).host, pages)

    def set_source(self, name: str, page: int) -> memoryview:
        """The bytes of host page `page` of `name` for a batch_set: zero-copy for page_first
        layouts, a copy for layer_first. Read on the caller's thread, so the page must not be
        rewritten until the op using it is acknowledged."""
        host = self.member(name).host
        if host.layout is HostLayout.layer_first:
            buf = bytearray(host.page_size_bytes)
            host.read_page_into(page, buf)
            return memoryview(buf)
        return host.page_view(page)

    def set_sources(self, name: str, pages: Sequence[int]) -> list[memoryview]:
        """`set_source` of each of `pages` of `name`, the pages checked together."""
        host = self.member(name).host
        if host.layout is HostLayout.layer_first:
            return [self.set_source(name, page) for page in pages]
        return host.page_views(pages)


def _as_int64(indices: torch.Tensor, copy: bool) -> torch.Tensor:
    """`indices` as int64: a copy with `copy`, else the tensor itself when it already is one
    (what the tiers pass: no torch call on the hot path)."""
    if not copy and indices.dtype == torch.int64:
        return indices
    return indices.to(torch.int64, copy=copy)


def _check_range(indices: torch.Tensor, *, lo: int, hi: int, what: str) -> None:
    if indices.numel() == 0:
        return
    if indices.device.type == "cpu":  # NumPy reductions: no torch dispatch on the hot path
        values = indices.numpy()
        low, high = int(values.min()), int(values.max())
    else:
        low, high = (int(x) for x in torch.aminmax(indices))
    if low < lo or high >= hi:
        raise InvalidOperation(f"{what} indices must lie in [{lo}, {hi}); got [{low}, {high}]")
