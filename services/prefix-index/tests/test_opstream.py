"""The INDEXER_BENCH op stream: replaying it leaves the index holding exactly the simulated
instance's cache; the untimed replay, the bare-dict floor and the probe cost all measure."""

from __future__ import annotations

from array import array

from kvstrata.prefix_index import PrefixIndex
from kvstrata.prefix_index.native import native_core
from kvstrata.prefix_index.opstream import (
    bare_dict_floor,
    build_op_stream,
    dict_lookup_cost,
    native_floor,
    replay_ops,
    replay_untimed,
)
from kvstrata.unified_radix_cache import BlockRemoved, BlockStored


def _prompts() -> list[array]:
    # Shared heads, diverging tails, more pages than the instance holds: stores and evictions.
    return [array("q", [1, 2, 3] + [100 * r + i for i in range(6)]) for r in range(40)]


def test_replays_leave_the_instance_cache_in_the_index() -> None:
    stream = build_op_stream(_prompts(), capacity_pages=20)
    assert any(isinstance(e, BlockRemoved) for r in stream.requests for e in r.events)
    held: set[bytes] = set()
    for req in stream.requests:
        for event in req.events:
            if isinstance(event, BlockStored):
                held.update(event.page_keys)
            elif isinstance(event, BlockRemoved):
                held.difference_update(event.page_keys)
    for index in (PrefixIndex(1), PrefixIndex(1, max_entries=10_000)):
        timing = replay_ops(index, stream)
        assert timing.ops == stream.num_ops
        assert set(index.holdings("instance-0")) == held
        index.check_integrity()
    untimed = PrefixIndex(1)
    assert replay_untimed(untimed, stream) >= 0.0
    assert set(untimed.holdings("instance-0")) == held
    assert bare_dict_floor(stream) >= 0.0


def test_probe_cost_covers_both_dict_sizes() -> None:
    stream = build_op_stream(_prompts(), capacity_pages=20)
    cost = dict_lookup_cost(stream, probes=1000)
    stored = {
        k
        for r in stream.requests
        for e in r.events
        if isinstance(e, BlockStored)
        for k in e.page_keys
    }
    assert cost.large_entries == len(stored) and cost.small_entries == min(256, len(stored))
    assert cost.small_ns > 0 and cost.large_ns > 0


def test_native_floor_makes_one_call_per_op_or_says_there_is_no_core() -> None:
    stream = build_op_stream(_prompts(), capacity_pages=20)
    got = native_floor(stream)
    if native_core(32, {"device": 1}, None) is None:
        assert got is None
    else:
        assert got is not None
        assert got[0] == stream.num_ops and got[1] >= 0.0
