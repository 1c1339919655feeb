"""Device <-> host moves: merged writes (D2H, all layers) and layer-wise loads (H2D).

Writes waiting together are merged: their indices are concatenated per member and go to the
host mirror's `backup` in one call, which groups them into contiguous runs, so N small writes cost
one transfer. Loads are merged the same way and then walk the model's layers in order; after each
layer every merged op's `LoadHandle` is told that layer has arrived:

    worker   | L0 copy | L1 copy | L2 copy | ...
    forward            | attn L0 | attn L1 | attn L2 ...      (each waits only for its layer)

If a merged transfer raises, the ops are retried one by one from the layer that failed, so one
bad op fails alone (copies are idempotent: a page copied twice holds the same bytes).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from itertools import groupby
from typing import TypeVar

import numpy as np
import torch

from kvstrata.hybrid_cache.errors import LayerLoadFailed, UnknownLayer
from kvstrata.hybrid_cache.group import PoolGroup
from kvstrata.hybrid_cache.metrics import ControllerStats, Direction
from kvstrata.hybrid_cache.ops import AckStatus, OpKind, PageMove, PagePairs
from kvstrata.pool_host import LayerCompletion, LayerLoad
from kvstrata.pool_host.errors import LayerWaitTimeout

logger = logging.getLogger(__name__)

_Part = TypeVar("_Part")

Finish = Callable[[int, AckStatus, int, BaseException | None], None]
#: Acknowledge ops that all moved every page: (op id, pages) each, under one lock.
FinishDone = Callable[[list[tuple[int, int]]], None]


class LoadHandle:
    """The caller's view of one load: wait for a layer, or for all of them.

    Layers arrive in `HybridPool.layer_ids` order; a layer of a member the load does not move is
    ready at once. If the load fails, waits for layers that had not arrived raise
    LayerLoadFailed (layers that arrived before stay readable, but the op's Ack is failed, so the
    request must not use the load: its device slots hold partial data).
    """

    def __init__(self, *, op_id: int, completion: LayerCompletion, stats: ControllerStats) -> None:
        self.op_id = op_id
        self._completion = completion
        self._layers = frozenset(completion.layer_ids)
        self._last = max(self._layers, default=None)
        self._stats = stats
        self._error: BaseException | None = None

    def wait_layer(self, layer_id: int, timeout_s: float | None = None) -> bool:
        """Block until `layer_id`'s pages are usable: True, or False when `timeout_s` passed
        first. On CUDA it returns once the copy is enqueued, having made the current stream wait
        for it (the host does not wait for the GPU). UnknownLayer for a layer the model lacks;
        LayerLoadFailed when the load failed before this layer arrived."""
        if layer_id not in self._layers:
            raise UnknownLayer(layer_id, tuple(sorted(self._layers)))
        start = time.perf_counter()
        try:
            self._completion.wait(layer_id, timeout_s)
        except LayerWaitTimeout:
            return False
        except LayerLoadFailed as exc:
            raise LayerLoadFailed(
                f"load op {self.op_id} failed before layer {layer_id} arrived"
            ) from (self._error or exc)
        finally:
            self._stats.count_wait(time.perf_counter() - start)
        return True

    def wait_all(self, timeout_s: float | None = None) -> bool:
        """Wait for the last layer (layers arrive in order, so this waits for all)."""
        return True if self._last is None else self.wait_layer(self._last, timeout_s)

    def layer_arrived(self, layer_id: int) -> bool:
        """Whether `layer_id` was loaded (on CUDA: enqueued). Never blocks."""
        if layer_id not in self._layers:
            raise UnknownLayer(layer_id, tuple(sorted(self._layers)))
        return self._completion.is_loaded(layer_id)

    @property
    def failed(self) -> bool:
        return self._error is not None

    # Worker side.

    def mark_layer(self, layer_id: int, event: torch.cuda.Event | None) -> None:
        """`layer_id` has landed (CPU) or its copies are enqueued before `event` (CUDA)."""
        self._completion.mark_loaded(layer_id, event)

    def fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
            self._completion.fail(error)


@dataclass(kw_only=True, eq=False)
class WriteTask:
    op_id: int
    moves: dict[str, PageMove]
    num_pages: int
    #: Submitted with `trusted=True`: the host pool takes its pages without checks.
    trusted: bool = False
    #: Submitted as page ids (`TierController.submit_write_pages`, trusted): these, not
    #: `moves`, name what moves; one page plan per member, no index tensor anywhere.
    pages: Mapping[str, PagePairs] | None = None


@dataclass(kw_only=True, eq=False)
class LoadTask:
    op_id: int
    moves: dict[str, PageMove]
    num_pages: int
    handle: LoadHandle
    #: Submitted with `trusted=True`: the host pool takes its pages without checks.
    trusted: bool = False
    #: Submitted as page ids (`TierController.submit_load_pages`, trusted): these, not
    #: `moves`, name what moves, as for a WriteTask.
    pages: Mapping[str, PagePairs] | None = None

    @classmethod
    def admitted(
        cls,
        group: PoolGroup,
        stats: ControllerStats,
        op_id: int,
        moves: dict[str, PageMove],
        num_pages: int,
        trusted: bool,
        pages: Mapping[str, PagePairs] | None,
    ) -> LoadTask:
        """The task of an admitted load (its moves, or its page ids), with its handle: the
        layers of members it does not move are ready at once."""
        completion = group.completion(group.layers_of(moves if pages is None else pages))
        handle = LoadHandle(op_id=op_id, completion=completion, stats=stats)
        return cls(
            op_id=op_id,
            moves=moves,
            num_pages=num_pages,
            handle=handle,
            trusted=trusted,
            pages=pages,
        )

    @property
    def members(self) -> Mapping[str, object]:
        """What the task moves, per member (its page ids or its moves)."""
        return self.moves if self.pages is None else self.pages


@dataclass(kw_only=True, eq=False)
class TransferRunner:
    """Runs batches of write and load tasks on the write and load workers, with what the
    controller hands it."""

    group: PoolGroup
    stats: ControllerStats
    finish: Finish
    finish_done: FinishDone

    def run_writes(self, tasks: list[WriteTask]) -> None:
        self.stats.count_merged(OpKind.WRITE, len(tasks) - 1)
        if len(tasks) > 1:
            try:
                self._write_merged(tasks)
            except Exception:  # isolate the bad op: retried one by one below
                logger.info(
                    "merged write of %d ops failed; retrying each", len(tasks), exc_info=True
                )
            else:
                self._done(*tasks)
                return
        for t in tasks:
            try:
                if t.pages is not None:
                    self._write_pages(t.pages)
                else:
                    self._write(t.moves, t.trusted)
            except Exception as exc:  # reported in the op's ack
                logger.warning("write op %d failed", t.op_id, exc_info=True)
                self.finish(t.op_id, AckStatus.FAILED, 0, exc)
            else:
                self._done(t)

    def _done(self, *tasks: WriteTask | LoadTask) -> None:
        self.finish_done([(t.op_id, t.num_pages) for t in tasks])

    def run_loads(self, tasks: list[LoadTask]) -> None:
        """Merged when every task was submitted the same way (page ids, or moves); a mixed
        batch runs op by op, in queue order."""
        paged = [t.pages for t in tasks if t.pages is not None]
        mixed = 0 < len(paged) < len(tasks)
        self.stats.count_merged(OpKind.LOAD, 0 if mixed else len(tasks) - 1)
        start = 0
        if len(tasks) > 1 and not mixed:
            if paged:
                moves, pages = {}, _merge_pages(paged)
            else:
                moves, pages = _merge([t.moves for t in tasks]), None
            try:
                self._load(moves, pages, tasks, 0)
            except _LoadStopped as stop:  # isolate the bad op: retried one by one below
                logger.info(
                    "merged load of %d ops failed at layer position %d; retrying each",
                    len(tasks),
                    stop.position,
                    exc_info=True,
                )
                start = stop.position
            else:
                self._done(*tasks)
                return
        for t in tasks:
            try:
                self._load(t.moves, t.pages, [t], start)
            except _LoadStopped as stop:  # reported in the op's ack and to its waiters
                logger.warning("load op %d failed", t.op_id, exc_info=True)
                error = stop.__cause__ or stop
                t.handle.fail(error)
                self.finish(t.op_id, AckStatus.FAILED, 0, error)
            else:
                self._done(t)

    def _write_merged(self, tasks: list[WriteTask]) -> None:
        """One merged transfer per member of each run of consecutive tasks submitted the same
        way (page ids, or moves), the runs in queue order: two writes of one host page end
        with the newer one's bytes whichever API each came through."""
        for paged, run in groupby(tasks, key=lambda t: t.pages is not None):
            batch = list(run)
            if paged:
                pages = [t.pages for t in batch if t.pages is not None]
                self._write_pages(pages[0] if len(pages) == 1 else _merge_pages(pages))
            else:
                self._write(_merge([t.moves for t in batch]), all(t.trusted for t in batch))

    def _write_pages(self, pages: Mapping[str, PagePairs]) -> None:
        """D2H of trusted page ids: one host-pool page plan per member, nothing converted."""
        start = time.perf_counter()
        for name, (device, host) in pages.items():
            self.group.backup_pages(name, device, host)
        self._count(Direction.D2H, self.group.page_volume(pages), start)

    def _write(self, moves: dict[str, PageMove], trusted: bool) -> None:
        start = time.perf_counter()
        for name, move in moves.items():
            if trusted:
                self.group.backup(name, move.device, move.host, trusted=True)
            else:
                self.group.backup(name, move.device, move.host)
        self._count(Direction.D2H, self.group.volume(moves), start)

    def _load(
        self,
        moves: Mapping[str, PageMove],
        pages: Mapping[str, PagePairs] | None,
        tasks: list[LoadTask],
        first: int,
    ) -> None:
        """Load the layers from position `first` on (`moves` is the merge of the tasks', or
        `pages` when they were submitted as page ids), telling the tasks' handles as each
        layer arrives; raises _LoadStopped(position) from the error of the layer that failed.

        Consecutive layers of one member go to the host pool as one `load_layers` call, which
        checks the indices once instead of per layer (a full-only model: one call)."""
        layer_ids = self.group.layer_ids
        start = time.perf_counter()
        last: dict[str, LayerLoad] = {}
        trusted = all(t.trusted for t in tasks)
        for member, positions in self._runs(moves if pages is None else pages, first):
            fan_out = _LayerFanOut(
                {
                    self.group.layer_route(layer_ids[p]).local_layer_id: layer_ids[p]
                    for p in positions
                },
                [t.handle for t in tasks if member in t.members],
            )
            try:
                if pages is not None:  # page ids (trusted)
                    loads = self.group.load_pages(member, *pages[member], fan_out)
                elif trusted:
                    move = moves[member]
                    loads = self.group.load_layers(
                        member, move.host, move.device, fan_out, trusted=True
                    )
                else:
                    move = moves[member]
                    loads = self.group.load_layers(member, move.host, move.device, fan_out)
            except Exception as exc:
                raise _LoadStopped(positions[fan_out.num_marked]) from exc
            if loads:
                last[member] = loads[-1]
        # The ack promises the bytes are on the device: on CUDA wait for each member's last
        # copy (copies of one stream complete in order). A no-op on CPU.
        for done in last.values():
            done.wait()
        volume = self.group.volume(moves) if pages is None else self.group.page_volume(pages)
        self._count(Direction.H2D, volume, start)

    def _count(self, direction: Direction, volume: tuple[int, int], start: float) -> None:
        """Count one transfer of `volume` (pages, bytes) that began at `start`."""
        num_pages, num_bytes = volume
        self.stats.count_transfer(
            direction,
            num_pages=num_pages,
            num_bytes=num_bytes,
            seconds=time.perf_counter() - start,
        )

    def _runs(self, moves: Mapping[str, object], first: int) -> list[tuple[str, list[int]]]:
        """Layer positions from `first` on, of members in `moves`, cut into runs of one member.
        Layers of members not moved were marked at submit and do not cut a run."""
        runs: list[tuple[str, list[int]]] = []
        layer_ids = self.group.layer_ids
        for position in range(first, len(layer_ids)):
            member = self.group.layer_route(layer_ids[position]).member
            if member not in moves:
                continue
            if runs and runs[-1][0] == member:
                runs[-1][1].append(position)
            else:
                runs.append((member, [position]))
        return runs


class _LayerFanOut(LayerCompletion):
    """The completion one member's `HostPool.load_layers` marks, layer by layer (member-local
    ids): each mark is passed on, under the global layer id, to every handle of the load."""

    def __init__(self, global_of: dict[int, int], handles: list[LoadHandle]) -> None:
        super().__init__(global_of)
        self._global_of = global_of
        self._handles = handles
        self.num_marked = 0

    def mark_loaded(self, layer_id: int, event: torch.cuda.Event | None = None) -> None:
        super().mark_loaded(layer_id, event)
        for handle in self._handles:
            handle.mark_layer(self._global_of[layer_id], event)
        self.num_marked += 1


class _LoadStopped(Exception):
    """A load failed at layer `position` (its cause is the copy's error)."""

    def __init__(self, position: int) -> None:
        super().__init__(f"load stopped at layer position {position}")
        self.position = position


def _by_member(all_parts: list[Mapping[str, _Part]]) -> dict[str, list[_Part]]:
    """Each member's parts of several writes or loads, members in order of first appearance,
    parts in task order."""
    parts: dict[str, list[_Part]] = {}
    for moves in all_parts:
        for name, part in moves.items():
            parts.setdefault(name, []).append(part)
    return parts


def _merge_pages(all_pages: list[Mapping[str, PagePairs]]) -> dict[str, PagePairs]:
    """The page ids of several writes, concatenated per member (in task order)."""
    return {
        name: (np.concatenate([d for d, _ in parts]), np.concatenate([h for _, h in parts]))
        for name, parts in _by_member(all_pages).items()
    }


def _merge(all_moves: list[dict[str, PageMove]]) -> dict[str, PageMove]:
    return {
        name: PageMove(
            device=torch.cat([p.device for p in parts]), host=torch.cat([p.host for p in parts])
        )
        for name, parts in _by_member(list(all_moves)).items()
    }
