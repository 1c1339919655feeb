"""What a replayed memory system has besides its device pools: a host tier, a storage and the
hierarchical cache's policies (`TierConfig`), and the cache parameters they give
(`tier_params`). `compare.run_configuration` and `model.ModelBuild.build` both read it."""

from __future__ import annotations

from dataclasses import dataclass

from kvstrata.hybrid_cache import PrefetchPolicy
from kvstrata.replay.errors import ReplayOptionError
from kvstrata.unified_radix_cache.errors import InvalidConfig
from kvstrata.unified_radix_cache.tiers import TierParams, WritePolicy

__all__ = ["TIERS", "TierConfig", "tier_params"]

#: The tiers, top first.
TIERS: tuple[str, ...] = ("device", "host", "storage")


@dataclass(frozen=True, kw_only=True)
class TierConfig:
    """One memory system to replay through. `capacity_tokens` None: room for every prompt.
    At most one of `host_ratio` / `host_bytes`; `storage_url` needs a host tier (a ratio of 2
    is used when neither is given)."""

    name: str
    capacity_tokens: int | None
    host_ratio: float | None = None
    host_bytes: int | None = None
    storage_url: str | None = None
    write_policy: str = "write_through"
    prefetch_policy: str = "wait_complete"
    prefetch_threshold: int = 256

    @property
    def tiered(self) -> bool:
        return (
            self.host_ratio is not None
            or self.host_bytes is not None
            or self.storage_url is not None
        )

    @property
    def tiers(self) -> tuple[str, ...]:
        """The tiers this configuration has, top first."""
        if self.storage_url is not None:
            return TIERS
        return TIERS[:2] if self.tiered else TIERS[:1]


def tier_params(config: TierConfig) -> TierParams:
    """The hierarchical cache's parameters of `config` (ReplayOptionError when out of range)."""
    try:
        return TierParams(
            write_policy=WritePolicy(config.write_policy),
            prefetch_policy=PrefetchPolicy(config.prefetch_policy),
            prefetch_threshold=config.prefetch_threshold,
        )
    except (InvalidConfig, ValueError) as exc:
        raise ReplayOptionError(str(exc)) from exc
