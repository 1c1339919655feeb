"""`TreeInternals`: the tree as its own helper modules see it.

tree.py keeps the public surface of `UnifiedRadixCache` and hands the work to modules by
role (structure.py: split and remove; locks.py: receipts; hybrid.py: the hooked walks;
insert_inputs.py, integrity.py, request.py, render.py). They read and write the tree's fields,
so they are typed against this protocol rather than against the class: tree.py imports them,
they never import tree.py, and the member has no import cycle. `UnifiedRadixCache` implements
it; nothing else does.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Protocol

from kvstrata.unified_radix_cache.evict_undo import EvictingTree

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    import torch

    from kvstrata.unified_radix_cache.components.base import ComponentInsert, TreeComponent
    from kvstrata.unified_radix_cache.components.full import FullComponent
    from kvstrata.unified_radix_cache.key import Namespace, RadixKey
    from kvstrata.unified_radix_cache.node import TreeNode
    from kvstrata.unified_radix_cache.results import InsertResult, LockReceipt, MatchResult
    from kvstrata.unified_radix_cache.slot_checks import SlotChecker


class TreeInternals(EvictingTree, Protocol):
    """Fields and operations of `UnifiedRadixCache` its helper modules use: those an evict
    uses (`evict_undo.EvictingTree`: sizes, heap, events, journal, root, components) and
    these."""

    # -- configuration and state (see `UnifiedRadixCache.__init__`) ----------------------------
    page_size: int
    hit_tokens: int
    inserted_tokens: int
    _uid: int
    _full: FullComponent
    _components: tuple[TreeComponent, ...]
    _extras: tuple[TreeComponent, ...]
    _by_name: dict[str, TreeComponent]
    _num_components: int
    _root: TreeNode
    _tick: int
    _ids: Iterator[int]
    _receipts: dict[int, LockReceipt]
    _receipt_ids: Iterator[int]
    _slot_checker: SlotChecker | None
    _last_walk: tuple[RadixKey, int, list[TreeNode], int] | None

    # -- reads ------------------------------------------------------------------------------
    @property
    def full_device(self) -> torch.device: ...

    def prefix_slots(self, node: TreeNode) -> torch.Tensor: ...

    def outstanding_receipts(self) -> list[LockReceipt]: ...

    # -- operations -------------------------------------------------------------------------
    def walk(self, namespace: Namespace | None, data: bytes, end: int) -> list[TreeNode]: ...

    def split_node(self, node: TreeNode, num_tokens: int) -> TreeNode: ...

    def flush_pending(self) -> None: ...

    def _forget_walk(self) -> None: ...

    def free_slots(self, component: str, slots: torch.Tensor) -> None: ...

    def match_prefix(
        self, key: RadixKey, *, max_len: int | None = None, copy_state: bool = False
    ) -> MatchResult: ...

    def insert(
        self,
        key: RadixKey,
        value: torch.Tensor | npt.NDArray[np.integer],
        *,
        cached_len: int = 0,
        priority: int = 0,
        inputs: Mapping[str, ComponentInsert] | None = None,
    ) -> InsertResult: ...

    def lock(self, node: TreeNode) -> LockReceipt: ...

    def unlock(self, receipt: LockReceipt) -> None: ...
