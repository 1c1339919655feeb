"""The one walk down a radix tree: every match, insert, host-tier walk and read-only path query
descends with `descend`, so the child lookup, the page comparison and the split where a match
ends inside a node are written once.

Positions are byte offsets into the key's int64 token bytes (see tree.py). The root's children
are keyed by `(namespace, first page bytes)`, every other node's by its first page bytes.

Callers choose what happens per node: the Full-only fast paths pass no callback and run their
few attribute writes over the returned path (no call per node); the hybrid and hierarchical
inserts pass `visit`, called in the walk before it looks up the next child (a hook may change
the node it visits, e.g. revive it or split it at an SWA window boundary).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvstrata.unified_radix_cache.key import TOKEN_BYTES

if TYPE_CHECKING:
    from kvstrata.unified_radix_cache.key import Namespace
    from kvstrata.unified_radix_cache.node import TreeNode

#: Splits a node after its first `num_tokens` tokens and returns the new upper node.
SplitFn = Callable[["TreeNode", int], "TreeNode"]
#: Called on each matched node with the byte position where that node starts in the key.
VisitFn = Callable[["TreeNode", int], None]


def common_bytes(ck: bytes, data: bytes, pos: int, end: int, page_bytes: int) -> int:
    """Bytes (whole pages, >= 1 page) of node key `ck` equal to `data[pos:end]`, knowing the
    first page is equal. Binary search over pages: O(log pages) memcmps."""
    limit = min(len(ck), end - pos)
    if data.startswith(ck[:limit], pos):
        return limit
    lo, hi = 1, limit // page_bytes  # lo pages equal, hi pages not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if data.startswith(ck[: mid * page_bytes], pos):
            lo = mid
        else:
            hi = mid
    return lo * page_bytes


def descend(
    root: TreeNode,
    page_bytes: int,
    namespace: Namespace | None,
    data: bytes,
    end: int,
    split: SplitFn | None,
    visit: VisitFn | None = None,
) -> tuple[list[TreeNode], int, int]:
    """Walk `data[:end]` (whole pages) down from `root`.

    Returns `(path, pos, partial)`: the matched nodes root-side first (the root excluded), the
    bytes they cover, and the bytes of the next child that also match. With `split`, a match
    ending inside a node splits it there (the upper part joins the path) and `partial` is 0;
    without, nothing changes and the partly matched child stays off the path. `visit(node,
    start)` runs on each path node as it is reached. O(K) bytes compared + O(depth) lookups."""
    path: list[TreeNode] = []
    pos = 0
    child = root.children.get((namespace, data[:page_bytes]))
    while child is not None:
        ck = child.key
        step = len(ck)
        if pos + step <= end and data.startswith(ck, pos):
            node = child
        else:
            step = common_bytes(ck, data, pos, end, page_bytes)
            if split is None:
                return path, pos, step
            node = split(child, step // TOKEN_BYTES)
        path.append(node)
        if visit is not None:
            visit(node, pos)
        pos += step
        if pos >= end or node is not child:
            break
        child = node.children.get(data[pos : pos + page_bytes])
    return path, pos, 0
