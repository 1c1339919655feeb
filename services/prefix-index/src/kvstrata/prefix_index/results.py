"""What a lookup returns (`PrefixIndex.find_matches`): plain NamedTuples, built by the Python
core and, as the same tuple types, by the compiled one (`native`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple


class InstanceMatch(NamedTuple):
    """One instance's longest run of held pages from the first page of the query, and the best
    tier (highest weight) it holds each page on."""

    num_pages: int
    tiers: tuple[str, ...]


class PrefixMatches(NamedTuple):
    """`find_matches` result: the query's page count and, per instance holding at least its
    first page, that instance's match. `partial` is True while the index answers from an
    incomplete state (a shard still rebuilding from dumps)."""

    num_pages: int
    by_instance: Mapping[str, InstanceMatch]
    partial: bool = False

    def longest(self) -> int:
        """Pages of the longest match over all instances (0 when none holds the first page)."""
        return max((m.num_pages for m in self.by_instance.values()), default=0)
