"""Locks with receipts for `UnifiedRadixCache`: `lock` asks every component to protect what a
request at a node needs and records the boundaries in a receipt; `unlock` checks the receipt
and releases exactly that, components in reverse order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstrata.unified_radix_cache.errors import (
    ForeignNode,
    ReceiptAlreadyReleased,
    ReceiptMismatch,
    UnknownReceipt,
)
from kvstrata.unified_radix_cache.results import LockReceipt, new_result

if TYPE_CHECKING:
    from kvstrata.unified_radix_cache.node import TreeNode
    from kvstrata.unified_radix_cache.tree_internals import TreeInternals


def lock(tree: TreeInternals, node: TreeNode) -> LockReceipt:
    """Protect what a request ending at `node` needs, per component (Full: the path to the
    root; SWA: one window upward; Mamba: this node's state). Moves that data from evictable
    to protected. Locking the root is allowed and protects nothing. O(depth).
    Raises ForeignNode for a node not in this tree (e.g. one evicted since the match)."""
    full = tree._full
    if full.path_lock is not None:
        # Compiled (Full-only device tree): the root check, then the path lock, in one call.
        heap = full.heap
        assert heap is not None
        moved = full.path_lock(node, tree._root, heap._members)
        if moved is None:
            raise ForeignNode(f"node {node.id} is not in this tree")
        full.evictable_size -= moved
        full.protected_size += moved
        receipt_id = next(tree._receipt_ids)
        receipt = new_result(LockReceipt, (receipt_id, node, (None,), (), tree._uid))
        tree._receipts[receipt_id] = receipt
        return receipt
    probe = node
    while probe.parent is not None:
        probe = probe.parent
    if probe is not tree._root:
        raise ForeignNode(f"node {node.id} is not in this tree")
    if tree._extras:
        boundaries = tuple(c.lock(node) for c in tree._components)
        skipped = tuple(
            c.name for c, b in zip(tree._extras, boundaries[1:], strict=True) if b is None
        )
    else:
        boundaries = (tree._full.lock(node),)
        skipped = ()
    receipt = LockReceipt(next(tree._receipt_ids), node, boundaries, skipped, tree._uid)
    tree._receipts[receipt.receipt_id] = receipt
    return receipt


def unlock(tree: TreeInternals, receipt: LockReceipt) -> None:
    """Release exactly the lock `receipt` proves. Raises ReceiptAlreadyReleased for a second
    unlock, UnknownReceipt for a receipt this tree never issued, ReceiptMismatch for an
    altered one, all before changing anything."""
    stored = tree._receipts.get(receipt.receipt_id)
    if receipt.tree_id != tree._uid:
        raise UnknownReceipt(f"receipt {receipt.receipt_id} was issued by another tree")
    if stored is None:
        raise ReceiptAlreadyReleased(f"receipt {receipt.receipt_id} was already released")
    if stored is not receipt and stored != receipt:
        raise ReceiptMismatch(
            f"receipt {receipt.receipt_id} does not match the lock it names (anchor "
            f"{stored.anchor.id} {stored.boundaries} vs "
            f"{receipt.anchor.id} {receipt.boundaries})"
        )
    del tree._receipts[receipt.receipt_id]
    anchor = stored.anchor
    if not tree._extras:
        tree._full.unlock(anchor, None)
        return
    for component, boundary in zip(
        reversed(tree._components), reversed(stored.boundaries), strict=True
    ):
        component.unlock(anchor, boundary)
