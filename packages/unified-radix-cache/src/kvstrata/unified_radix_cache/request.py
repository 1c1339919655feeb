"""A running request's hold on the tree, and its life cycle through it.

    begin_request            match (at most len - 1 tokens: an engine always computes one),
                             lock the match; the request starts with the tree's slots
    (engine)                 allocates slots for the rest, writes KV, calls req.extend(...)
    cache_unfinished_request chunked prefill: insert what has KV so far, free the duplicates,
                             move the lock to the new prefix; the request keeps running
    cache_finished_request   insert, free duplicates and the unaligned tail, unlock
    abort_request            unlock and free what the request holds, insert nothing

    kv_indices:  | tree's slots (locked) | request's own slots |
                 0                   cached_len          len(kv_indices)

The functions here implement the `UnifiedRadixCache` methods of the same names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvstrata.unified_radix_cache.components.base import ComponentInsert
from kvstrata.unified_radix_cache.components.mamba import MambaComponent, MambaInsert
from kvstrata.unified_radix_cache.components.swa import SWAInsert
from kvstrata.unified_radix_cache.errors import InvalidInsert, RequestFinished
from kvstrata.unified_radix_cache.insert_inputs import as_priority
from kvstrata.unified_radix_cache.key import RadixKey
from kvstrata.unified_radix_cache.results import LockReceipt, PrefixHit

#: The hit of a request built by hand (not through `begin_request`): nothing matched.
NO_HIT = PrefixHit(0)

if TYPE_CHECKING:
    from kvstrata.unified_radix_cache.node import TreeNode
    from kvstrata.unified_radix_cache.tree_internals import TreeInternals


@dataclass(eq=False, kw_only=True)
class CacheRequest:
    """What a running request holds. Mutated by the tree's request methods and by `extend`.

    `kv_indices[:cached_len]` are the tree's slots (locked by `receipt`, valid until the request
    finishes); the rest are the request's own. `state_slot`: the request's own Mamba state slot
    (its copy-on-write copy, or one the engine allocated), None without Mamba.
    `swa_evicted_len`: the engine has freed the SWA slots of tokens before this position.
    `hit`: where the `hit_len` tokens matched at `begin_request` came from (device, host,
    storage) and the per-layer handle of their load.
    """

    key: RadixKey
    kv_indices: torch.Tensor
    cached_len: int
    hit_len: int
    receipt: LockReceipt | None
    state_slot: torch.Tensor | None = None
    swa_evicted_len: int = 0
    priority: int = 0
    page_size: int = 1
    finished: bool = False
    hit: PrefixHit = NO_HIT

    def extend(self, slots: torch.Tensor, token_ids: list[int] | None = None) -> None:
        """Append the slots of the next tokens' KV; with `token_ids`, also append those tokens
        to the key (decode). The key must keep at least as many tokens as there are slots."""
        if self.finished:
            raise RequestFinished("extend() on a finished request")
        key = self.key
        if token_ids:
            tokens = np.concatenate([key.tokens(), np.asarray(token_ids, dtype=np.int64)])
            key = RadixKey(tokens, key.extra_key, key.cache_salt)
        if self.kv_indices.numel() + len(slots) > len(key):
            raise InvalidInsert(
                f"{len(self.kv_indices) + len(slots)} KV slots for a key of {len(key)} tokens"
            )
        self.key = key
        self.kv_indices = torch.cat([self.kv_indices, slots.to(self.kv_indices.device)])

    def held(self) -> dict[str, int]:
        """Slots this request holds outside the tree, per component (for check_integrity):
        its own Full slots rounded up to whole pages (a paged allocator hands out pages), the
        SWA slots of those it has not dropped (`swa_evicted_len`), its own state slot."""
        page = self.page_size
        end_pages = -(-len(self.kv_indices) // page)
        own_pages = end_pages - self.cached_len // page
        swa_start = max(self.cached_len, self.swa_evicted_len) // page
        out = {"full": own_pages * page, "swa": max(end_pages - swa_start, 0) * page}
        if self.state_slot is not None:
            out["mamba"] = int(self.state_slot.numel())
        return out


def begin_request(
    tree: TreeInternals, key: RadixKey, *, priority: int = 0, copy_state: bool = True
) -> CacheRequest:
    if type(priority) is not int:
        priority = as_priority(priority)
    match = tree.match_prefix(key, max_len=len(key) - 1, copy_state=copy_state)
    receipt = tree.lock(match.last_node)
    return CacheRequest(
        key=key,
        kv_indices=match.device_indices,
        cached_len=match.prefix_len,
        hit_len=match.prefix_len,
        receipt=receipt,
        state_slot=match.states.get("mamba"),
        priority=priority,
        page_size=tree.page_size,
        hit=PrefixHit(match.prefix_len),
    )


def _inputs(
    tree: TreeInternals, req: CacheRequest, state: int | None
) -> dict[str, ComponentInsert]:
    inputs: dict[str, ComponentInsert] = {}
    names = {c.name for c in tree.components}
    if "swa" in names and req.swa_evicted_len:
        inputs["swa"] = SWAInsert(evicted_len=req.swa_evicted_len)
    if state is not None:
        inputs["mamba"] = MambaInsert(slot=state)
    return inputs


def _mamba(tree: TreeInternals) -> MambaComponent | None:
    for component in tree.components:
        if isinstance(component, MambaComponent):
            return component
    return None


def _insert(
    tree: TreeInternals, req: CacheRequest, state: int | None
) -> tuple[int, bool, TreeNode]:
    """Insert the whole pages that have KV; free the request's duplicates. Returns how many
    leading tokens the tree now holds for the request, whether `state` was adopted, and the
    node ending there."""
    if req.finished:
        raise RequestFinished("the request was already finished")
    kv_indices = req.kv_indices
    num_kv = kv_indices.numel()
    aligned = num_kv - num_kv % tree.page_size
    # Once per request: no tensor slice or input dict where none is needed (each costs a few
    # microseconds: an engine's aligned request has no tail, a Full-only one no input).
    values = kv_indices if aligned == num_kv else kv_indices[:aligned]
    inputs = None
    if state is not None or req.swa_evicted_len:
        inputs = _inputs(tree, req, state if aligned == num_kv and aligned else None)
    cached_len = req.cached_len
    result = tree.insert(
        req.key[:aligned],
        values,
        cached_len=cached_len if cached_len < aligned else aligned,
        priority=req.priority,
        inputs=inputs,
    )
    if result.prefix_len > result.cached_len:  # else `duplicates` is empty
        duplicates = result.duplicates(values)
        if duplicates.numel():
            tree.free_slots("full", duplicates)
    held = result.prefix_len + result.inserted_len
    last = result.last_node if held else tree.root
    return held, "mamba" in result.adopted_states, last


def cache_unfinished_request(tree: TreeInternals, req: CacheRequest) -> TreeNode:
    if req.finished:
        raise RequestFinished("the request was already finished")
    state_copy: torch.Tensor | None = None
    mamba = _mamba(tree)
    num_kv = req.kv_indices.numel()
    if mamba is not None and req.state_slot is not None and num_kv % tree.page_size == 0:
        # The request keeps advancing its own state, so the tree gets a copy.
        state_copy = mamba.allocator.alloc(1)
        if state_copy is not None:
            mamba.pool.copy(req.state_slot.to(mamba.device), state_copy)
    held, adopted, anchor = _insert(
        tree, req, None if state_copy is None else int(state_copy.item())
    )
    if state_copy is not None and not adopted:
        tree.free_slots("mamba", state_copy)
    old = req.receipt
    req.receipt = tree.lock(anchor)
    if old is not None:
        tree.unlock(old)
    own = req.kv_indices[held:]
    req.kv_indices = torch.cat([tree.prefix_slots(anchor), own.to(tree.full_device)])
    req.cached_len = held
    return anchor


def cache_finished_request(tree: TreeInternals, req: CacheRequest) -> TreeNode:
    state = None if req.state_slot is None else int(req.state_slot.reshape(-1)[0].item())
    held, adopted, last = _insert(tree, req, state)
    if held < req.kv_indices.numel():  # the unaligned tail (no slice without one)
        tree.free_slots("full", req.kv_indices[held:])
    if req.state_slot is not None and not adopted:
        tree.free_slots("mamba", req.state_slot)
    _close(tree, req)
    return last


def abort_request(tree: TreeInternals, req: CacheRequest) -> None:
    if req.finished:
        raise RequestFinished("the request was already finished")
    own = req.kv_indices[req.cached_len :]
    if len(own):
        tree.free_slots("full", own)
    if req.state_slot is not None:
        tree.free_slots("mamba", req.state_slot)
    _close(tree, req)


def _close(tree: TreeInternals, req: CacheRequest) -> None:
    if req.receipt is not None:
        tree.unlock(req.receipt)
    req.receipt = None
    req.state_slot = None
    req.kv_indices = req.kv_indices[:0]
    req.cached_len = 0
    req.finished = True
