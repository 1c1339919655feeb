"""Text picture of a tree for debugging (`UnifiedRadixCache.pretty_print`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstrata.unified_radix_cache.node import TreeNode
    from kvstrata.unified_radix_cache.tree_internals import TreeInternals


def _describe(tree: TreeInternals, node: TreeNode, max_tokens: int) -> str:
    tokens = node.tokens()
    shown = " ".join(str(int(t)) for t in tokens[:max_tokens])
    if len(tokens) > max_tokens:
        shown += " ..."
    parts = [f"#{node.id} [{shown}] {len(tokens)} tok", f"full lock={node.lock_ref}"]
    for component in tree.components[1:]:
        size = component.node_size(node)
        state = "-" if size == 0 else str(size)
        parts.append(f"{component.name}={state} lock={component.node_lock(node)}")
    if node.namespace is not None:
        parts.append(f"ns={tuple(node.namespace)}")
    if node.heap_entry is not None:
        parts.append("evictable")
    return "  ".join(parts)


def render_tree(tree: TreeInternals, *, max_tokens: int = 8) -> str:
    """One line per node, indented by depth, children in insertion order."""
    lines = [
        f"root  nodes={tree.num_nodes}  "
        + "  ".join(
            f"{c.name}: evictable={c.evictable_size} protected={c.protected_size}"
            for c in tree.components
        )
    ]
    stack: list[tuple[TreeNode, int]] = [
        (child, 1) for child in reversed(list(tree.root.children.values()))
    ]
    while stack:
        node, depth = stack.pop()
        lines.append("  " * depth + _describe(tree, node, max_tokens))
        stack.extend((child, depth + 1) for child in reversed(list(node.children.values())))
    return "\n".join(lines)
