"""What a replay reports: counters of the requests it drove, and the rates derived from them."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(kw_only=True)
class ReplayCounters:
    """The running counters of a `ReplayEngine` (`engine.counters`): plain numbers that only
    grow, until `reset_counters()` starts a fresh set. `ReplayEngine.stats()` is their snapshot;
    the fields mean what `ReplayStats` and `TierStats` say. `evict_calls`: evictions the engine
    asked for when an allocation fell short; the per-tier hits count only with a host tier."""

    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    computed_tokens: int = 0
    evicted_tokens: int = 0
    evict_calls: int = 0
    cache_seconds: float = 0.0
    kv_write_seconds: float = 0.0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    storage_hit_tokens: int = 0


@dataclass(frozen=True, kw_only=True)
class TierStats:
    """Where a tiered replay's hits came from and what moved between tiers.

    `device_hit_tokens + host_hit_tokens + storage_hit_tokens == ReplayStats.hit_tokens`: a
    token counts under the tier it was on when its request was scheduled (storage hits came
    through the host). Bytes are all layers of whole pages, per direction (d2h: device ->
    host writes, h2d: load-backs, storage_get: prefetches, storage_set: backups);
    `transfer_wait_seconds` is the time requests waited for transfers (load-backs, prefetches,
    write-back evictions); `failed_transfers` the acks that reported a failure."""

    device_hit_tokens: int
    host_hit_tokens: int
    storage_hit_tokens: int
    bytes_d2h: int
    bytes_h2d: int
    bytes_storage_get: int
    bytes_storage_set: int
    transfer_wait_seconds: float
    failed_transfers: int


@dataclass(frozen=True, kw_only=True)
class ReplayStats:
    """A snapshot of a replay's counters (`ReplayEngine.stats()`); plain numbers, JSON-ready.

    Token counts are prompt tokens:

    - `prompt_tokens`: every token of every prompt, as the trace or workload gives it;
    - `hit_tokens`: what the tree matched and the engine reuses, counted before the request's
      own insert. An engine computes at least one token of every prompt, so the usable hit of an
      N-token prompt is at most N - 1 rounded down to a page: a prompt the tree holds whole
      still recomputes its last page (on the shared trace unbounded this gives 36.60 % where
      the prefix-set ideal, which counts whole-prompt repeats, is 36.64 %);
    - `computed_tokens` = prompt - hit: the tokens whose KV the replay wrote into the pools;
    - `evicted_tokens`: tokens the tree evicted from the device to make room (full KV).

    `cache_seconds` is the time spent in cache operations (match, lock, allocate, evict, insert,
    unlock, free), the figure the rates are computed from; `kv_write_seconds` is the time spent
    writing KV into the pools, which stands in for the model's forward and is not a cache cost.
    """

    requests: int
    prompt_tokens: int
    hit_tokens: int
    computed_tokens: int
    evicted_tokens: int
    cache_seconds: float
    kv_write_seconds: float
    tiers: TierStats | None = None

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def requests_per_s(self) -> float:
        """Requests per second of cache operations (0 before any time was spent)."""
        return self.requests / self.cache_seconds if self.cache_seconds > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Prompt tokens per second of cache operations (0 before any time was spent)."""
        return self.prompt_tokens / self.cache_seconds if self.cache_seconds > 0 else 0.0

    def to_json(self) -> dict[str, int | float]:
        """The counters and the derived rates, in the order the summary table shows them."""
        record: dict[str, int | float] = asdict(self)
        del record["tiers"]  # flattened below, only when tiered
        if self.tiers is not None:
            record.update(asdict(self.tiers))
        record.update(
            hit_rate=round(self.hit_rate, 6),
            requests_per_s=round(self.requests_per_s, 1),
            tokens_per_s=round(self.tokens_per_s, 1),
        )
        return record
