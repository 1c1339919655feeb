"""Multi-pool hits: how far a prefix can be restored when every pool has to restore it.

A hybrid model holds different state for the same prefix in each pool, and each pool needs a
different part of the prefix's pages to resume at a boundary b (a page count):

    pages          0   1   2   3   4   5   6   7
    full (PREFIX)  x   x   x   x   x   x   .   .     every page before b
    swa (WINDOW=2) .   .   .   x   x   x   x   .     the last 2 pages before b
    mamba (BOUND.) .   .   .   .   .   x   .   x     the state at the end of page b - 1

Here b = 6 needs full[0:6] (ok), swa[4:6] (ok) and mamba[5] (ok): the restorable length is
6 pages, although full alone would allow 6 and mamba alone 8. A prefix counts as a hit only as far
as the smallest boundary every member accepts; b = 0 (nothing) is always restorable.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from kvstrata.hybrid_cache.errors import InvalidOperation


class RestoreKind(StrEnum):
    PREFIX = "prefix"
    """Full attention: every page of the prefix."""
    WINDOW = "window"
    """Sliding-window attention: the pages of the last window before the boundary."""
    BOUNDARY = "boundary"
    """Recurrent state (Mamba): the state at the boundary only."""


@dataclass(frozen=True, kw_only=True)
class RestoreRule:
    """What one member of a pool group needs to resume a prefix at a page boundary."""

    kind: RestoreKind
    window_pages: int = 0
    """WINDOW only: pages the window spans, ceil(sliding_window / page_size)."""

    def __post_init__(self) -> None:
        if not isinstance(self.kind, RestoreKind):
            raise ValueError(f"kind must be a RestoreKind, got {self.kind!r}")
        if self.kind is RestoreKind.WINDOW and self.window_pages < 1:
            raise ValueError(f"a WINDOW rule needs window_pages >= 1, got {self.window_pages}")
        if self.kind is not RestoreKind.WINDOW and self.window_pages != 0:
            raise ValueError(f"window_pages is for WINDOW rules only, got {self.window_pages}")

    @classmethod
    def prefix(cls) -> RestoreRule:
        return cls(kind=RestoreKind.PREFIX)

    @classmethod
    def window(cls, *, sliding_window: int, page_size: int) -> RestoreRule:
        """The rule of an SWA pool: its window rounded up to whole pages."""
        if sliding_window < 1 or page_size < 1:
            raise ValueError(
                f"sliding_window {sliding_window} and page_size {page_size} must be >= 1"
            )
        return cls(kind=RestoreKind.WINDOW, window_pages=-(-sliding_window // page_size))

    @classmethod
    def boundary(cls) -> RestoreRule:
        return cls(kind=RestoreKind.BOUNDARY)


@dataclass(frozen=True, kw_only=True)
class Restorable:
    """Result of `restorable_pages`: the longest boundary every member accepts."""

    num_pages: int
    limited_by: str | None
    """The member that stopped a longer boundary (the first, in member order, that refuses
    `num_pages + 1`), or None when the whole prefix is restorable."""


def restorable_pages(
    rules: Mapping[str, RestoreRule], available: Mapping[str, Sequence[bool]], num_pages: int
) -> Restorable:
    """The longest page boundary b in [0, num_pages] at which every member can restore.

    `available[name][i]` says whether member `name` holds page i of the prefix (for a BOUNDARY
    member: the state at the end of page i). Every ruled member must have an entry of exactly
    `num_pages` flags. Pure function; O(num_pages x members).
    """
    for name in rules:
        if name not in available:
            raise InvalidOperation(f"no availability given for member {name!r}")
        if len(available[name]) != num_pages:
            raise InvalidOperation(
                f"member {name!r}: {len(available[name])} availability flags for {num_pages} pages"
            )
    # For each member, ok[b] for b in 0..num_pages, computed from run lengths so every rule is
    # one linear pass.
    accepts: dict[str, list[bool]] = {
        name: _accepted_boundaries(rule, available[name]) for name, rule in rules.items()
    }
    best = 0
    if len(accepts) == 1:  # one member: its deepest accepted boundary, found in C
        (only,) = accepts.values()
        best = num_pages - only[::-1].index(True)  # ok[0] is always True
    else:
        for b in range(num_pages, 0, -1):
            if all(ok[b] for ok in accepts.values()):
                best = b
                break
    limited_by: str | None = None
    if best < num_pages:
        limited_by = next(name for name, ok in accepts.items() if not ok[best + 1])
    return Restorable(num_pages=best, limited_by=limited_by)


def _accepted_boundaries(rule: RestoreRule, flags: Sequence[bool]) -> list[bool]:
    n = len(flags)
    if rule.kind is RestoreKind.PREFIX:  # accepted up to the first missing page: found in C
        present = list(map(bool, flags))
        run = present.index(False) if False in present else n
        return [True] * (run + 1) + [False] * (n - run)
    if rule.kind is RestoreKind.BOUNDARY:
        return [True, *map(bool, flags)]
    ok = [True] * (n + 1)
    if rule.kind is RestoreKind.WINDOW:
        run = 0  # consecutive available pages ending at page b - 1
        for b in range(1, n + 1):
            run = run + 1 if flags[b - 1] else 0
            ok[b] = run >= min(rule.window_pages, b)
    return ok
