"""The compiled hot paths of the radix tree (`radix_core.c`, `radix_evict.c`, `radix_insert.c`,
`radix_locks.c`, compiled as one file): the walk for every tree, match, slot check, eviction
loop and lock walks for a Full-only device tree, the match and insert of a Full-only tree with
a host tier; and their contract.

`native_core()` returns the extension module built from the three parts joined
(`kvstrata.pool.native.joined_source`) by `kvstrata.pool.native.native_extension` (system C
compiler, per-machine cache; built at first use), or None when it is unavailable, turned off
(`KVSTRATA_NATIVE=0`) or asked for inside `kvstrata.pool.native.disabled()`. A tree asks
once, when it is made, and keeps the answer: a tree made inside `disabled()` runs the
pure-Python paths for good (A/B tests compare the two).

What the module does, each the same as the Python it replaces (same nodes, same splits, same
answers; tests/test_radix_native.py compares both paths on random operations):

- `walk(root, page_bytes, namespace, data, end, split)`: `walk.descend` without `visit`.
- `match(root, page_bytes, namespace, data, end, split, tick)`: `descend` with `split`, then
  each path node gets `last_access = tick` and `hit_count += 1` (what `match_prefix` does),
  and the path's Full slots come back as one bytearray (`pos` bytes; None for an empty path).
- `match_tiered(root, page_bytes, namespace, data, end, split, tick)`: the match of a Full-only
  tree with a host tier (`HostWalks.match`): the same walk, split and touch as `match`; the
  leading path nodes with device slots are the device hit (their slots joined, None when
  none), the keys of the rest (off the device, on the host) the host hit's bytes.
- `insert_tiered(tree, heap, checker, revive, node_type, no_children, namespace, data, end,
  slots, cached_len, priority)` (radix_insert.c): `HostWalks.insert_full` of a Full-only tree
  of the exact classes without events in one call (the walk, the slot check, the split, the
  revives, the new leaf or the end node's re-key; the same hooks called in the same order);
  returns the six fields of its `InsertResult`, or None, changing nothing, for the cases the
  Python walk words (events on, a revive inside the cached prefix, a cached_len past the held
  prefix).
- `evict(heap, amount, page, page_bytes, root, no_children, pending, removed, cut,
  progress, held)`: the loop of `FullComponent._evict` with `tree.remove_leaf` / `truncate_leaf`
  inlined, for a Full-only device tree without events (no hook, journal or event to run):
  leaves in heap order, the last one cut page-granular, slots queued on `pending`, undo
  records on `removed` / `cut`. Returns (tokens freed, nodes removed, joined slots or None:
  see `held` below); `evict_leaves` applies the size counters. Each leaf is either left as
  it was or taken whole (cut) before the next one; when something raises midway (a priority
  whose comparison raises in the parent's `heap.push`, MemoryError, KeyboardInterrupt from
  Python code it calls) the counts so far are in `progress` (a 16-byte bytearray, two int64)
  and `evict_leaves` still applies them.
  Targets of 2**63 and more are clamped (they free everything, as in Python). Unless `held`
  is False, `pending` is then drained as `drain(pending, held)` does, in the same call, and
  the joined slots come third (else None): the unchecked evict's flush
  (`evict_leaves(..., flush=True)`).
- `drain(pending, held)`: `FullComponent.flush`'s array work: the queued slot arrays joined
  into one bytearray (None when there are none; the list emptied) and, with `held`, each slot
  inside the table cleared there (the table covers every slot the tree marked).
- `check_slots(slots, lo, hi, held, keep)`: True when the slots are in the table, unmarked and
  distinct (marked when `keep`); False changes nothing and the caller runs the Python check,
  which raises the precise error.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol, cast

import numpy as np
import numpy.typing as npt

from kvstrata.pool.native import joined_source, native_extension
from kvstrata.unified_radix_cache.components.full import FullComponent
from kvstrata.unified_radix_cache.key import Namespace
from kvstrata.unified_radix_cache.node import NO_CHILDREN, TreeNode
from kvstrata.unified_radix_cache.policies import LeafHeap
from kvstrata.unified_radix_cache.walk import SplitFn

if TYPE_CHECKING:
    from kvstrata.unified_radix_cache.slot_checks import SlotChecker
    from kvstrata.unified_radix_cache.tree_internals import TreeInternals

Slots = npt.NDArray[np.int64]
#: Undo records of an evict (`FullComponent.evict_checked`): removed (node, parent) pairs and
#: cut leaves (node, value, key, page keys) as they were.
Removed = list[tuple[TreeNode, TreeNode]]
Cut = list[tuple[TreeNode, Slots, bytes, list[bytes] | None]]

#: The C parts, joined in this order into one file (each under the 700-line limit).
SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in (
        "radix_core.c",
        "radix_evict.c",
        # radix_insert.c: the tiered insert (before radix_locks.c, which lists its method)
        "radix_insert.c",
        "radix_locks.c",
    )
)


def source() -> Path:
    """The C parts as one file (`kvstrata.pool.native.joined_source`)."""
    return joined_source(SOURCES)


MODULE_NAME = "_kvstrata_radix_core"


class RadixCore(Protocol):
    """The functions of the compiled module (see the module docstring), positional only."""

    #: (root, page_bytes, namespace, data, end, split) -> (path, pos, partial)
    walk: Callable[
        [TreeNode, int, Namespace | None, bytes, int, SplitFn | None],
        tuple[list[TreeNode], int, int],
    ]
    #: (root, page_bytes, namespace, data, end, split, tick) -> (path, pos, joined slots)
    match: Callable[
        [TreeNode, int, Namespace | None, bytes, int, SplitFn, int],
        tuple[list[TreeNode], int, bytearray | None],
    ]
    #: (root, page_bytes, namespace, data, end, split, tick)
    #: -> (path, on_device, host_bytes, joined device slots)
    match_tiered: Callable[
        [TreeNode, int, Namespace | None, bytes, int, SplitFn, int],
        tuple[list[TreeNode], int, int, bytearray | None],
    ]
    #: (heap, amount, page, page_bytes, root, no_children, pending, removed, cut, progress,
    #: held) -> (tokens freed, nodes removed, `drain(pending, held)` or None for held False)
    evict: Callable[
        [
            LeafHeap,
            int,
            int,
            int,
            TreeNode,
            object,
            list[Slots],
            Removed | None,
            Cut | None,
            bytearray,
            npt.NDArray[np.int32] | Literal[False] | None,
        ],
        tuple[int, int, bytearray | None],
    ]
    #: (tree, device heap, checker, revive, node type, NO_CHILDREN, namespace, data, end, slots,
    #: cached_len, priority) -> InsertResult's fields, or None for the Python walk
    insert_tiered: Callable[
        [
            TreeInternals,
            LeafHeap,
            SlotChecker | None,
            Callable[[TreeNode, Slots], None],
            type[TreeNode],
            object,
            Namespace | None,
            bytes,
            int,
            Slots,
            int,
            int,
        ],
        tuple[int, int, TreeNode, tuple[tuple[int, int], ...], tuple[str, ...], int] | None,
    ]
    #: (anchor, root, leaf heap members) -> tokens locked, or None for a foreign anchor
    lock_path: Callable[[TreeNode, TreeNode, dict[int, TreeNode]], int | None]
    #: (anchor, leaf heap) -> tokens unlocked
    unlock_path: Callable[[TreeNode, LeafHeap], int]
    #: (pending, held) -> the pending slots joined (pending emptied, held flags cleared)
    drain: Callable[[list[Slots], npt.NDArray[np.int32] | None], bytearray | None]
    #: (slots, lo, hi, held, keep) -> whether they passed (and were marked when keep)
    check_slots: Callable[[Slots, int, int, npt.NDArray[np.int32], bool], bool]


def native_core() -> RadixCore | None:
    """The compiled module, or None (then the tree keeps its Python paths)."""
    return cast("RadixCore | None", native_extension(source(), MODULE_NAME).module)


def install(core: RadixCore, tree: TreeInternals, *, events: bool) -> None:
    """Give the Full component of `tree` (a Full-only device tree) the compiled lock and
    unlock walks and, without events, the compiled eviction loop; nothing when its Full
    component or heap is not exactly `FullComponent` / `LeafHeap`: the compiled code mirrors
    those classes, so a subclass (or another heap) keeps its overrides on the Python path.
    `attach_host_tier` takes them away again (`FullComponent.drop_compiled`)."""
    full = tree._full
    if type(full) is not FullComponent or type(tree._heap) is not LeafHeap:
        return
    if not events:
        full.leaf_evictor = partial(evict_leaves, core, tree, bytearray(16))
    full.path_lock = core.lock_path
    full.path_unlock = core.unlock_path


def evict_leaves(
    core: RadixCore,
    tree: TreeInternals,
    progress: bytearray,
    amount: int,
    removed: Removed | None,
    cut: Cut | None,
    flush: bool,
) -> int:
    """`FullComponent._evict` of a Full-only device tree without events, compiled: the same
    leaves go, in the same order, with the same undo records. Returns the tokens freed.
    `progress`: the tree's 16-byte scratch for the counts when the loop raises midway (then
    the leaves already taken are counted here before the exception goes on). `flush`: then
    `FullComponent.flush` too, its `drain` inside the same compiled call."""
    full = tree._full
    try:
        freed, gone, joined = core.evict(
            tree._heap,
            amount,
            tree.page_size,
            tree._page_bytes,
            tree._root,
            NO_CHILDREN,
            full._pending,
            removed,
            cut,
            progress,
            full.held if flush else False,
        )
    except BaseException:
        freed, gone = _PROGRESS.unpack(progress)
        _count(tree, freed, gone)
        raise
    # _count, inlined: once per evict on an engine's path.
    full.evictable_size -= freed
    full.evicted_total += freed
    tree.num_nodes -= gone
    if freed:
        tree._forget_walk()
    if joined is not None:
        full.free_joined(joined)
    return freed


_PROGRESS = struct.Struct("=qq")


def _count(tree: TreeInternals, freed: int, gone: int) -> None:
    full = tree._full
    full.evictable_size -= freed
    full.evicted_total += freed
    tree.num_nodes -= gone
    if freed:
        tree._forget_walk()
