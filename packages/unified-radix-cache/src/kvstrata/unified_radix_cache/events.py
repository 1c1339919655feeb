"""KV events: what the tree tells a cluster-wide prefix index about its pages.

`BlockStored` when pages become shareable on a tier, `BlockRemoved` when they leave it,
`AllBlocksCleared` on reset. The tree only queues them; the owner drains the queue with
`take_events()` and ships batches encoded by `encode_events` (msgpack with a format version).
Page keys are the chained keys of `kvstrata.storage.PageKeyer`, so every instance and the
storage tier name the same prefix identically.

SWA tombstones emit nothing: the pages stay on the device (full KV) and a later match through
them is still possible once a live window follows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

import msgpack

from kvstrata.storage.keys import PageKeyer
from kvstrata.unified_radix_cache.errors import EventDecodeError
from kvstrata.unified_radix_cache.key import Namespace
from kvstrata.unified_radix_cache.key_chain import chain_of

if TYPE_CHECKING:
    from kvstrata.unified_radix_cache.node import TreeNode
    from kvstrata.unified_radix_cache.tree_view import PagedTree

#: Bumped on any change of the wire layout below; decoders refuse other versions.
EVENT_FORMAT_VERSION = 1
DEVICE_TIER = "device"


@dataclass(frozen=True, kw_only=True)
class BlockStored:
    """Pages became shareable on `tier`: `page_keys` in prefix order, chained from
    `parent_key` (None when the run starts at the root), each `tokens_per_page` tokens."""

    page_keys: tuple[bytes, ...]
    parent_key: bytes | None
    tokens_per_page: int
    tier: str = DEVICE_TIER
    namespace: Namespace | None = None


@dataclass(frozen=True, kw_only=True)
class BlockRemoved:
    """Pages left `tier`."""

    page_keys: tuple[bytes, ...]
    tier: str = DEVICE_TIER


@dataclass(frozen=True, kw_only=True)
class AllBlocksCleared:
    """Every page of this instance left `tier` (None: every tier)."""

    tier: str | None = None


KVEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


def encode_events(events: list[KVEvent]) -> bytes:
    """A msgpack batch: `{"v": version, "events": [[kind, ...fields], ...]}`."""
    rows: list[list[object]] = []
    for event in events:
        if isinstance(event, BlockStored):
            ns = None if event.namespace is None else list(event.namespace)
            rows.append(
                [
                    "stored",
                    list(event.page_keys),
                    event.parent_key,
                    event.tokens_per_page,
                    event.tier,
                    ns,
                ]
            )
        elif isinstance(event, BlockRemoved):
            rows.append(["removed", list(event.page_keys), event.tier])
        else:
            rows.append(["cleared", event.tier])
    packed = msgpack.packb({"v": EVENT_FORMAT_VERSION, "events": rows}, use_bin_type=True)
    assert isinstance(packed, bytes), "msgpack.packb without a stream returns bytes"
    return packed


def decode_events(data: bytes) -> list[KVEvent]:
    """Inverse of `encode_events`. Raises EventDecodeError for other versions or bad bytes."""
    try:
        batch = msgpack.unpackb(data, raw=False)
    except (msgpack.UnpackException, ValueError) as exc:
        raise EventDecodeError(f"not a msgpack event batch: {exc}") from exc
    if not isinstance(batch, dict) or "v" not in batch or "events" not in batch:
        raise EventDecodeError("event batch lacks its version or events")
    if batch["v"] != EVENT_FORMAT_VERSION:
        raise EventDecodeError(
            f"event format version {batch['v']}; this reader knows {EVENT_FORMAT_VERSION}"
        )
    out: list[KVEvent] = []
    try:
        for row in batch["events"]:
            kind = row[0]
            if kind == "stored":
                ns = None if row[5] is None else Namespace(row[5][0], row[5][1])
                out.append(
                    BlockStored(
                        page_keys=tuple(row[1]),
                        parent_key=row[2],
                        tokens_per_page=row[3],
                        tier=row[4],
                        namespace=ns,
                    )
                )
            elif kind == "removed":
                out.append(BlockRemoved(page_keys=tuple(row[1]), tier=row[2]))
            elif kind == "cleared":
                out.append(AllBlocksCleared(tier=row[1]))
            else:
                raise EventDecodeError(f"unknown event kind {kind!r}")
    except (IndexError, TypeError) as exc:
        raise EventDecodeError(f"malformed event row: {exc}") from exc
    return out


class EventLog:
    """The tree's event queue and its page-key cache logic (only built when events are on, so
    a device-only tree with events off never hashes a page)."""

    def __init__(self, keyer: PageKeyer) -> None:
        self.keyer = keyer
        # `keyer.chain`, compiled where it can be (key_chain.py): every backup hashes its
        # new pages here.
        self._chain = chain_of(keyer)
        self._queue: list[KVEvent] = []

    def page_keys(self, tree: PagedTree, node: TreeNode) -> list[bytes]:
        """Keys of `node`'s pages, computing (and caching) any missing ones on the path, root
        side first, each run continuing from its parent's last key."""
        if node.page_keys is not None:
            return node.page_keys
        missing: list[TreeNode] = []
        probe: TreeNode | None = node
        while probe is not None and probe.parent is not None and probe.page_keys is None:
            missing.append(probe)
            probe = probe.parent
        keyer = self.keyer
        for item in reversed(missing):
            parent = item.parent
            assert parent is not None
            if parent.page_keys:
                parent_key = parent.page_keys[-1]
            else:  # the chain starts here: the seed of the node's namespace
                ns = item.namespace
                parent_key = keyer.seed(
                    extra_key=None if ns is None else ns.extra_key,
                    cache_salt=None if ns is None else ns.cache_salt,
                )
            # Unchecked hashing (`PageKeyer.chain`): a node's key is the native int64 bytes of
            # ids validated when they entered the tree, and the parent key is this keyer's.
            item.page_keys = self._chain(item.key, parent_key)
        assert node.page_keys is not None
        return node.page_keys

    def prefix_keys(self, tree: PagedTree, node: TreeNode, first: int = 0) -> list[bytes]:
        """Keys of the pages of the prefix ending at `node` from its page `first` on, root
        first (cached per node, as `page_keys`). Joins only the nodes that hold those pages:
        a backup of the last few pages of a long prefix costs O(nodes on the path + pages
        asked for), not O(pages of the prefix)."""
        path: list[TreeNode] = []
        num_tokens = 0
        probe = node
        while probe.parent is not None:
            path.append(probe)
            num_tokens += probe.num_tokens
            probe = probe.parent
        need = num_tokens // tree.page_size - first
        if need <= 0:
            return []
        parts: list[list[bytes]] = []
        got = 0
        for item in path:  # deepest first; the first call hashes whatever the path lacks
            keys = self.page_keys(tree, item)
            parts.append(keys)
            got += len(keys)
            if got >= need:
                break
        if len(parts) == 1:
            return parts[0][got - need :] if got > need else list(parts[0])
        joined = [key for part in reversed(parts) for key in part]
        return joined[got - need :] if got > need else joined

    def stored(self, tree: PagedTree, node: TreeNode) -> None:
        keys = self.page_keys(tree, node)
        parent = node.parent
        parent_key = parent.page_keys[-1] if parent is not None and parent.page_keys else None
        self._queue.append(
            BlockStored(
                page_keys=tuple(keys),
                parent_key=parent_key,
                tokens_per_page=tree.page_size,
                namespace=node.namespace,
            )
        )

    def removed(self, tree: PagedTree, node: TreeNode) -> None:
        self._queue.append(BlockRemoved(page_keys=tuple(self.page_keys(tree, node))))

    def removed_keys(self, keys: list[bytes]) -> None:
        if keys:
            self._queue.append(BlockRemoved(page_keys=tuple(keys)))

    def cleared(self) -> None:
        self._queue.append(AllBlocksCleared(tier=DEVICE_TIER))

    @property
    def queue(self) -> list[KVEvent]:
        """The queued events, not drained (`evict` truncates it back when it rolls back)."""
        return self._queue

    def drain(self) -> list[KVEvent]:
        out = self._queue
        self._queue = []
        return out
