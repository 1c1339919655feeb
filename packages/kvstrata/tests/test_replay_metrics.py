"""`ReplayCollector` reads the engine's counters at scrape time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from kvstrata.build import build_memory_system
from kvstrata.replay import ReplayCollector, ReplayEngine, WorkloadSpec, generate_workload

SPEC = WorkloadSpec(num_system_prompts=2, num_conversations=6, turns_per_conversation=(2, 3))


def test_collector_reports_the_counters_at_scrape_time() -> None:
    requests = generate_workload(SPEC)
    system = build_memory_system(family="mha", capacity_tokens=2048, page_size=16)
    engine = ReplayEngine(system)
    registry = CollectorRegistry()
    registry.register(ReplayCollector(engine, labels={"family": "mha"}))

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"family": "mha", **labels})

    assert value("kvstrata_replay_requests_total") == 0
    stats = engine.run(requests)
    assert value("kvstrata_replay_requests_total") == stats.requests == len(requests)
    assert value("kvstrata_replay_prompt_tokens_total") == stats.prompt_tokens
    # Without tiers every hit is a device hit; no host or storage series.
    assert value("kvstrata_replay_hit_tokens_total", tier="device") == stats.hit_tokens
    assert value("kvstrata_replay_hit_tokens_total", tier="host") is None
    assert value("kvstrata_replay_computed_tokens_total") == stats.computed_tokens
    assert value("kvstrata_replay_evicted_tokens_total") == stats.evicted_tokens > 0
    assert value("kvstrata_replay_evict_calls_total") == engine.counters.evict_calls > 0
    assert value("kvstrata_replay_seconds_total", phase="cache") == stats.cache_seconds
    assert value("kvstrata_replay_seconds_total", phase="forward") == stats.kv_write_seconds
    assert b"kvstrata_replay_hit_tokens_total" in generate_latest(registry)


def test_nothing_is_registered_globally() -> None:
    from prometheus_client import REGISTRY

    before = set(REGISTRY._names_to_collectors)
    ReplayCollector(ReplayEngine(build_memory_system(family="mha", capacity_tokens=64)))
    assert set(REGISTRY._names_to_collectors) == before
