"""Bounded operation queues and the worker threads that drain them.

One worker per operation kind (write, load, prefetch, backup), so a stalled storage backend never
holds up a device <-> host copy. A worker takes a *batch*: the first waiting item plus the items
right behind it that may merge with it (consecutive writes become one transfer), runs it, and goes
back for more. Whatever the batch function raises is caught, handed to `on_error` (which logs,
counts and fails the batch's operations), and the worker keeps serving: it never dies silently.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import InitVar, dataclass, field
from typing import Generic, TypeVar

from kvstrata.hybrid_cache.errors import QueueFull

logger = logging.getLogger(__name__)

T = TypeVar("T")


class OpQueue(Generic[T]):
    """A FIFO of at most `capacity` items shared by submitters and one worker.

    `put` refuses (QueueFull) instead of blocking: the caller is a scheduler loop that must not
    stall on a slow tier, and it is the one that can drain acknowledgements to make room.
    """

    def __init__(self, *, kind: str, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"{kind} queue capacity must be >= 1, got {capacity}")
        self.kind = kind
        self.capacity = capacity
        self._items: deque[T] = deque()
        self._cond = threading.Condition()
        self._closed = False

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)

    def has_room(self) -> bool:
        with self._cond:
            return len(self._items) < self.capacity

    def put(self, item: T) -> None:
        """Append `item`; QueueFull (nothing changed) when `capacity` items wait already."""
        with self._cond:
            assert not self._closed, f"{self.kind} queue: put after close"
            if len(self._items) >= self.capacity:
                raise QueueFull(self.kind, self.capacity)
            self._items.append(item)
            self._cond.notify()

    def put_all(self, items: list[T]) -> None:
        """Append `items` in order with one wake-up; QueueFull (nothing changed) when they do
        not all fit."""
        with self._cond:
            assert not self._closed, f"{self.kind} queue: put after close"
            if len(self._items) + len(items) > self.capacity:
                raise QueueFull(self.kind, self.capacity)
            self._items.extend(items)
            self._cond.notify()

    def take_batch(self, *, max_items: int, merges: Callable[[T, T], bool]) -> list[T] | None:
        """Block until an item waits; pop it and up to `max_items - 1` followers that
        `merges(first, follower)` accepts, stopping at the first that does not (order is kept).
        None once the queue is closed and empty: the worker's signal to exit."""
        with self._cond:
            while not self._items and not self._closed:
                self._cond.wait()
            if not self._items:
                return None
            first = self._items.popleft()
            batch = [first]
            while self._items and len(batch) < max_items and merges(first, self._items[0]):
                batch.append(self._items.popleft())
            return batch

    def drain(self) -> list[T]:
        """Remove and return every waiting item (used by close to cancel what never started)."""
        with self._cond:
            items = list(self._items)
            self._items.clear()
            return items

    def close(self) -> None:
        """Wake the worker; it finishes what is queued, then `take_batch` returns None."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()


@dataclass(kw_only=True, eq=False)
class Worker(Generic[T]):
    """A daemon thread (named `name`) running `run_batch` over batches from one `OpQueue`.

    `run_batch` acknowledges its own operations. If it raises, `on_error(batch, exc)` must
    acknowledge every operation of the batch that is not yet acknowledged; an exception from
    `on_error` itself is logged and the worker still continues.
    """

    name: InitVar[str]
    queue: OpQueue[T]
    run_batch: Callable[[list[T]], None]
    on_error: Callable[[list[T], Exception], None]
    max_batch: int
    merges: Callable[[T, T], bool]
    num_batches: int = field(default=0, init=False)
    num_errors: int = field(default=0, init=False)
    _thread: threading.Thread = field(init=False)

    def __post_init__(self, name: str) -> None:
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout_s: float | None = None) -> bool:
        """Wait for the thread to exit (after the queue was closed); True when it has."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _loop(self) -> None:
        while True:
            batch = self.queue.take_batch(max_items=self.max_batch, merges=self.merges)
            if batch is None:
                return
            self.num_batches += 1
            try:
                self.run_batch(batch)
            except Exception as exc:  # a worker reports every failure and keeps serving
                self.num_errors += 1
                logger.exception(
                    "%s worker: batch of %d operations raised", self.queue.kind, len(batch)
                )
                try:
                    self.on_error(batch, exc)
                except Exception:  # the report itself failed: log it, keep the worker alive
                    logger.exception("%s worker: reporting a failed batch raised", self.queue.kind)
