"""A dump of one instance's tree as kvstrata events: what the index rebuilds an instance from
after a gap in its event sequence, or after a shard restarts.

The dump is one `BlockStored` per device node, parents before children, so applying it to an
empty index gives exactly the keys the tree holds on the device; the keys come from the tree's
own keyer (cached on the nodes), so they equal the keys its live events carried.
"""

from __future__ import annotations

from kvstrata.unified_radix_cache import BlockStored, KVEvent, UnifiedRadixCache


def dump_tree(tree: UnifiedRadixCache) -> list[KVEvent]:
    """`BlockStored` events covering every page the tree holds on the device. O(nodes + pages);
    computes (and caches on the nodes) any page key not computed yet. Raises the tree's
    InvalidConfig when the tree was built without events (it has no keyer)."""
    out: list[KVEvent] = []
    for node in tree.iter_nodes():
        value = node.value
        if value is None or len(value) == 0:
            continue
        keys = tree.page_keys(node)
        parent = node.parent
        parent_key = parent.page_keys[-1] if parent is not None and parent.page_keys else None
        out.append(
            BlockStored(
                page_keys=tuple(keys),
                parent_key=parent_key,
                tokens_per_page=tree.page_size,
                namespace=node.namespace,
            )
        )
    return out
