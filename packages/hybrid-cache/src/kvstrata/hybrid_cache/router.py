"""HybridPool: the one object an engine's attention backend asks for its buffers.

A model's layers are spread over several device pools. The router maps each global layer id to
the pool that owns it and to the id that pool's own methods take:

    full only        layers 0..L-1           -> full   (MHA or MLA pool, ids as they are)
    full + SWA       full_layer_ids          -> full   (SWAKVPool.full_pool, local ids)
                     swa_layer_ids           -> swa    (SWAKVPool.swa_pool, local ids; token
                                                        locations translated full -> SWA)
    attention+Mamba  attention_layer_ids[i]  -> full   (the KV pool's i-th layer; or SWA as above)
                     mamba_layer_ids[j]      -> mamba  (MambaPool layer j)

Each pool is a *member* with a name ("full", "swa", "mamba"), the unit the tier controller moves
pages of, and a `RestoreRule` saying what that member needs to resume a prefix (restore.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple

import torch

from kvstrata.hybrid_cache.errors import (
    InvalidPoolLayout,
    LayerKindMismatch,
    UnknownLayer,
    member_named,
)
from kvstrata.hybrid_cache.restore import RestoreRule
from kvstrata.pool import KVPool, MambaPool, SWAKVPool
from kvstrata.pool.base import DevicePool

FULL = "full"
SWA = "swa"
MAMBA = "mamba"


class LayerKind(StrEnum):
    ATTENTION = "attention"
    MAMBA = "mamba"


class LayerRouting(NamedTuple):
    """Where one global layer lives: the member and pool owning it, and the layer id that
    pool's methods (and its host mirror's `load`) take."""

    member: str
    pool: DevicePool
    local_layer_id: int
    kind: LayerKind


class MambaLayerState(NamedTuple):
    """The state tensors of one Mamba layer, slot-indexed (slot 0 is the padding slot)."""

    conv: torch.Tensor
    ssm: torch.Tensor


@dataclass(frozen=True, kw_only=True, eq=False)
class PoolMember:
    """One device pool of the model and the global layers it owns, in ascending order."""

    name: str
    pool: DevicePool
    rule: RestoreRule
    layer_ids: tuple[int, ...]


class HybridPool:
    """Routes global layer ids to pools. Build it with `full`, `swa` or `with_mamba`.

    Holds references only: the pools stay owned by the caller, and every tensor returned is the
    pool's own buffer (a view), valid as long as the pool lives.
    """

    def __init__(
        self,
        *,
        members: Sequence[PoolMember],
        routes: Iterable[tuple[int, LayerRouting]],
        swa_pool: SWAKVPool | None = None,
        swa_attention_ids: dict[int, int] | None = None,
    ) -> None:
        """Low-level constructor; prefer the class methods, which derive `routes` from the pools.

        `swa_pool` and `swa_attention_ids` (global layer id -> the SWAKVPool's own layer id)
        are given when attention goes through a SWAKVPool, so `set_kv` can translate locations.
        """
        names = [m.name for m in members]
        if len(set(names)) != len(names):
            raise InvalidPoolLayout(f"member names must be unique, got {names}")
        if not members:
            raise InvalidPoolLayout("a HybridPool needs at least one pool")
        self._members = {m.name: m for m in members}
        self._routes: dict[int, LayerRouting] = {}
        for layer_id, route in routes:
            if layer_id in self._routes:
                raise InvalidPoolLayout(f"layer {layer_id} is owned by two pools")
            if route.member not in self._members:
                raise InvalidPoolLayout(f"layer {layer_id} routes to unknown member {route.member}")
            self._routes[layer_id] = route
        for m in members:
            owned = tuple(sorted(i for i, r in self._routes.items() if r.member == m.name))
            if owned != m.layer_ids:
                raise InvalidPoolLayout(
                    f"member {m.name!r} declares layers {m.layer_ids} but routes {owned}"
                )
        self._layer_ids = tuple(sorted(self._routes))
        self._swa_pool = swa_pool
        self._swa_attention_ids = dict(swa_attention_ids or {})

    # --- construction ----------------------------------------------------------------------------

    @classmethod
    def full(cls, pool: KVPool) -> HybridPool:
        """A model whose every layer is full attention in one MHA or MLA pool (global ids are
        the pool's own, `start_layer` included)."""
        layer_ids = _pool_layer_ids(pool)
        member = PoolMember(name=FULL, pool=pool, rule=RestoreRule.prefix(), layer_ids=layer_ids)
        routes = [(i, LayerRouting(FULL, pool, i, LayerKind.ATTENTION)) for i in layer_ids]
        return cls(members=[member], routes=routes)

    @classmethod
    def swa(cls, pool: SWAKVPool) -> HybridPool:
        """A model interleaving full and sliding-window attention layers (global ids are the
        SWAKVPool's `full_layer_ids` and `swa_layer_ids`)."""
        members, routes, ids = _swa_parts(pool, {i: i for i in _swa_layer_ids(pool)})
        return cls(members=members, routes=routes, swa_pool=pool, swa_attention_ids=ids)

    @classmethod
    def with_mamba(
        cls,
        *,
        attention: KVPool | SWAKVPool,
        attention_layer_ids: Sequence[int],
        mamba: MambaPool,
        mamba_layer_ids: Sequence[int],
    ) -> HybridPool:
        """A model mixing attention and Mamba layers. The attention pool's i-th layer serves
        global layer `attention_layer_ids[i]`; the Mamba pool's j-th `mamba_layer_ids[j]`."""
        attention_ids = tuple(attention_layer_ids)
        mamba_ids = tuple(mamba_layer_ids)
        if sorted(set(attention_ids)) != sorted(attention_ids) or sorted(set(mamba_ids)) != sorted(
            mamba_ids
        ):
            raise InvalidPoolLayout("attention and mamba layer ids must each be unique")
        if set(attention_ids) & set(mamba_ids):
            raise InvalidPoolLayout(
                f"layers {sorted(set(attention_ids) & set(mamba_ids))} are both attention and mamba"
            )
        if len(mamba_ids) != mamba.spec.num_layers:
            raise InvalidPoolLayout(
                f"{len(mamba_ids)} mamba layer ids for a MambaPool of "
                f"{mamba.spec.num_layers} layers"
            )
        mamba_member = PoolMember(
            name=MAMBA, pool=mamba, rule=RestoreRule.boundary(), layer_ids=tuple(sorted(mamba_ids))
        )
        mamba_routes = [
            (g, LayerRouting(MAMBA, mamba, j, LayerKind.MAMBA)) for j, g in enumerate(mamba_ids)
        ]
        if isinstance(attention, SWAKVPool):
            own = _swa_layer_ids(attention)
            if len(own) != len(attention_ids):
                raise InvalidPoolLayout(
                    f"{len(attention_ids)} attention layer ids for a SWAKVPool of {len(own)} layers"
                )
            members, routes, ids = _swa_parts(attention, dict(zip(own, attention_ids, strict=True)))
            return cls(
                members=[*members, mamba_member],
                routes=[*routes, *mamba_routes],
                swa_pool=attention,
                swa_attention_ids=ids,
            )
        own_ids = _pool_layer_ids(attention)
        if len(own_ids) != len(attention_ids):
            raise InvalidPoolLayout(
                f"{len(attention_ids)} attention layer ids for a KV pool of {len(own_ids)} layers"
            )
        full_member = PoolMember(
            name=FULL,
            pool=attention,
            rule=RestoreRule.prefix(),
            layer_ids=tuple(sorted(attention_ids)),
        )
        full_routes = [
            (g, LayerRouting(FULL, attention, own, LayerKind.ATTENTION))
            for own, g in zip(own_ids, attention_ids, strict=True)
        ]
        return cls(members=[full_member, mamba_member], routes=[*full_routes, *mamba_routes])

    # --- routing ---------------------------------------------------------------------------------

    @property
    def layer_ids(self) -> tuple[int, ...]:
        """Every global layer id, ascending: the order a forward pass (and a load) visits them."""
        return self._layer_ids

    @property
    def members(self) -> tuple[PoolMember, ...]:
        return tuple(self._members.values())

    @property
    def member_names(self) -> tuple[str, ...]:
        return tuple(self._members)

    def member(self, name: str) -> PoolMember:
        return member_named(self._members, name, InvalidPoolLayout, "model")

    def route(self, layer_id: int) -> LayerRouting:
        """The member, pool and pool-local layer id of global `layer_id`; UnknownLayer if none."""
        try:
            return self._routes[layer_id]
        except KeyError:
            raise UnknownLayer(layer_id, self._layer_ids) from None

    def kind(self, layer_id: int) -> LayerKind:
        return self.route(layer_id).kind

    # --- what an attention backend calls ---------------------------------------------------------

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """The K buffer of an attention layer (for MLA: the latent buffer), indexed by the slots
        of that layer's pool (`layer_loc` translates for SWA layers)."""
        route = self._attention(layer_id)
        return route.pool.get_key_buffer(route.local_layer_id)

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """The V buffer of an attention layer (for MLA: the V view of the latent buffer)."""
        route = self._attention(layer_id)
        return route.pool.get_value_buffer(route.local_layer_id)

    def layer_loc(self, layer_id: int, loc: torch.Tensor) -> torch.Tensor:
        """Token locations (full-pool slots, as the allocator hands them out) in the index space
        of `layer_id`'s buffers: translated to SWA slots for sliding-window layers, unchanged
        otherwise. Slots without an SWA slot map to 0, the padding slot."""
        route = self._attention(layer_id)
        if route.member == SWA:
            assert self._swa_pool is not None, "an SWA route without its SWAKVPool"
            return self._swa_pool.translate(loc)
        return loc

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K and V of `loc` (full-pool slots) into `layer_id`'s pool, casting to its dtype.
        Mutates that pool's buffers only."""
        route = self._attention(layer_id)
        if route.member == SWA or (
            self._swa_pool is not None and layer_id in self._swa_attention_ids
        ):
            assert self._swa_pool is not None, "an SWA route without its SWAKVPool"
            # The SWAKVPool translates locations for its SWA layers itself.
            self._swa_pool.set_kv(self._swa_attention_ids[layer_id], loc, k, v)
            return
        route.pool.set_kv(route.local_layer_id, loc, k, v)

    def mamba_state(self, layer_id: int) -> MambaLayerState:
        """Conv and SSM state of a Mamba layer, `[slots, ...]` views of the MambaPool."""
        route = self.route(layer_id)
        if route.kind is not LayerKind.MAMBA:
            raise LayerKindMismatch(
                f"layer {layer_id} is an attention layer, it has no mamba state"
            )
        assert isinstance(route.pool, MambaPool), "a mamba route to a non-Mamba pool"
        return MambaLayerState(
            conv=route.pool.conv_state[route.local_layer_id],
            ssm=route.pool.ssm_state[route.local_layer_id],
        )

    def _attention(self, layer_id: int) -> _AttentionRoute:
        route = self.route(layer_id)
        if route.kind is not LayerKind.ATTENTION:
            raise LayerKindMismatch(f"layer {layer_id} is a mamba layer, it has no KV buffers")
        assert isinstance(route.pool, KVPool), "an attention route to a non-KV pool"
        return _AttentionRoute(route.member, route.pool, route.local_layer_id)


class _AttentionRoute(NamedTuple):
    member: str
    pool: KVPool
    local_layer_id: int


def _pool_layer_ids(pool: KVPool) -> tuple[int, ...]:
    return tuple(pool.layer_ids)


def _swa_layer_ids(pool: SWAKVPool) -> tuple[int, ...]:
    return tuple(pool.layer_ids)


def _swa_parts(
    pool: SWAKVPool, global_of: dict[int, int]
) -> tuple[list[PoolMember], list[tuple[int, LayerRouting]], dict[int, int]]:
    """Members and routes of a SWAKVPool whose own layer id `i` serves global `global_of[i]`."""
    full_ids = tuple(sorted(global_of[i] for i in pool.spec.full_layer_ids))
    swa_ids = tuple(sorted(global_of[i] for i in pool.spec.swa_layer_ids))
    rule = RestoreRule.window(sliding_window=pool.spec.sliding_window, page_size=pool.page_size)
    members = [
        PoolMember(name=FULL, pool=pool.full_pool, rule=RestoreRule.prefix(), layer_ids=full_ids),
        PoolMember(name=SWA, pool=pool.swa_pool, rule=rule, layer_ids=swa_ids),
    ]
    routes: list[tuple[int, LayerRouting]] = []
    for own, g in global_of.items():
        r = pool.layer_pool(own)
        member = SWA if r.pool is pool.swa_pool else FULL
        routes.append((g, LayerRouting(member, r.pool, r.local_layer_id, LayerKind.ATTENTION)))
    return members, routes, {g: own for own, g in global_of.items()}
