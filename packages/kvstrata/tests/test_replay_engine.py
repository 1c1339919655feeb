"""End-to-end replays through the real allocators, pools and tree, for every model family."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kvstrata.build import MemorySystem, build_memory_system
from kvstrata.replay import (
    CapacityTooSmall,
    KVMismatch,
    ReplayEngine,
    ReplayOptionError,
    ReplayRequest,
    WorkloadSpec,
    generate_workload,
    read_trace,
    unbounded_capacity,
)
from kvstrata.testkit import WORKSPACE_ROOT
from kvstrata.unified_radix_cache import RadixKey

FAMILIES = ("mha", "swa", "mamba")
PAGE = 16
SHARED_TRACE = WORKSPACE_ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
SMALL = WorkloadSpec(
    num_system_prompts=3,
    system_prompt_tokens=(40, 120),
    num_conversations=24,
    turns_per_conversation=(1, 5),
    user_turn_tokens=(5, 40),
    assistant_turn_tokens=(5, 60),
    seed=11,
)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _unbounded(family: str, requests: list[ReplayRequest], page_size: int = PAGE) -> MemorySystem:
    room = unbounded_capacity(requests, page_size=page_size)
    return build_memory_system(
        family=family,
        capacity_tokens=room.capacity_tokens,
        page_size=page_size,
        swa_ratio=1.0,
        mamba_slots=room.mamba_slots,
    )


def _usable(request: ReplayRequest, page_size: int = PAGE) -> int:
    return (request.num_tokens - 1) // page_size * page_size


def _assert_all_free(system: MemorySystem) -> None:
    assert system.tree.total_size("full") == 0
    swa = system.swa_allocator
    if swa is not None:
        assert swa.full_available_size() == system.capacity_tokens
        assert swa.swa_available_size() == swa.swa_size
    else:
        assert system.kv_allocator.available_size() == system.capacity_tokens
    if system.mamba_allocator is not None:
        assert system.mamba_allocator.available_size() == system.mamba_allocator.size


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_default_workload_replays_consistently(family: str) -> None:
    requests = generate_workload()
    system = _unbounded(family, requests)
    first = ReplayEngine(system).run(requests)
    assert first.requests == len(requests)
    assert first.prompt_tokens == sum(r.num_tokens for r in requests)
    assert 0 < first.hit_tokens <= first.prompt_tokens
    assert first.hit_tokens + first.computed_tokens == first.prompt_tokens
    assert first.evicted_tokens == 0
    system.check_integrity()

    # Second pass, unbounded: every prompt is cached, so each one reuses all of it but the last
    # token, rounded down to a page -- and every hit reads back (verify) what was written for
    # exactly those tokens, Mamba states included.
    engine = ReplayEngine(system, verify=True)
    for request in requests:
        result = engine.step(request)
        assert result.hit_tokens == _usable(request), (request.num_tokens, result)
    second = engine.stats()
    assert second.hit_tokens == sum(_usable(r) for r in requests)
    assert second.evicted_tokens == 0
    system.check_integrity()

    system.reset()
    system.check_integrity()
    _assert_all_free(system)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("policy", ["lru", "lfu", "fifo", "mru", "filo", "priority"])
def test_bounded_replay_evicts_and_stays_consistent(family: str, policy: str) -> None:
    requests = generate_workload(SMALL)
    longest = max(r.num_tokens for r in requests)
    # Room for the longest prompt in the SWA pool too (80 % of the full one), little more.
    capacity = -(-longest // PAGE) * PAGE * 3 // 2
    system = build_memory_system(
        family=family, capacity_tokens=capacity, page_size=PAGE, policy=policy, mamba_slots=6
    )
    engine = ReplayEngine(system, verify=True)
    engine.check_fits(requests)
    for request in requests:
        result = engine.step(request)
        assert result.hit_tokens <= _usable(request)
        assert system.tree.num_locked == 0
        system.check_integrity()
    stats = engine.stats()
    assert stats.evicted_tokens > 0
    assert stats.hit_tokens + stats.computed_tokens == stats.prompt_tokens
    assert system.tree.total_size("full") <= system.capacity_tokens
    system.reset()
    _assert_all_free(system)


def test_bounded_hits_less_than_unbounded() -> None:
    requests = generate_workload(SMALL)
    unbounded = ReplayEngine(_unbounded("mha", requests)).run(requests)
    tight = build_memory_system(family="mha", capacity_tokens=1024, page_size=PAGE)
    bounded = ReplayEngine(tight).run(requests)
    assert bounded.evicted_tokens > 0
    assert bounded.hit_tokens < unbounded.hit_tokens


def test_swa_pool_pressure_leaves_tombstones_and_fewer_hits() -> None:
    # An SWA pool half the size of the full pool runs out first: the tree frees SWA slots of
    # internal nodes (tombstones), and a match needs a whole live window behind its end.
    requests = generate_workload(SMALL)
    full = build_memory_system(family="swa", capacity_tokens=4096, page_size=PAGE, swa_ratio=1.0)
    half = build_memory_system(family="swa", capacity_tokens=4096, page_size=PAGE, swa_ratio=0.5)
    assert half.swa_allocator is not None and half.swa_allocator.swa_size == 2048
    wide = ReplayEngine(full, verify=True).run(requests)
    narrow_engine = ReplayEngine(half, verify=True)
    narrow = narrow_engine.run(requests)
    half.check_integrity()
    assert narrow.hit_tokens < wide.hit_tokens
    assert half.tree.component("swa").evicted_total > 0


def test_too_small_capacity_is_refused_before_any_request() -> None:
    requests = generate_workload(SMALL)
    system = build_memory_system(family="mha", capacity_tokens=64, page_size=PAGE)
    engine = ReplayEngine(system)
    with pytest.raises(CapacityTooSmall) as caught:
        engine.run(requests)
    assert caught.value.request_index == 0
    assert engine.counters.requests == 0
    _assert_all_free(system)


def test_swa_capacity_counts_the_smaller_pool() -> None:
    request = ReplayRequest(token_ids=np.arange(100, dtype=np.int64))
    system = build_memory_system(family="swa", capacity_tokens=128, page_size=PAGE, swa_ratio=0.5)
    with pytest.raises(CapacityTooSmall) as caught:
        ReplayEngine(system).check_fits([request])
    assert caught.value.capacity_tokens == 64


def test_verify_refuses_inexact_dtypes() -> None:
    from kvstrata.build import MHAModel

    model = MHAModel(dtype=torch.bfloat16)
    system = build_memory_system(family="mha", capacity_tokens=256, page_size=PAGE, model=model)
    with pytest.raises(ReplayOptionError):
        ReplayEngine(system, verify=True)
    ReplayEngine(system)  # without verify any dtype is fine


def test_progress_is_reported_and_ends_at_the_total() -> None:
    requests = generate_workload(SMALL)
    seen: list[int] = []
    ReplayEngine(_unbounded("mha", requests)).run(
        requests, on_progress=seen.append, progress_every=10
    )
    assert seen == [*range(10, len(requests) + 1, 10), len(requests)]
    with pytest.raises(ReplayOptionError):
        ReplayEngine(_unbounded("mha", requests)).run(requests, progress_every=0)


def test_short_prompts_store_nothing_and_leak_nothing() -> None:
    # Prompts shorter than a page have no whole page to cache.
    requests = [ReplayRequest(token_ids=np.arange(n, dtype=np.int64)) for n in (1, 5, 15, 16, 17)]
    for family in FAMILIES:
        system = _unbounded(family, requests)
        engine = ReplayEngine(system, verify=True)
        results = [engine.step(r) for r in requests]
        # 16 and 17 tokens: the 16-token prompt stores one page, which 17 then reuses.
        assert [r.hit_tokens for r in results] == [0, 0, 0, 0, 16]
        system.check_integrity()
        system.reset()
        _assert_all_free(system)


def _trace_hash_ids(limit: int) -> list[list[int]]:
    with SHARED_TRACE.open(encoding="utf-8") as lines:
        return [json.loads(line)["hash_ids"] for _, line in zip(range(limit), lines, strict=False)]


class _Trie:
    """Prefixes of block-id chains, each marked when a Mamba state would be cached there."""

    def __init__(self) -> None:
        self.children: dict[int, _Trie] = {}
        self.state = False

    def add(self, ids: list[int]) -> None:
        node = self
        for i, block in enumerate(ids):
            node = node.children.setdefault(block, _Trie())
            if i >= len(ids) - 2:  # the prompt's end, and one block before it
                node.state = True


def _prefix_set_hits(traces: list[list[int]]) -> int:
    """Blocks reused under an unbounded cache: the longest run of leading blocks whose prefix
    an earlier request had, capped at all but the last block (an engine computes one token)."""
    seen = _Trie()
    hits = 0
    for ids in traces:
        node, matched = seen, 0
        while matched < len(ids) - 1 and ids[matched] in node.children:
            node = node.children[ids[matched]]
            matched += 1
        hits += matched
        seen.add(ids)
    return hits


def _state_point_hits(traces: list[list[int]]) -> int:
    """The same for a Mamba model: a match must end where a state was cached, which is at the
    end of an earlier prompt or one block before it (its two prefill chunks)."""
    seen = _Trie()
    hits = 0
    for ids in traces:
        node, best = seen, 0
        for depth in range(1, len(ids)):
            child = node.children.get(ids[depth - 1])
            if child is None:
                break
            node = child
            if node.state:
                best = depth
        hits += best
        seen.add(ids)
    return hits


@pytest.mark.slow
@pytest.mark.skipif(not SHARED_TRACE.is_file(), reason=f"no shared trace at {SHARED_TRACE}")
@pytest.mark.parametrize("family", FAMILIES)
def test_shared_trace_prefix_hits_match_an_independent_count(family: str) -> None:
    limit = 2000
    traces = _trace_hash_ids(limit)
    requests = read_trace(SHARED_TRACE, tokens_per_block=PAGE, limit=limit)
    stats = ReplayEngine(_unbounded(family, requests)).run(requests)
    expected_blocks = _state_point_hits(traces) if family == "mamba" else _prefix_set_hits(traces)
    assert stats.hit_tokens == expected_blocks * PAGE
    assert stats.prompt_tokens == sum(len(ids) for ids in traces) * PAGE


@pytest.mark.cuda
@pytest.mark.parametrize("family", FAMILIES)
def test_replay_on_cuda_matches_cpu(family: str) -> None:
    # The same requests give the same hits on either device, and the KV read back on the GPU
    # is what was written there.
    requests = generate_workload(SMALL)
    capacity = 4096
    results = {}
    for device in ("cpu", "cuda"):
        system = build_memory_system(
            family=family, capacity_tokens=capacity, page_size=PAGE, device=device, mamba_slots=8
        )
        assert system.device.type == device
        results[device] = ReplayEngine(system, verify=True).run(requests)
        system.check_integrity()
        system.reset()
        _assert_all_free(system)
    cpu, cuda = results["cpu"], results["cuda"]
    assert (cuda.hit_tokens, cuda.evicted_tokens) == (cpu.hit_tokens, cpu.evicted_tokens)


@pytest.mark.parametrize("family", FAMILIES)
def test_failed_allocation_gives_everything_back(family: str) -> None:
    # Without check_fits a request longer than the pool reaches the allocator; the engine must
    # abort it cleanly: no lock left, no slot lost.
    system = build_memory_system(family=family, capacity_tokens=128, page_size=PAGE, swa_ratio=1.0)
    engine = ReplayEngine(system)
    engine.step(ReplayRequest(token_ids=np.arange(64, dtype=np.int64)))
    with pytest.raises(CapacityTooSmall):
        engine.step(ReplayRequest(token_ids=np.arange(300, dtype=np.int64)))
    assert system.tree.num_locked == 0
    system.check_integrity()
    assert engine.counters.requests == 1
    system.reset()
    _assert_all_free(system)


def test_verify_catches_kv_overwritten_behind_the_trees_back() -> None:
    system = build_memory_system(family="mha", capacity_tokens=256, page_size=PAGE)
    engine = ReplayEngine(system, verify=True)
    prompt = np.arange(40, dtype=np.int64)
    engine.step(ReplayRequest(token_ids=prompt))
    # Corrupt the cached K of one token: the next hit on that prefix must notice.
    match = system.tree.match_prefix(RadixKey(prompt))
    system.layers.get_key_buffer(0)[match.device_indices[5]] = -1.0
    with pytest.raises(KVMismatch):
        engine.step(ReplayRequest(token_ids=prompt))
