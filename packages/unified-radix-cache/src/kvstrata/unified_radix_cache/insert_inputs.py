"""Checks of what `UnifiedRadixCache.insert` is given, run before the tree changes: the Full
slots (normalised to one int64 numpy array) and the per-component insert inputs.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import TYPE_CHECKING, cast

import numpy as np
import numpy.typing as npt
import torch

from kvstrata.unified_radix_cache.errors import InvalidInsert

if TYPE_CHECKING:
    from kvstrata.unified_radix_cache.components.base import ComponentInsert
    from kvstrata.unified_radix_cache.tree_internals import TreeInternals

_INT64 = np.dtype(np.int64)


def slots_of(
    value: torch.Tensor | npt.NDArray[np.integer], num_tokens: int
) -> npt.NDArray[np.int64]:
    """The caller's slots as an int64 numpy array (a view of a CPU tensor's memory)."""
    if isinstance(value, torch.Tensor):
        try:
            slots = value.numpy()
        except (RuntimeError, TypeError):  # on an accelerator, requires grad, or bfloat16
            if value.is_floating_point() or value.is_complex():
                raise InvalidInsert(f"value must be integer slots, got {value.dtype}") from None
            slots = value.detach().cpu().numpy()
    else:
        slots = np.asarray(value)
    # One identity test on the common path; anything else (float slots included) is
    # normalised or refused here.
    if slots.dtype is not _INT64 or slots.ndim != 1:
        if slots.ndim != 1 or (slots.size and slots.dtype.kind not in "iu"):
            raise InvalidInsert(f"value must be 1-D integer slots, got {slots.dtype} {slots.shape}")
        slots = slots.astype(np.int64)
    if len(slots) != num_tokens:
        raise InvalidInsert(f"value has {len(slots)} slots for a key of {num_tokens} tokens")
    return cast("npt.NDArray[np.int64]", slots)


def check_inputs(
    tree: TreeInternals, inputs: Mapping[str, ComponentInsert] | None, num_tokens: int
) -> Mapping[str, ComponentInsert] | None:
    """`inputs` if every entry names a state component of `tree` and that component accepts
    it for a key of `num_tokens` tokens; InvalidInsert otherwise."""
    if not inputs:
        return None
    for name, inp in inputs.items():
        component = tree._by_name.get(name)
        if component is None or component is tree._full:
            raise InvalidInsert(f"insert input for {name!r}, which is not a state component here")
        component.check_insert_input(inp, num_tokens)
    return inputs


def as_priority(priority: object) -> int:
    """`priority` as an int (numpy integers accepted); InvalidInsert for anything else, before
    the tree changes: the priority policy compares it with other nodes' priorities, and a
    comparison that raises inside an eviction or unlock would leave the tree half changed."""
    try:
        return operator.index(priority)  # pyright: ignore[reportArgumentType]
    except TypeError:
        raise InvalidInsert(f"priority must be an integer, got {type(priority).__name__}") from None
