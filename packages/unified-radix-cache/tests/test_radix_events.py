"""BEHAVIOURS.md 5, 15: chained page keys and KV events."""

from __future__ import annotations

import json
import subprocess
import sys

import msgpack
import pytest

from kvstrata.storage.keys import PageKeyer
from kvstrata.testkit.trees import make_tree
from kvstrata.unified_radix_cache import (
    EVENT_FORMAT_VERSION,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EvictRequest,
    Namespace,
    RadixKey,
    decode_events,
    encode_events,
)
from kvstrata.unified_radix_cache.errors import EventDecodeError, InvalidConfig


def test_block_stored_carries_chained_keys_parent_and_namespace(family: str) -> None:
    kit = make_tree(family, page_size=2, enable_events=True)
    tree = kit.tree
    keyer = PageKeyer(page_size=2)
    kit.put(list(range(8)))
    (stored,) = tree.take_events()
    assert stored == BlockStored(
        page_keys=tuple(keyer.page_keys(list(range(8)))), parent_key=None, tokens_per_page=2
    )
    kit.put([0, 1, 2, 3, 9, 9, 9, 9])  # splits after page 2: no event for the split
    (stored,) = tree.take_events()
    chain = keyer.page_keys([0, 1, 2, 3, 9, 9, 9, 9])
    assert stored.page_keys == tuple(chain[2:]) and stored.parent_key == chain[1]
    assert tree.take_events() == []  # drained
    kit.put([5, 5], extra_key="lora")
    (stored,) = tree.take_events()
    assert isinstance(stored, BlockStored)
    assert stored.namespace == Namespace("lora", None)
    assert stored.page_keys == tuple(keyer.page_keys([5, 5], extra_key="lora"))
    assert stored.page_keys != tuple(keyer.page_keys([5, 5]))
    kit.check()


def test_block_removed_on_eviction_page_granular_and_cleared_on_reset() -> None:
    kit = make_tree("full", page_size=2, enable_events=True)
    tree = kit.tree
    keyer = PageKeyer(page_size=2)
    chain = keyer.page_keys(list(range(8)))
    kit.put(list(range(8)))
    tree.take_events()
    tree.evict(EvictRequest.full(3))  # two tail pages
    assert tree.take_events() == [BlockRemoved(page_keys=tuple(chain[2:]))]
    kit.put([0, 1, 7, 7])
    tree.take_events()
    tree.evict(EvictRequest.full(2))  # the older leaf: pages 1 (tokens 2, 3)
    assert tree.take_events() == [BlockRemoved(page_keys=(chain[1],))]
    tree.reset()
    assert tree.take_events() == [AllBlocksCleared(tier="device")]
    kit.check()


def test_events_off_computes_no_page_key() -> None:
    kit = make_tree("full", page_size=2)
    kit.put(list(range(8)))
    kit.put([0, 1, 5, 5])
    assert all(node.page_keys is None for node in kit.tree.iter_nodes())
    assert kit.tree.take_events() == []
    with pytest.raises(InvalidConfig):
        kit.tree.page_keys(kit.tree.iter_nodes()[0])


def test_page_keys_are_computed_lazily_and_split_with_the_node() -> None:
    kit = make_tree("full", page_size=1, enable_events=True)
    tree = kit.tree
    kit.put([1, 2, 3, 4])
    node = tree.iter_nodes()[0]
    keys = list(tree.page_keys(node))
    tree.match_prefix(RadixKey([1, 2, 9]))  # split after 2 tokens
    upper = tree.match_prefix(RadixKey([1, 2])).last_node
    assert upper.page_keys == keys[:2] and node.page_keys == keys[2:]


def test_same_tokens_after_a_different_prefix_get_different_keys() -> None:
    kit = make_tree("full", page_size=2, enable_events=True)
    tree = kit.tree
    kit.put([1, 1, 5, 5])
    kit.put([2, 2, 5, 5])
    stored = [e for e in tree.take_events() if isinstance(e, BlockStored)]
    assert stored[0].page_keys[1] != stored[1].page_keys[1]


def test_page_keys_are_identical_in_another_process() -> None:
    kit = make_tree("full", page_size=4, enable_events=True)
    tokens = list(range(100, 116))
    kit.put(tokens)
    (stored,) = kit.tree.take_events()
    code = (
        "import json, sys; from kvstrata.storage.keys import PageKeyer; "
        "keys = PageKeyer(page_size=4).page_keys(json.loads(sys.argv[1])); "
        "print(json.dumps([k.hex() for k in keys]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(tokens)], capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout) == [k.hex() for k in stored.page_keys]


def test_msgpack_round_trip_and_version() -> None:
    events = [
        BlockStored(page_keys=(b"a" * 32, b"b" * 32), parent_key=None, tokens_per_page=16),
        BlockStored(
            page_keys=(b"c" * 32,),
            parent_key=b"b" * 32,
            tokens_per_page=16,
            namespace=Namespace("lora", "salt"),
        ),
        BlockRemoved(page_keys=(b"a" * 32,)),
        AllBlocksCleared(tier="device"),
    ]
    data = encode_events(events)
    assert msgpack.unpackb(data)["v"] == EVENT_FORMAT_VERSION
    assert decode_events(data) == events
    with pytest.raises(EventDecodeError):
        decode_events(msgpack.packb({"v": EVENT_FORMAT_VERSION + 1, "events": []}))
    with pytest.raises(EventDecodeError):
        decode_events(b"\xc1not msgpack")
    with pytest.raises(EventDecodeError):
        decode_events(msgpack.packb({"v": EVENT_FORMAT_VERSION, "events": [["bogus"]]}))


def test_prefix_keys_from_a_page_on_are_the_tail_of_the_whole_chain() -> None:
    """`EventLog.prefix_keys(tree, node, first)`, what a backup joins: the keys of pages
    `first`.. of the prefix ending at `node`, across the nodes of a split path."""
    kit = make_tree("full", page_size=2, enable_events=True)
    tree = kit.tree
    keyer = PageKeyer(page_size=2)
    kit.put(list(range(12)))
    kit.put([*range(4), 9, 9, 9, 9])  # splits the path after page 2
    kit.put([*range(8), 7, 7])  # and after page 4
    log = tree._events
    assert log is not None
    for tokens in ([*range(8), 7, 7], [*range(4), 9, 9, 9, 9], list(range(12))):
        node = tree.match_prefix(RadixKey(tokens)).last_node
        chain = keyer.page_keys(tokens)
        for first in range(len(chain) + 2):
            assert log.prefix_keys(tree, node, first) == chain[first:]
    kit.check()
