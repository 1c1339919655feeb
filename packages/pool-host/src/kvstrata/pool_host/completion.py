"""Per-layer completion of a layer-wise load, and the handles transfers return.

A layer-wise load copies layer 0, 1, ... of one batch host -> device while the engine computes:
attention of layer i calls `completion.wait(i)` and proceeds as soon as layer i has landed, so
the copy of layer i+1 overlaps the compute of layer i.

    producer (tier controller worker)         consumer (model forward)
    load(..., layer 0) -> mark_loaded(0)      wait(0) -> attention 0
    load(..., layer 1) -> mark_loaded(1)      wait(1) -> attention 1     ...

On CPU `mark_loaded` runs after the copy finished, and `wait` blocks the calling thread on a
threading.Event. On CUDA the copy is only enqueued on the copy stream: `mark_loaded` carries the
CUDA event recorded after it, and `wait` (once the copy is enqueued) makes the consumer's current
stream wait on that event, so the host thread does not block on the GPU.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from kvstrata.pool_host.errors import (
    LayerAlreadyLoaded,
    LayerIdOutOfRange,
    LayerLoadFailed,
    LayerWaitTimeout,
)
from kvstrata.pool_host.transfer import CopyStrategy

#: "d2h": a backup (device -> host); "h2d": a layer load (host -> device).
Direction = Literal["d2h", "h2d"]


@dataclass(frozen=True, kw_only=True)
class Transfer:
    """What one backup or load did. `event` is the CUDA event recorded after the copies on the
    pool's copy stream (None on CPU, where the copies are complete when the call returns)."""

    direction: Direction
    num_pages: int
    num_bytes: int
    num_copies: int
    strategy: CopyStrategy
    event: torch.cuda.Event | None = None

    def done(self) -> bool:
        """Whether the copies have completed (never blocks)."""
        return self.event is None or self.event.query()

    def wait(self) -> None:
        """Block the host until the copies completed (a no-op on CPU). Needed before host
        bytes written by a CUDA backup are read on the host (page views, L3 writes)."""
        if self.event is not None:
            self.event.synchronize()


@dataclass(frozen=True, kw_only=True)
class LayerLoad(Transfer):
    """A Transfer that loaded one layer host -> device."""

    layer_id: int


class LayerCompletion:
    """Which layers of one layer-wise load have arrived. Thread-safe; one per batch.

    Layers may be marked in any order, each exactly once. `fail(error)` wakes every waiter of a
    layer not yet loaded with LayerLoadFailed, so a consumer never waits forever on a producer
    that died.
    """

    def __init__(self, layer_ids: Iterable[int]) -> None:
        # Per layer, the Event its first waiter made (under the lock); None until then: most
        # layers are marked before anyone waits (a CPU load runs before its handle is read),
        # and an Event costs a Condition and a lock.
        self._arrived: dict[int, threading.Event | None] = dict.fromkeys(layer_ids)
        self._cuda_events: dict[int, torch.cuda.Event] = {}
        self._loaded: set[int] = set()
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    @property
    def layer_ids(self) -> list[int]:
        return list(self._arrived)

    @property
    def num_loaded(self) -> int:
        with self._lock:
            return len(self._loaded)

    def is_loaded(self, layer_id: int) -> bool:
        """Whether layer_id was marked loaded (on CUDA: enqueued; its event may still run)."""
        self._check_layer(layer_id)
        with self._lock:
            return layer_id in self._loaded

    def check_pending(self, layer_ids: Sequence[int]) -> None:
        """Producer side, before copying: LayerIdOutOfRange unless every id is part of this
        load, LayerAlreadyLoaded if one is marked already or listed twice. Mutates nothing.
        HostPool.load / load_layers call it, so a refused load has copied nothing."""
        for layer_id in layer_ids:
            self._check_layer(layer_id)
        if len(set(layer_ids)) != len(layer_ids):
            raise LayerAlreadyLoaded(f"layers {list(layer_ids)} list a layer twice")
        with self._lock:
            done = sorted(set(layer_ids) & self._loaded)
        if done:
            raise LayerAlreadyLoaded(f"layers {done} were already marked loaded")

    def mark_loaded(self, layer_id: int, event: torch.cuda.Event | None = None) -> None:
        """Producer side: layer_id has landed (CPU) or its copies are enqueued before `event`.
        Each layer exactly once (an assertion: `check_pending` refuses a repeat up front)."""
        self._check_layer(layer_id)
        with self._lock:
            assert layer_id not in self._loaded, f"layer {layer_id} was marked loaded twice"
            self._loaded.add(layer_id)
            if event is not None:
                self._cuda_events[layer_id] = event
            arrived = self._arrived[layer_id]
        if arrived is not None:
            arrived.set()

    def fail(self, error: BaseException) -> None:
        """Producer side: the load stopped; waiters of the missing layers get LayerLoadFailed."""
        with self._lock:
            self._error = error
            waited = [arrived for arrived in self._arrived.values() if arrived is not None]
        for arrived in waited:
            arrived.set()

    def wait(self, layer_id: int, timeout: float | None = None) -> None:
        """Consumer side: return once layer_id can be read by the caller's stream.

        CPU: blocks until the copy is done. CUDA: blocks until the copy is enqueued, then makes
        the current CUDA stream wait on it (the host does not wait for the GPU). Raises
        LayerWaitTimeout after `timeout` seconds, LayerLoadFailed if the producer failed before
        this layer landed.
        """
        self._check_layer(layer_id)
        with self._lock:
            arrived = None
            if layer_id not in self._loaded and self._error is None:
                arrived = self._arrived[layer_id]
                if arrived is None:
                    arrived = self._arrived[layer_id] = threading.Event()
        if arrived is not None and not arrived.wait(timeout):
            raise LayerWaitTimeout(f"layer {layer_id} did not arrive within {timeout} s")
        with self._lock:
            loaded = layer_id in self._loaded
            error = self._error
            cuda_event = self._cuda_events.get(layer_id)
        if not loaded:
            raise LayerLoadFailed(f"the load of layer {layer_id} failed: {error!r}") from error
        if cuda_event is not None:
            cuda_event.wait()

    def _check_layer(self, layer_id: int) -> None:
        if layer_id not in self._arrived:
            raise LayerIdOutOfRange(
                f"layer {layer_id} is not part of this load (layers {self.layer_ids})"
            )
