"""Operation and acknowledgement types of the tier controller.

An operation says what to move; the controller validates it at submit (raising before anything is
queued), runs it on a background worker and acknowledges it exactly once with an `Ack`. The tree
commits a node's new tier state only from an acknowledgement.

Pages are named per member of the pool group (`"full"`, `"swa"`, `"mamba"`, ...: see
`HybridPool.member_names`): a hybrid model's pages move together, each member with its own indices.

    write     device -> host      WriteOp(moves={member: PageMove(device, host)})   all layers
    load      host -> device      LoadOp(moves=...)                                 layer by layer
    prefetch  storage -> host     PrefetchOp(keys, host_pages={member: [page|None]})
    backup    host -> storage     BackupOp(keys, host_pages={member: [page|None]})
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np
import numpy.typing as npt
import torch


class OpKind(StrEnum):
    WRITE = "write"
    LOAD = "load"
    PREFETCH = "prefetch"
    BACKUP = "backup"


class AckStatus(StrEnum):
    DONE = "done"
    """Every page of the operation moved."""
    PARTIAL = "partial"
    """A leading part moved (`num_pages_done` of `num_pages`); the rest did not and must not be
    used. Prefetches and backups only: a storage miss, fault or policy stop ends them early."""
    FAILED = "failed"
    """Nothing may be used; `error` says why."""


class PrefetchPolicy(StrEnum):
    """When the request that asked for a prefetch stops waiting for it (TIERS.md)."""

    BEST_EFFORT = "best_effort"
    """Take whatever has arrived when the request is scheduled."""
    WAIT_COMPLETE = "wait_complete"
    """Wait for every page."""
    TIMEOUT = "timeout"
    """Wait up to `PrefetchTimeout.seconds(num_tokens)`, then take what arrived."""


@dataclass(frozen=True, kw_only=True)
class PrefetchTimeout:
    """The `timeout` policy's allowance: a base plus a share per 1,000 tokens, because a longer
    prefix takes longer to fetch and is worth waiting longer for (it saves more recompute)."""

    base_s: float = 1.0
    per_1k_tokens_s: float = 0.25

    def __post_init__(self) -> None:
        if not (math.isfinite(self.base_s) and self.base_s >= 0):
            raise ValueError(f"base_s must be finite and >= 0, got {self.base_s}")
        if not (math.isfinite(self.per_1k_tokens_s) and self.per_1k_tokens_s >= 0):
            raise ValueError(f"per_1k_tokens_s must be finite and >= 0, got {self.per_1k_tokens_s}")

    def seconds(self, num_tokens: int) -> float:
        """The wait allowed for a prefetch of `num_tokens` tokens."""
        return self.base_s + self.per_1k_tokens_s * num_tokens / 1000.0


@dataclass(frozen=True, kw_only=True, eq=False)
class PageMove:
    """Indices of the same pages in a device pool and in its host mirror.

    Both are 1-D int64 CPU-or-device tensors of equal length, in the index space the pool-host
    `backup` / `load` take (token slots of whole pages for KV pools; state slots for Mamba). Entry i
    of `device` and entry i of `host` hold the same data once the move is done.
    """

    device: torch.Tensor
    host: torch.Tensor


#: One member's part of a trusted write (`TierController.submit_write_pages`): its device page
#: ids and the host page ids they go to, 1-D int64 NumPy arrays of equal length (page ids, not
#: token slots: slot s of a pool with pages of P slots is in page s // P).
PagePairs = tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]


@dataclass(frozen=True, kw_only=True, eq=False)
class WriteOp:
    """Back pages up from the device to the host mirror: all layers of every member named.

    The device pages must not be freed or overwritten until the op is acknowledged; the host pages
    hold valid data only after a `done` ack."""

    moves: Mapping[str, PageMove]


@dataclass(frozen=True, kw_only=True, eq=False)
class LoadOp:
    """Load pages from the host mirror back to the device, one layer at a time in layer order.

    The returned `LoadHandle.wait_layer(layer_id)` blocks until that layer's pages are on the
    device, so attention of layer i runs while layer i + 1 is still being copied."""

    moves: Mapping[str, PageMove]


@dataclass(frozen=True, kw_only=True, eq=False)
class PrefetchOp:
    """Fetch the pages of a token prefix from storage into host pages the caller allocated.

    `keys` are the chained page keys of the pages to fetch, in prefix order (`PageKeyer` output,
    continuing from the last page the host already has). `host_pages[member][i]` is the host page
    that receives `keys[i]` for that member, or None where that member needs no page (SWA pages
    outside the window, Mamba state away from the boundary). Every list has `len(keys)` entries.

    The host pages stay owned by the operation until its ack: the caller frees the pages past
    `num_pages_done` only then (a storage call may still be writing into them before it)."""

    keys: Sequence[bytes]
    host_pages: Mapping[str, Sequence[int | None]]
    num_tokens: int
    policy: PrefetchPolicy = PrefetchPolicy.BEST_EFFORT
    timeout: PrefetchTimeout = field(default_factory=PrefetchTimeout)


@dataclass(frozen=True, kw_only=True, eq=False)
class BackupOp:
    """Store host pages under their page keys (host -> storage); keys already stored are skipped.

    `host_pages` is laid out as in `PrefetchOp`. The host pages must stay allocated and unchanged
    until the ack."""

    keys: Sequence[bytes]
    host_pages: Mapping[str, Sequence[int | None]]


Op = WriteOp | LoadOp | PrefetchOp | BackupOp


@dataclass(frozen=True, kw_only=True)
class Ack:
    """The one acknowledgement of a finished operation.

    `num_pages` counts the operation's pages: key pages for prefetch and backup, and for write
    and load the pages of all members together. `num_pages_done` is how many of them may be used:
    for a prefetch, the leading key pages that every member can restore (see `restorable_pages`);
    for a backup, the leading key pages now in storage for every member."""

    op_id: int
    kind: OpKind
    status: AckStatus
    num_pages: int
    num_pages_done: int
    error: BaseException | None = None

    def __post_init__(self) -> None:
        assert 0 <= self.num_pages_done <= self.num_pages, (
            f"ack {self.op_id}: {self.num_pages_done} of {self.num_pages} pages done"
        )
        assert (self.status is AckStatus.FAILED) == (self.error is not None) or (
            self.status is AckStatus.PARTIAL
        ), f"ack {self.op_id}: status {self.status} with error {self.error!r}"

    @property
    def ok(self) -> bool:
        """True when every page moved."""
        return self.status is AckStatus.DONE


@dataclass(frozen=True, kw_only=True)
class PrefetchProgress:
    """What a prefetch has delivered so far (`TierController.prefetch_progress` / `stop_prefetch`).

    `num_pages_ready` leading key pages are restorable now and will not be written again;
    `finished` says the op has been acknowledged (its ack is waiting in `poll_acks`)."""

    op_id: int
    num_pages: int
    num_pages_ready: int
    finished: bool
    ready_to_take: bool
    """The op's policy lets the request proceed now (best effort: always; wait complete: once
    finished; timeout: once finished or past its allowance)."""
