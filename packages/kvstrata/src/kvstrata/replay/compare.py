"""One replay per tier configuration, sampled as it runs, and the default comparison.

`run_configuration` builds the memory system (and tiers) a `TierConfig` describes, replays the
requests through it, and returns the stats with a `Sample` every `sample_every` requests (hits
per tier and capacity used per tier so far), which `kvstrata.replay.plot` draws.
`default_configs` is the main job's default: the same device, too small for the workload,
alone, then with a host tier, then with host + storage.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

from prometheus_client.registry import Collector

from kvstrata.build import build_memory_system
from kvstrata.build.tiers import build_tiers
from kvstrata.replay.engine import ReplayEngine, unbounded_capacity
from kvstrata.replay.errors import ReplayOptionError
from kvstrata.replay.exporter import ConfigCollector, replay_collectors
from kvstrata.replay.model import ModelBuild
from kvstrata.replay.request import ReplayRequest
from kvstrata.replay.stats import ReplayStats
from kvstrata.replay.tier_config import TIERS, TierConfig, tier_params

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from kvstrata.build import MemorySystem
    from kvstrata.build.tiers import TieredSystem

__all__ = [
    "TIERS",
    "ConfigRun",
    "Sample",
    "TierConfig",
    "default_configs",
    "run_configuration",
    "tier_params",
]

#: The default comparison's device holds this share of the workload's distinct pages (at least
#: the longest request): small enough that the device alone evicts much of what comes back.
DEFAULT_DEVICE_SHARE = 0.3
#: Host mirror size of the default comparison, times the device.
DEFAULT_HOST_RATIO = 2.0
#: Bytes of the default comparison's memory storage: about three times what the embedded
#: workload backs up (its distinct pages, ~10 MB for the default model), so the plot shows use.
DEFAULT_STORAGE_BYTES = 32 << 20


@dataclass(frozen=True, kw_only=True)
class Sample:
    """Counters after `requests` requests: cumulative prompt and hit tokens (per tier), and the
    share of each tier's capacity in use (None for a tier the configuration lacks)."""

    requests: int
    prompt_tokens: int
    hit_tokens: dict[str, int]
    used_share: dict[str, float | None]


@dataclass(frozen=True, kw_only=True)
class ConfigRun:
    """What one configuration's replay gave: its stats, the samples, how it was built, and the
    collectors of its layers (they keep reading the finished system)."""

    config: TierConfig
    stats: ReplayStats
    samples: list[Sample]
    capacity_tokens: int
    host_tokens: int | None
    host_state_slots: int | None
    host_swa_tokens: int | None
    wall_seconds: float
    device: str
    collectors: list[Collector] = field(default_factory=list)
    #: The built system's family (mha, swa, mamba, mla) and, for a `ModelBuild`, the model's
    #: architecture (None for a toy family).
    family: str = ""
    model: str | None = None
    page_size: int = 0


def default_configs(
    requests: Sequence[ReplayRequest], *, page_size: int, storage_url: str | None = None
) -> list[TierConfig]:
    """The main job's default comparison over `requests`: device only, + host, + host and
    storage. The device holds `DEFAULT_DEVICE_SHARE` of the distinct pages (at least the longest
    request); storage prefetches whatever it holds beyond the host (threshold one page)."""
    if page_size < 1:
        raise ReplayOptionError(f"page_size must be >= 1, got {page_size}")
    distinct = _distinct_pages(requests, page_size=page_size)
    longest = max((-(-r.num_tokens // page_size) for r in requests), default=1)
    device = max(int(distinct * DEFAULT_DEVICE_SHARE), longest, 1) * page_size
    storage = storage_url or f"memory://?capacity_bytes={DEFAULT_STORAGE_BYTES}"
    return [
        TierConfig(name="device", capacity_tokens=device, prefetch_threshold=page_size),
        TierConfig(
            name="device+host",
            capacity_tokens=device,
            host_ratio=DEFAULT_HOST_RATIO,
            prefetch_threshold=page_size,
        ),
        TierConfig(
            name="device+host+storage",
            capacity_tokens=device,
            host_ratio=DEFAULT_HOST_RATIO,
            storage_url=storage,
            prefetch_threshold=page_size,
        ),
    ]


def _distinct_pages(requests: Sequence[ReplayRequest], *, page_size: int) -> int:
    """Whole pages the workload's prompts share out: distinct page-aligned prefixes."""
    seen: set[int] = set()
    for request in requests:
        tokens = request.token_ids
        prefix_hash = 0
        for end in range(page_size, len(tokens) + 1, page_size):
            prefix_hash = hash((prefix_hash, tokens[end - page_size : end].tobytes()))
            seen.add(prefix_hash)
    return len(seen)


def run_configuration(
    config: TierConfig,
    requests: Sequence[ReplayRequest],
    *,
    family: str,
    policy: str,
    page_size: int,
    device: str = "cpu",
    verify: bool = False,
    registry: CollectorRegistry | None = None,
    sample_every: int = 16,
    on_progress: Callable[[int, ReplayEngine], None] | None = None,
    model: ModelBuild | None = None,
) -> ConfigRun:
    """Build `config`'s memory system, replay `requests` through it and return the result.

    With `registry`, every layer's collectors are registered on it under `config=<name>` for
    the rest of the process. With `model`, the system is built from the model's spec and
    budget (`ModelBuild.build`: `family`, `page_size` and the capacity of `config` are then the
    plan's; its host and storage options still apply). Raises what the builders raise
    (BuildError, HostPoolError, StorageError, ReplayError) before any request runs;
    KVMismatch under `verify`."""
    if sample_every < 1:
        raise ReplayOptionError(f"sample_every must be >= 1, got {sample_every}")
    if model is not None:
        built, tiers = model.build(policy=policy, device=device, tiers=config)
        system = built.system
    else:
        system = _build_system(
            config, requests, family=family, policy=policy, page_size=page_size, device=device
        )
        tiers = _build_tiers(config, system)
    samples: list[Sample] = []
    try:
        engine = ReplayEngine(system, verify=verify, tiers=tiers)
        engine.check_fits(requests)
        collectors = replay_collectors(engine, system, tiers)
        if registry is not None:
            registry.register(ConfigCollector(collectors, {"config": config.name}))

        def progress(done: int) -> None:
            samples.append(_sample(done, engine, system, tiers))
            if on_progress is not None:
                on_progress(done, engine)

        started = time.perf_counter()
        engine.run(requests, on_progress=progress, progress_every=sample_every)
        wall_seconds = time.perf_counter() - started
    finally:
        if tiers is not None:
            tiers.close()
    # After close: the transfers still in flight at the last request (drained by close) count
    # in the bytes moved, as they do in the collectors' counters.
    stats = engine.stats()
    if tiers is not None:
        tiers.check_integrity()
    else:
        system.check_integrity()
    return ConfigRun(
        config=config,
        stats=stats,
        samples=samples,
        capacity_tokens=system.capacity_tokens,
        host_tokens=None if tiers is None else tiers.host_tokens,
        host_state_slots=None if tiers is None else tiers.host_state_slots,
        host_swa_tokens=None if tiers is None else tiers.host_swa_tokens,
        wall_seconds=wall_seconds,
        device=str(system.device),
        collectors=collectors,
        family=system.family,
        model=None if model is None else model.spec.architecture,
        page_size=system.page_size,
    )


def _build_system(
    config: TierConfig,
    requests: Sequence[ReplayRequest],
    *,
    family: str,
    policy: str,
    page_size: int,
    device: str,
) -> MemorySystem:
    build = partial(
        build_memory_system, family=family, page_size=page_size, policy=policy, device=device
    )
    if config.capacity_tokens is None:
        # Room for everything, in every pool: SWA as large as full, a state slot per chunk.
        room = unbounded_capacity(requests, page_size=page_size)
        return build(
            capacity_tokens=room.capacity_tokens, swa_ratio=1.0, mamba_slots=room.mamba_slots
        )
    return build(capacity_tokens=config.capacity_tokens)


def _build_tiers(config: TierConfig, system: MemorySystem) -> TieredSystem | None:
    """The host (and storage) tier of `config`, or None. ReplayError for bad tier parameters,
    BuildError for bad combinations, before anything is allocated."""
    if not config.tiered:
        return None
    return build_tiers(
        system,
        host_ratio=config.host_ratio,
        host_bytes=config.host_bytes,
        storage_url=config.storage_url,
        params=tier_params(config),
    )


def _sample(
    done: int, engine: ReplayEngine, system: MemorySystem, tiers: TieredSystem | None
) -> Sample:
    counters = engine.counters
    if tiers is None:
        hits = {"device": counters.hit_tokens}
    else:
        hits = {
            "device": counters.device_hit_tokens,
            "host": counters.host_hit_tokens,
            "storage": counters.storage_hit_tokens,
        }
    usage = system.kv_allocator.usage()[0]  # the full-attention (or only) KV pool
    used: dict[str, float | None] = {
        "device": usage.used_slots / usage.capacity_slots if usage.capacity_slots else 0.0,
        "host": None,
        "storage": None,
    }
    if tiers is not None:
        host = tiers.cache.host_allocator
        used["host"] = (host.size - host.available_size()) / host.size if host.size else 0.0
        if tiers.storage is not None:
            stored = tiers.storage.stats()
            cap = stored.capacity_bytes
            used["storage"] = stored.used_bytes / cap if cap else 0.0
    return Sample(
        requests=done, prompt_tokens=counters.prompt_tokens, hit_tokens=hits, used_share=used
    )
