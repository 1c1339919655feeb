"""`Router`: pick an engine instance per request from the prefix index and the instances' load.

Policies:
- `round_robin`: instances in turn;
- `least_loaded`: the instance with the least load;
- `cache_aware`: the least cost, as Dynamo's KV router and SGLang's cache-aware router weigh it

      cost(i) = load_weight * load(i) + prefill_weight * (pages of the prompt not cached on i)

  with load in pages (the prompt pages of the requests routed to i and not yet finished) and
  ties broken by the lower load, then the instance order.

Approximate mode (`approximate_ttl_s`, as Dynamo's `--no-router-kv-events`): no engine events;
each decision writes the request's pages into the index as held by the chosen instance, and they
expire `approximate_ttl_s` later unless a later decision rewrote them.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvstrata.prefix_index.errors import InvalidParameter, NoInstances, UnknownPolicy
from kvstrata.prefix_index.index import PrefixIndex
from kvstrata.prefix_index.tiers import DEVICE
from kvstrata.unified_radix_cache import BlockRemoved, BlockStored

POLICIES = ("round_robin", "least_loaded", "cache_aware")


class MatchSource(Protocol):
    """What the router asks of an index: an in-process `PrefixIndex` or a `ClusterIndex`."""

    def match_lengths(self, page_keys: Sequence[bytes], /) -> dict[str, int]: ...


@dataclass(frozen=True, kw_only=True)
class RouteDecision:
    """Where a request goes, how many of its pages the index says that instance holds, the
    load charged to it (give the decision back to `finish` when the request ends)."""

    instance: str
    matched_pages: int
    num_pages: int
    load: int


class Router:
    """Routes requests (as page keys) to instances. `index` answers the matches (approximate
    mode writes into it, so it must then be a `PrefixIndex`); `instances` in a stable order;
    `clock` in seconds (only read in approximate mode)."""

    def __init__(
        self,
        index: MatchSource,
        instances: Sequence[str],
        *,
        policy: str = "cache_aware",
        load_weight: float = 1.0,
        prefill_weight: float = 1.0,
        approximate_ttl_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if policy not in POLICIES:
            raise UnknownPolicy(f"routing policy {policy!r}; choose one of {POLICIES}")
        if load_weight < 0 or prefill_weight < 0:
            raise InvalidParameter(
                f"weights must be >= 0, got load {load_weight}, prefill {prefill_weight}"
            )
        if approximate_ttl_s is not None and approximate_ttl_s <= 0:
            raise InvalidParameter(f"approximate_ttl_s must be > 0, got {approximate_ttl_s}")
        if approximate_ttl_s is not None and not isinstance(index, PrefixIndex):
            raise InvalidParameter("approximate mode writes into the index: pass a PrefixIndex")
        if len(set(instances)) != len(instances):
            raise InvalidParameter(f"instance names repeat: {list(instances)}")
        self.index = index
        self.policy = policy
        self.load_weight = load_weight
        self.prefill_weight = prefill_weight
        self.approximate_ttl_s = approximate_ttl_s
        self._clock = clock
        self._instances: list[str] = []
        self.load: dict[str, int] = {}
        self.routed_pages: dict[str, int] = {}
        self._turn = itertools.count()
        # Approximate mode: (expiry, instance, keys) in expiry order (one TTL: FIFO), and the
        # latest expiry per (instance, key) so an older decision never removes a newer write.
        self._expiries: deque[tuple[float, str, tuple[bytes, ...]]] = deque()
        self._latest: dict[tuple[str, bytes], float] = {}
        for name in instances:
            self.add_instance(name)

    def add_instance(self, name: str) -> None:
        """Route to `name` from now on (no-op if present)."""
        if not isinstance(name, str) or not name:
            raise InvalidParameter(f"an instance is named by a non-empty str, got {name!r}")
        if name not in self.load:
            self._instances.append(name)
            self.load[name] = 0
            self.routed_pages[name] = 0

    def remove_instance(self, name: str) -> None:
        """Stop routing to `name` (dead engine); its index entries are the index's business."""
        if name in self.load:
            self._instances.remove(name)
            del self.load[name]
            del self.routed_pages[name]
            if isinstance(self.index, PrefixIndex) and self.approximate_ttl_s is not None:
                self.index.drop_instance(name)

    @property
    def instances(self) -> list[str]:
        return list(self._instances)

    def route(self, page_keys: Sequence[bytes]) -> RouteDecision:
        """Choose an instance for a request with these page keys and charge its load.
        Raises NoInstances when there is none. Mutates load (and, approximate, the index)."""
        if not self._instances:
            raise NoInstances("the router has no instance")
        num_pages = len(page_keys)
        if self.approximate_ttl_s is not None:
            self._expire(self._clock())
        matched: dict[str, int] = {}
        if self.policy == "round_robin":
            name = self._instances[next(self._turn) % len(self._instances)]
        elif self.policy == "least_loaded":
            load = self.load
            name = min(self._instances, key=lambda n: load[n])
        else:
            matched = self.index.match_lengths(page_keys)
            name = self._cheapest(matched, num_pages)
        if not matched and self.policy != "cache_aware":
            matched = self.index.match_lengths(page_keys)
        self.load[name] += num_pages
        self.routed_pages[name] += num_pages
        if self.approximate_ttl_s is not None and page_keys:
            self._remember(name, tuple(page_keys))
        return RouteDecision(
            instance=name,
            matched_pages=matched.get(name, 0),
            num_pages=num_pages,
            load=num_pages,
        )

    def finish(self, decision: RouteDecision) -> None:
        """The request of `decision` ended: release its load (no-op for a removed instance)."""
        if decision.instance in self.load:
            self.load[decision.instance] = max(0, self.load[decision.instance] - decision.load)

    def _cheapest(self, matched: dict[str, int], num_pages: int) -> str:
        lw, pw, load = self.load_weight, self.prefill_weight, self.load
        best = self._instances[0]
        best_rank: tuple[float, int, int] | None = None
        for order, name in enumerate(self._instances):
            rank = (lw * load[name] + pw * (num_pages - matched.get(name, 0)), load[name], order)
            if best_rank is None or rank < best_rank:
                best, best_rank = name, rank
        return best

    def _remember(self, name: str, keys: tuple[bytes, ...]) -> None:
        assert self.approximate_ttl_s is not None
        assert isinstance(self.index, PrefixIndex), "checked in __init__"
        expiry = self._clock() + self.approximate_ttl_s
        stored = BlockStored(
            page_keys=keys, parent_key=None, tokens_per_page=self.index.page_size, tier=DEVICE
        )
        self.index.apply(name, [stored])
        latest = self._latest
        for key in keys:
            latest[(name, key)] = expiry
        self._expiries.append((expiry, name, keys))

    def _expire(self, now: float) -> None:
        queue, latest = self._expiries, self._latest
        while queue and queue[0][0] <= now:
            expiry, name, keys = queue.popleft()
            gone = [k for k in keys if latest.get((name, k)) == expiry]
            for key in gone:
                del latest[(name, key)]
            if gone and name in self.load:
                assert isinstance(self.index, PrefixIndex), "checked in __init__"
                self.index.apply(name, [BlockRemoved(page_keys=tuple(gone), tier=DEVICE)])
