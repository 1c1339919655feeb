"""Read-only walks over a `UnifiedRadixCache` for the hierarchical mode: the key of a node,
how much of a key a tree holds, the node ending exactly at a key.

Unlike `match_prefix` they change nothing: no access time, hit count, counter or split, so the
cache can ask one tier about another's prefix without disturbing its eviction order.
"""

from __future__ import annotations

import numpy as np

from kvstrata.unified_radix_cache.errors import ForeignNode
from kvstrata.unified_radix_cache.key import TOKEN_BYTES, RadixKey
from kvstrata.unified_radix_cache.node import TreeNode
from kvstrata.unified_radix_cache.tree import UnifiedRadixCache
from kvstrata.unified_radix_cache.walk import descend


def key_of(tree: UnifiedRadixCache, node: TreeNode) -> RadixKey:
    """The key (tokens and namespace) of the prefix ending at `node`. O(depth + K).
    Raises ForeignNode when `node` is not in `tree` (e.g. evicted since it was returned)."""
    parts: list[bytes] = []
    probe = node
    while probe.parent is not None:
        parts.append(probe.key)
        probe = probe.parent
    if probe is not tree.root:
        raise ForeignNode(f"node {node.id} is not in this tree")
    data = b"".join(reversed(parts))
    tokens = np.frombuffer(data, dtype=np.int64)
    ns = node.namespace
    key = RadixKey(tokens) if ns is None else RadixKey(tokens, ns.extra_key, ns.cache_salt)
    key.cached_bytes = data  # the walk's bytes: no conversion when the key is walked again
    return key


def held_len(tree: UnifiedRadixCache, key: RadixKey) -> int:
    """How many leading tokens of `key` `tree` holds, in whole pages. O(K)."""
    data = key.token_bytes()
    page_bytes = tree.page_size * TOKEN_BYTES
    end = len(data) - len(data) % page_bytes
    _, pos, partial = descend(tree.root, page_bytes, key.namespace, data, end, None)
    return (pos + partial) // TOKEN_BYTES


def node_at(tree: UnifiedRadixCache, key: RadixKey) -> TreeNode | None:
    """The node of `tree` ending exactly at the end of `key` (None when none ends there, or
    for an empty key). O(K)."""
    data = key.token_bytes()
    page_bytes = tree.page_size * TOKEN_BYTES
    if len(data) % page_bytes:
        return None  # nodes hold whole pages: none ends inside one
    path, pos, _ = descend(tree.root, page_bytes, key.namespace, data, len(data), None)
    return path[-1] if path and pos == len(data) else None
