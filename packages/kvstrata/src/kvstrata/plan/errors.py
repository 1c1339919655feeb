"""Errors the capacity planner raises to its caller (the CLI prints them and exits with code 2).

Every one is raised before anything is computed or written.
"""

from __future__ import annotations


class PlanError(Exception):
    """Base of every error of `kvstrata.plan`."""


class PlanOptionError(PlanError, ValueError):
    """An option of the planner is out of range (target, capacity, price, bytes per token...)."""


class TraceNotChained(PlanError, ValueError):
    """The trace's block ids are not chained: one block id follows two different blocks (or
    opens one request and follows a block in another), so equal ids do not name equal prefixes
    and the requests do not form a prefix tree. Names the block and two requests (0-based, in
    file order) that disagree."""

    def __init__(self, *, block_id: int, first_request: int, second_request: int) -> None:
        super().__init__(
            f"block id {block_id} has different prefixes in request {first_request} and "
            f"request {second_request}: hash_ids must be chained (equal id = equal prefix)"
        )
        self.block_id = block_id
        self.first_request = first_request
        self.second_request = second_request


class TargetUnreachable(PlanError, ValueError):
    """No capacity reaches the target hit rate: even a cache that never evicts stays below it
    (the trace's ideal hit rate, every repeat of a block a hit)."""

    def __init__(self, *, name: str, target: float, ideal: float) -> None:
        super().__init__(
            f"{name} {target:.2%} is above what any capacity reaches on this trace: an "
            f"unbounded cache hits {ideal:.2%} of the blocks"
        )
        self.target = target
        self.ideal = ideal
