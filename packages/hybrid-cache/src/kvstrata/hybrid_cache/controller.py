"""TierController: runs the page moves between device, host and storage for one pool group.

    caller (tree)                     controller                           workers (threads)
    submit_write(WriteOp) -> id    -> validate, queue (bounded) -> write:    merged D2H backup
    submit_load(LoadOp) -> handle  ->                            -> load:     merged, layer-wise
    submit_prefetch(op) -> id|None -> + host share check         -> prefetch: exists, get batches
    submit_backup(BackupOp) -> id  ->                            -> backup:   exists, merged set
    poll_acks() / wait(id)         <- one Ack per op, kept until drained <- finish(op, status)

The tree commits only what an Ack says moved. Queues are bounded: a submit to a full queue raises
`QueueFull` and changes nothing; a prefetch that would take host pages in flight past
`prefetch_host_share` of a member's host pool is refused by returning None (nothing changes
either: the tree simply skips that prefetch). Validation errors raise before anything is queued.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvstrata.hybrid_cache.errors import (
    ControllerClosed,
    InvalidOperation,
    QueueFull,
    StorageNotConfigured,
    UnknownOperation,
)
from kvstrata.hybrid_cache.group import PoolGroup
from kvstrata.hybrid_cache.metrics import ControllerReading, ControllerStats
from kvstrata.hybrid_cache.ops import (
    Ack,
    AckStatus,
    BackupOp,
    LoadOp,
    OpKind,
    PageMove,
    PagePairs,
    PrefetchOp,
    PrefetchPolicy,
    PrefetchProgress,
    WriteOp,
)
from kvstrata.hybrid_cache.params import ControllerParams
from kvstrata.hybrid_cache.storage_io import BackupTask, PrefetchTask, StorageRunner
from kvstrata.hybrid_cache.transfers import LoadHandle, LoadTask, TransferRunner, WriteTask
from kvstrata.hybrid_cache.workers import OpQueue, Worker
from kvstrata.storage import Storage

__all__ = ["ControllerParams", "TierController"]

TaskT = TypeVar("TaskT", WriteTask, LoadTask, PrefetchTask, BackupTask)

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class _Pending:
    kind: OpKind
    num_pages: int
    inflight_pages: dict[str, int]
    prefetch: PrefetchTask | None = None


class _Lane(Generic[TaskT]):
    """One kind's queue and worker."""

    def __init__(
        self,
        *,
        kind: OpKind,
        params: ControllerParams,
        run_batch: Callable[[list[TaskT]], None],
        on_error: Callable[[list[TaskT], Exception], None],
        merges: bool,
    ) -> None:
        self.run_batch = run_batch
        self.on_error = on_error
        self.queue: OpQueue[TaskT] = OpQueue(kind=kind.value, capacity=params.queue_capacity)
        self.worker: Worker[TaskT] = Worker(
            name=f"kvstrata-tier-{kind.value}",
            queue=self.queue,
            run_batch=run_batch,
            on_error=on_error,
            max_batch=params.max_merge_ops if merges else 1,
            merges=lambda _first, _next: merges,
        )


class TierController:
    """Moves pages of one pool group between device, host and (optionally) storage.

    Thread-safe: submits, polls and waits may come from any thread. Start-up spawns one daemon
    worker per kind (write, load; prefetch and backup only with a storage); `close()` joins them.
    The workers hold the controller alive: close it (or use it as a context manager) when done.
    """

    def __init__(
        self,
        group: PoolGroup,
        *,
        storage: Storage | None = None,
        params: ControllerParams | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.group = group
        self.storage = storage
        self.params = params or ControllerParams()
        self.stats = ControllerStats()
        self._clock = clock
        self._lock = threading.Lock()
        self._acked = threading.Condition(self._lock)
        self._next_id = 1
        self._closed = False
        self._pending: dict[int, _Pending] = {}
        self._acks: dict[int, Ack] = {}  # finished, not yet handed out; insertion = finish order
        self._num_delivered: dict[OpKind, int] = dict.fromkeys(OpKind, 0)
        self._inflight: dict[str, int] = dict.fromkeys(group.member_names, 0)
        inline = self.params.run_inline
        if inline is None:
            inline = all(
                group.member(name).device.device.type == "cpu" for name in group.member_names
            )
        self._inline = inline
        self._inline_backups = inline and storage is not None and storage.in_process_memory
        self._inflight_limit: dict[str, int] = {
            name: int(self.params.prefetch_host_share * group.num_host_pages(name))
            for name in group.member_names
        }
        transfers = TransferRunner(
            group=group, stats=self.stats, finish=self._finish, finish_done=self._finish_done
        )
        self._write: _Lane[WriteTask] = _Lane(
            kind=OpKind.WRITE,
            params=self.params,
            run_batch=transfers.run_writes,
            on_error=self._fail_batch_of(OpKind.WRITE),
            merges=True,
        )
        self._load: _Lane[LoadTask] = _Lane(
            kind=OpKind.LOAD,
            params=self.params,
            run_batch=transfers.run_loads,
            on_error=self._fail_loads,
            merges=True,
        )
        self._prefetch: _Lane[PrefetchTask] | None = None
        self._backup: _Lane[BackupTask] | None = None
        if storage is not None:
            runner = StorageRunner(
                group=group,
                storage=storage,
                stats=self.stats,
                finish=self._finish,
                clock=clock,
                batch_pages=self.params.storage_batch_pages,
                call_timeout_s=self.params.storage_call_timeout_s,
                verify_checksums=self.params.verify_checksums,
            )
            self._prefetch = _Lane(
                kind=OpKind.PREFETCH,
                params=self.params,
                run_batch=runner.run_prefetches,
                on_error=self._fail_batch_of(OpKind.PREFETCH),
                merges=False,  # each prefetch has its own policy and deadline
            )
            self._backup = _Lane(
                kind=OpKind.BACKUP,
                params=self.params,
                run_batch=runner.run_backups,
                on_error=self._fail_batch_of(OpKind.BACKUP),
                merges=True,
            )
        for lane in self._lanes():
            lane.worker.start()

    # --- submits ---------------------------------------------------------------------------------

    def submit_write(self, op: WriteOp) -> int:
        """Queue a device -> host backup of all layers of the pages in `op.moves`; its op id.

        Raises InvalidOperation (bad indices), QueueFull or ControllerClosed before anything
        changes. The device pages must stay untouched until the ack."""
        moves, num_pages = self.group.check_moves(op.moves)
        with self._lock:
            op_id = self._admit(OpKind.WRITE, num_pages, self._write.queue)
            self._write.queue.put(WriteTask(op_id=op_id, moves=moves, num_pages=num_pages))
        return op_id

    def submit_writes(
        self, ops: Sequence[WriteOp], *, inline: bool = False, trusted: bool = False
    ) -> list[int | None]:
        """`submit_write` for each of `ops`, oldest first, with one wake-up of the write worker
        for the whole batch (it merges them). Returns the op ids; None for an op the queue had
        no room for (nothing of it changed). InvalidOperation for any op, or ControllerClosed,
        before anything changes. `inline=True` on a controller that `runs_inline`: the batch
        runs (merged) on this thread before the call returns.

        `trusted=True` is the tiers' path (their indices come from their own allocators over
        this group's pools): the caller vouches for what `check_moves` and the host pool's
        page plan would check (known members; 1-D int64 tensors of equal length; whole aligned
        pages in range; no device page 0; no destination page twice), and none of it is checked
        here or on the worker."""
        now = inline and self._inline
        # Run now, the moves are read before this returns: no defensive copies.
        if trusted:
            checked = [self.group.count_moves(op.moves, copy=not now) for op in ops]
        else:
            checked = [self.group.check_moves(op.moves, copy=not now) for op in ops]
        tasks = [
            WriteTask(op_id=0, moves=moves, num_pages=num_pages, trusted=trusted)
            for moves, num_pages in checked
        ]
        return self._submit_write_tasks(tasks, now)

    def submit_write_pages(
        self, ops: Sequence[Mapping[str, PagePairs]], *, inline: bool = False
    ) -> list[int | None]:
        """`submit_writes(..., trusted=True)` of writes given as page ids: per op, per member,
        (device page ids, host page ids) as NumPy int64 arrays of equal length. The tiers'
        path: the caller vouches for everything `check_moves` and the host pool's page plan
        would check (known members; in range; no device page 0; no host page twice), none of
        it is checked here or on the worker, and the pages go to the host pools' copy as they
        are (no index tensor is made). The arrays must stay unchanged until the op's ack (the
        batch runs before this returns with `inline=True` on a controller that
        `runs_inline`). Returns and raises as `submit_writes`; the same acks and counters."""
        tasks = [
            WriteTask(
                op_id=0,
                moves={},
                num_pages=sum(len(device) for device, _ in op.values()),
                trusted=True,
                pages=op,
            )
            for op in ops
        ]
        return self._submit_write_tasks(tasks, inline and self._inline)

    def _submit_write_tasks(self, tasks: list[WriteTask], now: bool) -> list[int | None]:
        """Admit `tasks` (op ids not yet given) oldest first: ids, None where the queue had no
        room; run the admitted batch on this thread when `now`, else queue it (one wake-up)."""
        ids: list[int | None] = []
        admitted: list[WriteTask] = []
        with self._lock:
            if self._closed:
                raise ControllerClosed(f"{OpKind.WRITE} submitted after close()")
            queue = self._write.queue
            room = queue.capacity - len(queue)
            for task in tasks:
                if not now and len(admitted) >= room:
                    ids.append(None)
                    continue
                task.op_id = self._admit(OpKind.WRITE, task.num_pages, None)
                admitted.append(task)
                ids.append(task.op_id)
            if admitted and not now:
                queue.put_all(admitted)
        if admitted and now:
            self._run_inline_batches(self._write, admitted)
        return ids

    @property
    def runs_inline(self) -> bool:
        """True when loads and prefetches submitted with `inline=True` run on the caller's
        thread (`ControllerParams.run_inline`)."""
        return self._inline

    def submit_load(self, op: LoadOp, *, inline: bool = False, trusted: bool = False) -> LoadHandle:
        """Queue a host -> device load, layer by layer in layer order; the handle's
        `wait_layer(layer_id)` returns once that layer is on the device. Raises as submit_write.
        The destination device slots must not be read before their layer's wait returns.

        `inline=True` (the caller waits for the whole load at once) on a controller that
        `runs_inline`: the load runs on this thread before the call returns; its ack waits for
        `wait` / `poll_acks` like a worker's. `trusted=True`: as for `submit_writes` (the
        destination device pages are the ones never given twice)."""
        now = inline and self._inline
        if trusted:
            moves, num_pages = self.group.count_moves(op.moves, copy=not now)
        else:
            moves, num_pages = self.group.check_moves(op.moves, copy=not now)
        return self._submit_load_task(now, moves, num_pages, trusted)

    def submit_load_pages(self, op: Mapping[str, PagePairs], *, inline: bool = False) -> LoadHandle:
        """`submit_load(trusted=True)` of page ids per member, (device, host) int64 arrays
        unchanged until the ack: as `submit_write_pages` for writes (the same vouching, no
        index tensor; on CPU a member's layers in one compiled copy); returns as submit_load."""
        num_pages = sum(len(device) for device, _ in op.values())
        return self._submit_load_task(inline and self._inline, {}, num_pages, True, op)

    def _submit_load_task(
        self,
        now: bool,
        moves: dict[str, PageMove],
        num_pages: int,
        trusted: bool,
        pages: Mapping[str, PagePairs] | None = None,
    ) -> LoadHandle:
        """Admit one load (its moves, or its page ids); run it here when `now`, else queue it."""
        with self._lock:
            op_id = self._admit(OpKind.LOAD, num_pages, None if now else self._load.queue)
            task = LoadTask.admitted(
                self.group, self.stats, op_id, moves, num_pages, trusted, pages
            )
            if not now:
                self._load.queue.put(task)
        if now:
            self._run_inline(self._load, [task])
        return task.handle

    def submit_prefetch(
        self, op: PrefetchOp, *, inline: bool = False, trusted: bool = False
    ) -> int | None:
        """Queue a storage -> host prefetch of `op.keys` into the caller's host pages.

        Returns the op id, or None (nothing changed; counted as refused) when the host pages
        it lists would take a member's pages in flight past `prefetch_host_share`. Raises
        StorageNotConfigured, InvalidOperation, QueueFull or ControllerClosed before anything
        changes. The listed host pages belong to the op until its ack.

        `inline=True` (the caller waits for its ack at once, under wait_complete) on a
        controller that `runs_inline`: the prefetch runs on this thread before the call returns
        (a best_effort or timeout prefetch should stay queued: its caller does not wait).

        `trusted=True` is the tiers' path, as for `submit_backup`: the caller vouches for what
        `check_keyed_pages` checks, and none of it is checked."""
        lane = self._storage_lane(self._prefetch)
        if trusted:
            pages = self.group.keyed_pages(op.host_pages)
        else:
            pages = self.group.check_keyed_pages(op.keys, op.host_pages)
        if op.num_tokens < 0:
            raise InvalidOperation(f"num_tokens must be >= 0, got {op.num_tokens}")
        wanted = {name: len(listed) - listed.count(None) for name, listed in pages.items()}
        with self._lock:
            if any(
                self._inflight[name] + num > self._inflight_limit[name]
                for name, num in wanted.items()
            ):
                self.stats.count_prefetch_refused()
                return None
            now = inline and self._inline
            op_id = self._admit(OpKind.PREFETCH, len(op.keys), None if now else lane.queue)
            deadline = None
            if op.policy is PrefetchPolicy.TIMEOUT:
                deadline = self._clock() + op.timeout.seconds(op.num_tokens)
            task = PrefetchTask(
                op_id=op_id, keys=tuple(op.keys), pages=pages, policy=op.policy, deadline=deadline
            )
            pending = self._pending[op_id]
            pending.inflight_pages = wanted
            pending.prefetch = task
            for name, num in wanted.items():
                self._inflight[name] += num
            if not now:
                lane.queue.put(task)
        if now:
            self._run_inline(lane, [task])
        return op_id

    def submit_backup(self, op: BackupOp, *, inline: bool = False, trusted: bool = False) -> int:
        """Queue a host -> storage backup of `op.keys`; keys already stored are skipped. Raises
        StorageNotConfigured, InvalidOperation, QueueFull or ControllerClosed before anything
        changes. The listed host pages must stay unchanged until the ack. `inline=True` on a
        controller that `runs_inline`, over storage that is `in_process_memory`: the backup
        runs on this thread before the call returns (its ack waits for `wait` / `poll_acks`
        like a worker's); a file or remote store keeps its worker, whose I/O overlaps.

        `trusted=True` is the tiers' path: the caller vouches for what `check_keyed_pages`
        checks (non-empty bytes keys; one entry per key for every member; host pages of its
        own allocators, in range, none twice in a member), and none of it is checked."""
        lane = self._storage_lane(self._backup)
        if trusted:
            pages = self.group.keyed_pages(op.host_pages)
        else:
            pages = self.group.check_keyed_pages(op.keys, op.host_pages)
        now = inline and self._inline_backups
        with self._lock:
            op_id = self._admit(OpKind.BACKUP, len(op.keys), None if now else lane.queue)
            task = BackupTask(op_id=op_id, keys=tuple(op.keys), pages=pages)
            if not now:
                lane.queue.put(task)
        if now:
            self._run_inline(lane, [task])
        return op_id

    def submit_backups(
        self, ops: Sequence[BackupOp], *, inline: bool = False, trusted: bool = False
    ) -> list[int | None]:
        """`submit_backup` for each of `ops`, oldest first, with one wake-up of the backup
        worker for the whole batch. Returns the op ids; None for an op the queue had no room
        for (nothing of it changed). StorageNotConfigured, InvalidOperation (any op) or
        ControllerClosed before anything changes. `inline=True` as for `submit_backup`: the
        batch runs (merged) on this thread before the call returns; `trusted=True` as for
        `submit_backup`."""
        lane = self._storage_lane(self._backup)
        if trusted:
            checked = [self.group.keyed_pages(op.host_pages) for op in ops]
        else:
            checked = [self.group.check_keyed_pages(op.keys, op.host_pages) for op in ops]
        now = inline and self._inline_backups
        ids: list[int | None] = []
        tasks: list[BackupTask] = []
        with self._lock:
            if self._closed:
                raise ControllerClosed(f"{OpKind.BACKUP} submitted after close()")
            room = lane.queue.capacity - len(lane.queue)
            for op, pages in zip(ops, checked, strict=True):
                if not now and len(tasks) >= room:
                    ids.append(None)
                    continue
                op_id = self._admit(OpKind.BACKUP, len(op.keys), None)
                tasks.append(BackupTask(op_id=op_id, keys=tuple(op.keys), pages=pages))
                ids.append(op_id)
            if tasks and not now:
                lane.queue.put_all(tasks)
        if tasks and now:
            self._run_inline_batches(lane, tasks)
        return ids

    # --- prefetch progress -----------------------------------------------------------------------

    def prefetch_progress(self, op_id: int) -> PrefetchProgress:
        """How much of a prefetch is usable now, and whether its policy lets the request take
        it. Mutates nothing. UnknownOperation once its ack has been handed out."""
        with self._lock:
            return self._progress(op_id)

    def stop_prefetch(self, op_id: int) -> PrefetchProgress:
        """Tell a prefetch to issue no further storage calls, and return what is usable now.

        Never blocks: a storage call already running finishes first, and the op's ack (which
        may report more pages than `num_pages_ready`) follows; the host pages past
        `num_pages_ready` stay the op's until then. Idempotent; UnknownOperation as above."""
        with self._lock:
            progress = self._progress(op_id)
            pending = self._pending.get(op_id)
            if pending is not None and pending.prefetch is not None:
                pending.prefetch.stop.set()
            return progress

    # --- acknowledgements ------------------------------------------------------------------------

    def poll_acks(self) -> list[Ack]:
        """Every acknowledgement not handed out yet, in the order the ops finished. Each ack is
        handed out exactly once (by this or by `wait`)."""
        with self._lock:
            acks = list(self._acks.values())
            self._acks.clear()
            for ack in acks:
                self._num_delivered[ack.kind] += 1
            return acks

    def wait(self, op_id: int, timeout_s: float | None = None) -> Ack | None:
        """Block until op `op_id` is acknowledged and hand its ack out (so `poll_acks` will not
        return it). None when `timeout_s` passes first (the op stays pending). UnknownOperation
        for an id never issued or already handed out."""
        start = time.perf_counter()
        with self._lock:
            if op_id not in self._acks and op_id not in self._pending:
                raise UnknownOperation(f"op {op_id} was never issued or its ack was handed out")
            arrived = self._acked.wait_for(lambda: op_id in self._acks, timeout_s)
            ack = self._acks.pop(op_id) if arrived else None
            if ack is not None:
                self._num_delivered[ack.kind] += 1
        self.stats.count_wait(time.perf_counter() - start)
        return ack

    def num_pending(self) -> int:
        """Operations submitted and not yet acknowledged."""
        with self._lock:
            return len(self._pending)

    def queue_depth(self, kind: OpKind) -> int:
        """Operations of `kind` waiting for their worker (not counting the one running)."""
        lane = self._lane(kind)
        return 0 if lane is None else len(lane.queue)

    def prefetch_inflight_pages(self) -> dict[str, int]:
        """Host pages per member held by prefetches not yet acknowledged."""
        with self._lock:
            return dict(self._inflight)

    # --- life cycle ------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """True once `close()` has begun: every submit raises ControllerClosed."""
        with self._lock:
            return self._closed

    def close(self, timeout_s: float | None = None) -> bool:
        """Refuse new submits, stop every prefetch (queued ones are acked partial with 0 pages),
        let writes, loads and backups already queued finish, and join the workers. Acks stay
        available to `poll_acks`. True when every worker exited within `timeout_s` (a worker
        blocked in a stalled storage call may outlive it). Idempotent."""
        with self._lock:
            if not self._closed:
                self._closed = True
                for pending in self._pending.values():
                    if pending.prefetch is not None:
                        pending.prefetch.stop.set()
        for lane in self._lanes():
            lane.queue.close()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        joined = True
        for lane in self._lanes():
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            joined = lane.worker.join(remaining) and joined
        return joined

    def __enter__(self) -> TierController:
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Close (waiting for the workers) whether or not the block raised."""
        self.close()

    # --- integrity and metrics -------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Assert the bookkeeping invariants:
        - an op is pending or has an undelivered ack, never both; ids are below the next id;
        - per kind: submitted == pending + acked, acked == delivered + undelivered;
        - in-flight host pages per member == the sum over pending prefetches, <= its limit;
        - queues hold at most their capacity; workers are alive until close."""
        with self._lock:
            snap = self.stats.snapshot()
            assert not (self._pending.keys() & self._acks.keys()), (
                f"ops both pending and acked: {sorted(self._pending.keys() & self._acks.keys())}"
            )
            assert all(0 < i < self._next_id for i in (*self._pending, *self._acks)), (
                "an op id outside the issued range"
            )
            for kind in OpKind:
                pending = sum(p.kind is kind for p in self._pending.values())
                undelivered = sum(a.kind is kind for a in self._acks.values())
                finished = sum(snap.finished[kind, s] for s in AckStatus)
                assert snap.submitted[kind] == pending + finished, (
                    f"{kind}: {snap.submitted[kind]} submitted != {pending} pending + "
                    f"{finished} acked (an op lost or acked twice)"
                )
                assert finished == self._num_delivered[kind] + undelivered, (
                    f"{kind}: {finished} acked != {self._num_delivered[kind]} delivered + "
                    f"{undelivered} waiting"
                )
            for name in self.group.member_names:
                held = sum(p.inflight_pages.get(name, 0) for p in self._pending.values())
                assert held == self._inflight[name], (
                    f"member {name}: in-flight count {self._inflight[name]} != {held} held"
                )
                assert held <= self._inflight_limit[name], (
                    f"member {name}: {held} prefetch pages in flight > limit "
                    f"{self._inflight_limit[name]}"
                )
            closed = self._closed
        for lane in self._lanes():
            assert len(lane.queue) <= lane.queue.capacity, f"{lane.queue.kind} queue over capacity"
            assert closed or lane.worker.alive, f"{lane.queue.kind} worker died"

    def metrics_reading(self) -> ControllerReading:
        """Counters, queue depths and in-flight pages, for TierControllerCollector."""
        return ControllerReading(
            stats=self.stats.snapshot(),
            queue_depth={kind: self.queue_depth(kind) for kind in OpKind},
            prefetch_inflight_pages=self.prefetch_inflight_pages(),
        )

    # --- internals -------------------------------------------------------------------------------

    def _admit(self, kind: OpKind, num_pages: int, queue: OpQueue[TaskT] | None) -> int:
        # Caller holds the lock: the room check and the put below happen atomically, and only
        # the worker removes items, so the put cannot fail after this returns. `queue` None:
        # the op runs inline (no queue slot).
        if self._closed:
            raise ControllerClosed(f"{kind} submitted after close()")
        if queue is not None and not queue.has_room():
            raise QueueFull(kind.value, queue.capacity)
        op_id = self._next_id
        self._next_id += 1
        self._pending[op_id] = _Pending(kind=kind, num_pages=num_pages, inflight_pages={})
        # Counted under the lock, so check_integrity sees pending + acked == submitted.
        self.stats.count_submitted(kind)
        return op_id

    def _finish(
        self, op_id: int, status: AckStatus, num_pages_done: int, error: BaseException | None
    ) -> None:
        """Acknowledge op `op_id` (worker threads). Exactly once per op."""
        with self._lock:
            self._record_ack(op_id, status, num_pages_done, error)
            self._acked.notify_all()

    def _record_ack(
        self, op_id: int, status: AckStatus, num_pages_done: int, error: BaseException | None
    ) -> None:
        # Caller holds the lock and wakes the waiters.
        pending = self._pending.pop(op_id, None)
        assert pending is not None, f"op {op_id} acknowledged twice or never submitted"
        for name, num in pending.inflight_pages.items():
            self._inflight[name] -= num
        ack = Ack(
            op_id=op_id,
            kind=pending.kind,
            status=status,
            num_pages=pending.num_pages,
            num_pages_done=num_pages_done,
            error=error,
        )
        self._acks[op_id] = ack
        self.stats.count_finished(ack.kind, status)

    def _finish_done(self, done: list[tuple[int, int]]) -> None:
        """`_finish(op_id, DONE, num_pages, None)` for each of `done` (op id, pages), under one
        lock and one wake-up of the waiters (a merged batch of writes or loads)."""
        with self._lock:
            for op_id, num_pages_done in done:
                self._record_ack(op_id, AckStatus.DONE, num_pages_done, None)
            self._acked.notify_all()

    def _run_inline_batches(self, lane: _Lane[TaskT], tasks: list[TaskT]) -> None:
        """`_run_inline` over `tasks` in batches of at most `max_merge_ops` (a worker's)."""
        step = self.params.max_merge_ops
        for lo in range(0, len(tasks), step):
            self._run_inline(lane, tasks[lo : lo + step])

    def _run_inline(self, lane: _Lane[TaskT], tasks: list[TaskT]) -> None:
        """Run admitted tasks as one batch on the caller's thread, exactly as their worker
        would: a raise from the batch function fails the ops (their acks report it) instead
        of escaping."""
        try:
            lane.run_batch(tasks)
        except Exception as exc:  # reported in the ops' acks, as a worker would
            logger.exception("inline %s batch raised", lane.queue.kind)
            lane.on_error(tasks, exc)

    def _is_pending(self, op_id: int) -> bool:
        with self._lock:
            return op_id in self._pending

    def _fail_batch_of(self, kind: OpKind) -> Callable[[list[TaskT], Exception], None]:
        def fail(batch: list[TaskT], exc: Exception) -> None:
            self.stats.count_worker_error(kind)
            for task in batch:
                if self._is_pending(task.op_id):
                    self._finish(task.op_id, AckStatus.FAILED, 0, exc)

        return fail

    def _fail_loads(self, batch: list[LoadTask], exc: Exception) -> None:
        for task in batch:
            if self._is_pending(task.op_id):  # wake its waiters before the failed ack
                task.handle.fail(exc)
        self._fail_batch_of(OpKind.LOAD)(batch, exc)

    def _progress(self, op_id: int) -> PrefetchProgress:
        # Caller holds the lock.
        pending = self._pending.get(op_id)
        ack = self._acks.get(op_id)
        if pending is not None and pending.prefetch is not None:
            task = pending.prefetch
            num_pages, num_ready, finished = pending.num_pages, task.ready_pages, False
            ready = task.policy is PrefetchPolicy.BEST_EFFORT or (
                task.deadline is not None and self._clock() >= task.deadline
            )
        elif ack is not None and ack.kind is OpKind.PREFETCH:
            num_pages, num_ready, finished, ready = ack.num_pages, ack.num_pages_done, True, True
        else:
            raise UnknownOperation(f"op {op_id} is not a prefetch in flight or awaiting delivery")
        return PrefetchProgress(
            op_id=op_id,
            num_pages=num_pages,
            num_pages_ready=num_ready,
            finished=finished,
            ready_to_take=ready,
        )

    def _storage_lane(self, lane: _Lane[TaskT] | None) -> _Lane[TaskT]:
        if lane is None:
            raise StorageNotConfigured("this TierController was built without a storage backend")
        return lane

    def _lane(
        self, kind: OpKind
    ) -> _Lane[WriteTask] | _Lane[LoadTask] | _Lane[PrefetchTask] | _Lane[BackupTask] | None:
        return {
            OpKind.WRITE: self._write,
            OpKind.LOAD: self._load,
            OpKind.PREFETCH: self._prefetch,
            OpKind.BACKUP: self._backup,
        }[kind]

    def _lanes(
        self,
    ) -> list[_Lane[WriteTask] | _Lane[LoadTask] | _Lane[PrefetchTask] | _Lane[BackupTask]]:
        lanes = [self._write, self._load, self._prefetch, self._backup]
        return [lane for lane in lanes if lane is not None]
