"""What `BatchAllocator` hands a scheduler: one running request, and the locations of a batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvstrata.unified_radix_cache import CacheRequest


@dataclass(eq=False)
class Running:
    """One admitted request (`BatchAllocator.admit`). Mutated only by the allocator.

    `tokens`: every token the request knows (prompt, then the decoded ones). `seq_len`: how
    many of them have a KV slot in row `row` of the request-to-token table (the cached prefix
    plus what the engine computed). `cache_req`: the prefix cache's hold (its `hit` says which
    tier the prefix came from). `finished`: finished, retracted or aborted.
    """

    cache_req: CacheRequest
    row: int
    tokens: list[int]
    seq_len: int
    hit_len: int
    finished: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def prefilled(self) -> bool:
        """Every known token has KV (the next step is a decode)."""
        return self.seq_len == len(self.tokens)

    @property
    def state_slot(self) -> int | None:
        """The request's own Mamba state slot (None without Mamba layers)."""
        slot = self.cache_req.state_slot
        return None if slot is None else int(slot.reshape(-1)[0])


class ExtendBatch(NamedTuple):
    """Locations of one extend (prefill) batch, requests in the order given.

    Request i computes tokens `prefix_lens[i] .. seq_lens[i] - 1`; their KV slots are
    `out_cache_loc[offsets]` (concatenated in request order, `extend_lens[i]` each) and are in
    row `rows[i]` of the request-to-token table already. `swa_cache_loc`: the same tokens' SWA
    slots (None without SWA layers). `state_slots`: each request's Mamba state slot (None
    without Mamba layers). All int64 on the allocator's device except the host-side lengths.
    """

    rows: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    swa_cache_loc: torch.Tensor | None
    state_slots: torch.Tensor | None


class DecodeBatch(NamedTuple):
    """Locations of one decode batch: request i's new token is at position `seq_lens[i] - 1`,
    KV slot `out_cache_loc[i]` (in row `rows[i]` already); SWA / state slots as in
    `ExtendBatch`."""

    rows: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    swa_cache_loc: torch.Tensor | None
    state_slots: torch.Tensor | None
