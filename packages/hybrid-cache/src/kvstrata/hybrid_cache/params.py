"""`ControllerParams`: the tuning of a `TierController` (controller.py), validated when made."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class ControllerParams:
    """Tuning of a TierController. Defaults suit a scheduler that drains acks every step."""

    queue_capacity: int = 256
    """Operations that may wait per kind before a submit raises QueueFull."""
    max_merge_ops: int = 64
    """Consecutive writes (loads, backups) merged into one transfer, at most."""
    storage_batch_pages: int = 128
    """Pages per storage call: a prefetch checks its policy between calls."""
    prefetch_host_share: float = 0.5
    """Host pages held by prefetches in flight stay <= this share of each member's host pool."""
    storage_call_timeout_s: float | None = None
    """A storage call slower than this ends its prefetch at the last page before it (its pages
    are not counted even if they arrive); None: no limit."""
    verify_checksums: bool = True
    """Store a CRC-32 beside each page on backup and check it on prefetch (storage_io.py)."""
    run_inline: bool | None = None
    """Run a load or prefetch submitted with `inline=True` (the caller waits for it at once)
    and a batch of writes or backups given to `submit_writes` / `submit_write_pages` /
    `submit_backup(s)` with `inline=True` on the caller's thread instead of handing it to a
    worker (backups only over storage that is `in_process_memory`: a file or remote store's
    I/O overlaps on a worker).
    None: when every device pool of the group is on the CPU (a copy there is a memcpy under the
    GIL: a thread round trip buys no overlap and costs a GIL hand-off); False: always queue
    (CUDA streams overlap with the forward)."""

    def __post_init__(self) -> None:
        if self.queue_capacity < 1 or self.max_merge_ops < 1 or self.storage_batch_pages < 1:
            raise ValueError(
                "queue_capacity, max_merge_ops and storage_batch_pages must be >= 1, got "
                f"{self.queue_capacity}, {self.max_merge_ops}, {self.storage_batch_pages}"
            )
        if not 0.0 < self.prefetch_host_share <= 1.0:
            raise ValueError(
                f"prefetch_host_share must be in (0, 1], got {self.prefetch_host_share}"
            )
        if self.storage_call_timeout_s is not None and self.storage_call_timeout_s <= 0:
            raise ValueError(
                f"storage_call_timeout_s must be > 0, got {self.storage_call_timeout_s}"
            )
