"""Which node is a page's home: rendezvous (highest random weight) hashing of the page key over
the alive stores. Every client computes the same home from the same set of stores, and when a
store joins or leaves only the keys whose highest score it holds move (about 1/N of them)."""

from __future__ import annotations

from collections.abc import Sequence

import xxhash


def home(key: bytes, nodes: Sequence[str]) -> str | None:
    """The node with the highest xxh3_64(node id || key); None when there is no node."""
    best: str | None = None
    best_score = -1
    for node in nodes:
        score = xxhash.xxh3_64_intdigest(key, seed=xxhash.xxh3_64_intdigest(node.encode()))
        if score > best_score or (score == best_score and best is not None and node < best):
            best, best_score = node, score
    return best


def group_by_home(keys: Sequence[bytes], nodes: Sequence[str]) -> dict[str, list[int]]:
    """Positions of `keys` per home node (nodes without keys are left out)."""
    groups: dict[str, list[int]] = {}
    for i, key in enumerate(keys):
        node = home(key, nodes)
        if node is not None:
            groups.setdefault(node, []).append(i)
    return groups
