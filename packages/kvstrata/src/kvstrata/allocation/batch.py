"""`BatchAllocator`: per-batch KV allocation as a scheduler calls it, over one `PrefixCache`.

    admit(tokens)            a request-table row, match + lock through the cache (the hit's
                             slots written into the row), a Mamba state slot (zeroed when new)
    prepare_extend(chunks)   slots for the next tokens of each request: its partial last page
                             first, then whole pages from ONE cache.alloc_tokens call for the
                             batch (which evicts when short); ONE table write; -> ExtendBatch
    cache_chunk(r)           chunked prefill: the cache keeps the whole pages computed so far;
                             the row's prefix is rewritten to the cache's slots
    prepare_decode(batch)    ONE alloc_decode on the paged allocator for the whole batch (last
                             slots read from the table in one gather), ONE scatter into the
                             table; -> DecodeBatch. No per-request tensor work: the decoded
                             slots reach the cache's request lazily (finish / retract / chunk)
    finish(r)                cache + release (insert the whole pages, unlock), free the row
    retract(r)               the same (the computed prefix stays cached, evictable), and the
                             tokens to admit again later
    abort(r)                 drop without caching, free the row

A paged allocator hands out whole pages whose slots are consecutive (`page * P + offset`), so a
request's partial last page belongs to it: the next token of the request takes `last + 1`
there. Out of memory is not an error: `prepare_*` return None and change nothing (what an
eviction freed stays free).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from kvstrata.allocation.errors import ContextTooLong, InvalidBatch, InvalidSetup
from kvstrata.allocation.results import DecodeBatch, ExtendBatch, Running
from kvstrata.allocator import PagedAllocator, SWAAllocator
from kvstrata.pool import ReqToTokenPool
from kvstrata.unified_radix_cache import PrefixCache, RadixKey


class StatePool(Protocol):
    """What admission needs of a Mamba pool: zero a new request's state."""

    def clear(self, slots: torch.Tensor) -> None: ...


class BatchAllocator:
    """Batches of running requests over `cache` (a `PrefixCache`), `kv_allocator` (the one the
    cache frees into: `alloc_decode` is called on it directly) and `req_to_token`.

    `state_pool`: the Mamba pool when the model has Mamba layers (each request then holds one
    state slot; a new one is zeroed through `state_pool.clear`). Not thread-safe: the scheduler
    thread only.
    """

    def __init__(
        self,
        cache: PrefixCache,
        *,
        kv_allocator: PagedAllocator | SWAAllocator,
        req_to_token: ReqToTokenPool,
        state_pool: StatePool | None = None,
    ) -> None:
        if kv_allocator.page_size != cache.page_size:
            raise InvalidSetup(
                f"allocator page size {kv_allocator.page_size} != cache page size {cache.page_size}"
            )
        self.cache = cache
        self.kv_allocator = kv_allocator
        self.req_to_token = req_to_token
        self.state_pool = state_pool
        self.page_size = cache.page_size
        self._swa = kv_allocator if isinstance(kv_allocator, SWAAllocator) else None
        self._running: dict[int, Running] = {}  # row -> request

    # ------------------------------------------------------------------------------------------
    # Admission and the end of a request
    # ------------------------------------------------------------------------------------------
    @property
    def running(self) -> tuple[Running, ...]:
        """The admitted requests not yet finished, retracted or aborted."""
        return tuple(self._running.values())

    def admit(self, tokens: Sequence[int], *, priority: int = 0) -> Running | None:
        """Admit a request of `tokens` (its prompt, or prompt + decoded tokens after a
        retraction): one table row, the cache's match (at most len - 1 tokens) locked and
        written into the row, and a state slot with Mamba layers. None, changing nothing, when
        no row or state slot is free even after eviction. ContextTooLong, InvalidBatch (no
        tokens) first."""
        ids = [int(t) for t in tokens]
        if not ids:
            raise InvalidBatch("a request needs at least one token")
        if len(ids) > self.req_to_token.max_context_len:
            raise ContextTooLong(
                f"{len(ids)} tokens > max_context_len {self.req_to_token.max_context_len}"
            )
        rows = self.req_to_token.alloc(1)
        if rows is None:
            return None
        row = int(rows[0])
        cache = self.cache
        req = cache.begin_request(RadixKey(tuple(ids)), priority=priority)  # the key never changes
        if self.state_pool is not None and req.state_slot is None:
            slot = cache.alloc_state()
            if slot is None:
                cache.abort_request(req)
                self.req_to_token.free(row)
                return None
            self.state_pool.clear(slot)
            req.state_slot = slot
        hit = req.cached_len
        if hit:
            self.req_to_token.write(row, 0, req.kv_indices[:hit])
        running = Running(cache_req=req, row=row, tokens=ids, seq_len=hit, hit_len=hit)
        self._running[row] = running
        return running

    def finish(self, running: Running) -> None:
        """The request is done: the cache keeps its whole computed pages (and its state where
        one can be kept), frees the rest and unlocks; the row is freed."""
        self._check_batch([running])
        self._sync(running)
        self.cache.cache_finished_request(running.cache_req)
        self._close(running)

    def retract(self, running: Running) -> list[int]:
        """Take a running request off the device under memory pressure: what it computed is
        cached (whole pages, unlocked, so evictable) and its own slots, state and row are freed.
        Returns its tokens: `admit` them later to resume (the cached prefix is matched again;
        the rest is recomputed)."""
        self.finish(running)
        return list(running.tokens)

    def abort(self, running: Running) -> None:
        """Drop the request without caching anything it computed; free its row."""
        self._check_batch([running])
        self._sync(running)
        self.cache.abort_request(running.cache_req)
        self._close(running)

    # ------------------------------------------------------------------------------------------
    # Extend
    # ------------------------------------------------------------------------------------------
    def prepare_extend(self, chunks: Sequence[tuple[Running, int]]) -> ExtendBatch | None:
        """Slots for the next `n` known tokens of each `(running, n)`, written into the table.

        Each request first fills its partial last page, then takes whole pages; the pages of the
        whole batch come from one `cache.alloc_tokens` call, which evicts unlocked cached data
        when the allocator is short. None, changing nothing, when even eviction leaves no
        room. InvalidBatch / ContextTooLong first (nothing changed)."""
        batch = [r for r, _ in chunks]
        self._check_batch(batch)
        lens = [int(n) for _, n in chunks]
        for r, n in zip(batch, lens, strict=True):
            if n < 1 or r.seq_len + n > len(r.tokens):
                raise InvalidBatch(
                    f"row {r.row}: a chunk of {n} tokens at {r.seq_len} of {len(r.tokens)}"
                )
        page = self.page_size
        fills = [
            0 if r.seq_len % page == 0 else min(n, page - r.seq_len % page)
            for r, n in zip(batch, lens, strict=True)
        ]
        pages = [-(-(n - f) // page) for n, f in zip(lens, fills, strict=True)]
        total = sum(pages) * page
        fresh = self.cache.alloc_tokens(total) if total else self._empty()
        if fresh is None:
            return None
        parts: list[torch.Tensor] = []
        offset = 0
        for r, n, fill, num_pages in zip(batch, lens, fills, pages, strict=True):
            self._sync(r)
            own = fresh[offset : offset + n - fill]
            offset += num_pages * page
            if fill:
                last = int(r.cache_req.kv_indices[-1])
                own = torch.cat([torch.arange(last + 1, last + 1 + fill, device=own.device), own])
            parts.append(own)
        out = torch.cat(parts) if parts else self._empty()
        prefix = torch.tensor([r.seq_len for r in batch], dtype=torch.int64)
        extend = torch.tensor(lens, dtype=torch.int64)
        rows = torch.tensor([r.row for r in batch], dtype=torch.int64)
        self.req_to_token.write(rows, prefix, out, lengths=extend)
        for r, own in zip(batch, parts, strict=True):
            r.cache_req.extend(own, self._new_key_tokens(r, r.seq_len + len(own)))
            r.seq_len += len(own)
        return ExtendBatch(
            rows=rows,
            prefix_lens=prefix,
            extend_lens=extend,
            seq_lens=prefix + extend,
            out_cache_loc=out,
            swa_cache_loc=None if self._swa is None else self._swa.translate(out),
            state_slots=self._states(batch),
        )

    def cache_chunk(self, running: Running) -> None:
        """After a chunk of a prefill: the cache keeps the whole pages that have KV (and a copy
        of the state at a page boundary), frees the request's duplicates of what it already
        had and moves the lock; the row's prefix is rewritten to the cache's slots."""
        self._check_batch([running])
        self._sync(running)
        req = running.cache_req
        self.cache.cache_unfinished_request(req)
        if req.cached_len:
            self.req_to_token.write(running.row, 0, req.kv_indices[: req.cached_len])

    # ------------------------------------------------------------------------------------------
    # Decode
    # ------------------------------------------------------------------------------------------
    def prepare_decode(
        self, batch: Sequence[Running], next_tokens: Sequence[int]
    ) -> DecodeBatch | None:
        """One new token per request: `next_tokens[i]` (the token sampled last) is appended to
        request i and gets a KV slot at position `seq_len`.

        One `alloc_decode` for the batch (a request starting a page takes a new one; the others
        `last + 1`), the last slots read from the table in one gather and the new ones written
        in one scatter. When pages run out, the cache evicts what the batch's new pages need
        (one alloc_tokens + release) and the allocation is retried once. None, changing
        nothing but that eviction, when there is still no room. InvalidBatch (a request not
        prefilled, a token count that differs) / ContextTooLong first."""
        self._check_batch(batch)
        if len(next_tokens) != len(batch):
            raise InvalidBatch(f"{len(next_tokens)} tokens for {len(batch)} requests")
        limit = self.req_to_token.max_context_len
        for r in batch:
            if not r.prefilled:
                raise InvalidBatch(f"row {r.row}: {len(r.tokens) - r.seq_len} tokens not prefilled")
            if r.seq_len + 1 > limit:
                raise ContextTooLong(f"row {r.row}: {r.seq_len + 1} tokens > {limit}")
        table = self.req_to_token.req_to_token
        rows = torch.tensor([r.row for r in batch], dtype=torch.int64)
        seq = torch.tensor([r.seq_len for r in batch], dtype=torch.int64)
        dev_rows, dev_seq = rows.to(table.device), seq.to(table.device)
        last = table[dev_rows, dev_seq - 1].to(torch.int64)
        out = self.kv_allocator.alloc_decode(dev_seq + 1, last)
        if out is None:
            need = int((seq % self.page_size == 0).sum()) * self.page_size
            room = self.cache.alloc_tokens(need) if need else None
            if room is None:
                return None
            self.cache.release(room)
            out = self.kv_allocator.alloc_decode(dev_seq + 1, last)
            if out is None:
                return None
        table[dev_rows, dev_seq] = out.to(table.dtype)
        for r, token in zip(batch, next_tokens, strict=True):
            r.tokens.append(int(token))
            r.seq_len += 1
        return DecodeBatch(
            rows=rows,
            seq_lens=seq + 1,
            out_cache_loc=out,
            swa_cache_loc=None if self._swa is None else self._swa.translate(out),
            state_slots=self._states(batch),
        )

    # ------------------------------------------------------------------------------------------
    # Integrity
    # ------------------------------------------------------------------------------------------
    def held(self) -> dict[str, int]:
        """Slots the running requests hold outside the cache, per component (`req.held()`
        summed), for the tree's conservation check. Hands decoded slots to the cache's
        requests first (no change visible to the cache's accounting)."""
        total: dict[str, int] = {}
        for r in self._running.values():
            self._sync(r)
            for name, n in r.cache_req.held().items():
                total[name] = total.get(name, 0) + n
        return total

    def check_integrity(self) -> None:
        """Assert (AssertionError): every running request's row is allocated and holds exactly
        its slots, its cache request is open and as long as `seq_len`; rows are distinct. Use
        with the tree's `check_integrity(held=self.held())`. O(total tokens)."""
        table = self.req_to_token.req_to_token
        for row, r in self._running.items():
            assert r.row == row and not r.finished, f"row {row}: bookkeeping"
            req = r.cache_req
            assert not req.finished, f"row {row}: the cache request is finished"
            self._sync(r)
            assert len(req.kv_indices) == r.seq_len, f"row {row}: {len(req.kv_indices)} slots"
            assert len(req.key) >= r.seq_len, f"row {row}: key shorter than its KV"
            assert r.seq_len <= len(r.tokens), f"row {row}: KV past the known tokens"
            slots = table[row, : r.seq_len].to(torch.int64).cpu()
            assert torch.equal(slots, req.kv_indices.cpu().to(torch.int64)), f"row {row}: table"
        assert self.req_to_token.num_used == len(self._running), "rows leaked"

    # ------------------------------------------------------------------------------------------
    # Internals
    # ------------------------------------------------------------------------------------------
    def _check_batch(self, batch: Sequence[Running]) -> None:
        if not batch:
            raise InvalidBatch("an empty batch")
        seen: set[int] = set()
        for r in batch:
            if r.finished or self._running.get(r.row) is not r:
                raise InvalidBatch(f"row {r.row}: not a running request of this allocator")
            if r.row in seen:
                raise InvalidBatch(f"row {r.row}: listed twice")
            seen.add(r.row)

    def _sync(self, r: Running) -> None:
        """Hand the slots decode wrote into the table (and their tokens) to the cache's
        request, which finish / chunk / integrity read."""
        req = r.cache_req
        n = len(req.kv_indices)
        if n < r.seq_len:
            slots = self.req_to_token.req_to_token[r.row, n : r.seq_len].to(torch.int64)
            req.extend(slots.to(req.kv_indices.device), self._new_key_tokens(r, r.seq_len))

    @staticmethod
    def _new_key_tokens(r: Running, upto: int) -> list[int] | None:
        """Tokens the cache request's key lacks to cover `upto` tokens of KV."""
        have = len(r.cache_req.key)
        return r.tokens[have:upto] if upto > have else None

    def _states(self, batch: Sequence[Running]) -> torch.Tensor | None:
        if self.state_pool is None:
            return None
        return torch.tensor([r.state_slot for r in batch], dtype=torch.int64)

    def _close(self, running: Running) -> None:
        running.finished = True
        del self._running[running.row]
        self.req_to_token.free(running.row)

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.req_to_token.device)
