"""Hypothesis state machines: random alloc / alloc_extend / alloc_decode / free / free groups /
backup-restore sequences, with `check_integrity()` and a layout model checked after every step.

Each machine drives several allocators in lockstep: numpy checked (the reference), torch
checked, numpy unchecked and, for paged machines, numpy checked without the compiled decode
round (`kvstrata.pool.native.disabled()`; the others use it when a C compiler exists). Every
valid operation must return identical indices from all of them, so the backends and the
unchecked path are tested against each other as well.

The model keeps each request's slots in token order. After every step it checks, from scratch:
token t of a request sits at offset t % P of its page; a request's tokens of one page index
share one page and different page indices use different pages; no page belongs to two owners
(requests, raw allocations, frees pending in a group); and available_size == free pages * P.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstrata.allocator import (
    AllocatorState,
    DoubleFree,
    MambaSlotAllocator,
    PagedAllocator,
    SWAAllocator,
)
from kvstrata.pool import native
from kvstrata.testkit.allocators import idx, make_mamba, make_paged, make_swa

NUM_PAGES = 12

#: Each machine drives 2-3 allocators per step; half the profile's examples keeps the five
#: machines within ~20 s on the 2-core CI box (the `thorough` profile still scales them up).
MACHINE_SETTINGS = settings(max_examples=max(10, settings.default.max_examples // 2))


@dataclass
class Model:
    """What the caller holds: per request its slots in token order; raw allocations."""

    requests: dict[int, list[int]] = field(default_factory=dict)
    raw: list[list[int]] = field(default_factory=list)
    pending: set[int] = field(default_factory=set)
    freed: list[list[int]] = field(default_factory=list)
    next_id: int = 0


def owned_pages(slots: list[int], page_size: int) -> set[int]:
    return {s // page_size for s in slots}


def check_layout(slots: list[int], page_size: int, what: str, first: int = 0) -> None:
    """Token t (numbered from `first`) at offset t % P; one page per page index, distinct
    across page indices."""
    by_index: dict[int, set[int]] = {}
    for t, slot in enumerate(slots, start=first):
        assert slot % page_size == t % page_size, f"{what}: token {t} at slot {slot}"
        by_index.setdefault(t // page_size, set()).add(slot // page_size)
    pages = [next(iter(p)) for p in by_index.values()]
    assert all(len(p) == 1 for p in by_index.values()), f"{what}: page index split over pages"
    assert len(set(pages)) == len(pages), f"{what}: two page indices share a page"


class PagedMachine(RuleBasedStateMachine):
    """Base machine; subclasses pick the page size and mode."""

    page_size = 4
    sorted_reuse = False

    def __init__(self) -> None:
        super().__init__()
        kwargs = {"page_size": self.page_size, "num_pages": NUM_PAGES}
        self.allocs: list[PagedAllocator] = [
            make_paged(backend="numpy", sorted_reuse=self.sorted_reuse, **kwargs),
            make_paged(backend="torch", sorted_reuse=self.sorted_reuse, **kwargs),
            make_paged(backend="numpy", sorted_reuse=self.sorted_reuse, checked=False, **kwargs),
        ]
        with native.disabled():  # the fused NumPy path, where the others run the C round
            self.allocs.append(
                make_paged(backend="numpy", sorted_reuse=self.sorted_reuse, **kwargs)
            )
        self.model = Model()
        self.group_open = False
        self.saved: tuple[list[AllocatorState], Model] | None = None

    # ---- helpers --------------------------------------------------------------------------

    def held_pages(self) -> set[int]:
        pages: set[int] = set()
        owners = [*self.model.requests.values(), *self.model.raw]
        for slots in owners:
            mine = owned_pages(slots, self.page_size)
            assert not pages & mine, f"page handed out twice: {sorted(pages & mine)}"
            pages |= mine
        return pages

    def free_page_count(self) -> int:
        return NUM_PAGES - len(self.held_pages()) - len(self.model.pending)

    def same(self, results: list[torch.Tensor | None]) -> torch.Tensor | None:
        first = results[0]
        for other in results[1:]:
            if first is None or other is None:
                assert first is None and other is None, "backends disagree on success"
            else:
                assert torch.equal(first, other), f"backends disagree: {first} vs {other}"
        return first

    def do_free(self, slots: list[int]) -> None:
        for a in self.allocs:
            a.free(idx(slots))
        pages = owned_pages(slots, self.page_size)
        if self.group_open:
            self.model.pending |= pages
        self.model.freed.append(slots)

    # ---- rules ----------------------------------------------------------------------------

    @rule(data=st.data(), num_new=st.integers(0, 3))
    def extend(self, data: st.DataObject, num_new: int) -> None:
        size = self.page_size
        ids = data.draw(st.lists(st.sampled_from(sorted(self.model.requests) or [-1]), unique=True))
        ids = [i for i in ids if i >= 0]
        prefix = [len(self.model.requests[i]) for i in ids] + [0] * num_new
        ext = [
            data.draw(st.integers(0 if i < len(ids) else 1, 3 * size)) for i in range(len(prefix))
        ]
        last = [self.model.requests[i][-1] for i in ids] + [-1] * num_new
        seq = [p + e for p, e in zip(prefix, ext, strict=True)]
        need = sum(-(-s // size) - -(-p // size) for p, s in zip(prefix, seq, strict=True))
        out = self.same(
            [a.alloc_extend(idx(prefix), idx(seq), idx(last), sum(ext)) for a in self.allocs]
        )
        if need > self.free_page_count():
            assert out is None
            return
        assert out is not None and out.numel() == sum(ext)
        slots, pos = out.tolist(), 0
        for i, e in zip(ids, ext, strict=False):
            self.model.requests[i] += slots[pos : pos + e]
            pos += e
        for e in ext[len(ids) :]:
            self.model.requests[self.model.next_id] = slots[pos : pos + e]
            self.model.next_id += 1
            pos += e

    @rule(data=st.data(), num_new=st.integers(0, 3))
    def decode(self, data: st.DataObject, num_new: int) -> None:
        size = self.page_size
        ids = data.draw(st.lists(st.sampled_from(sorted(self.model.requests) or [-1]), unique=True))
        ids = [i for i in ids if i >= 0]
        seq = [len(self.model.requests[i]) + 1 for i in ids] + [1] * num_new
        last = [self.model.requests[i][-1] for i in ids] + [-1] * num_new
        need = sum((s - 1) % size == 0 for s in seq)
        out = self.same([a.alloc_decode(idx(seq), idx(last)) for a in self.allocs])
        if need > self.free_page_count():
            assert out is None
            return
        assert out is not None
        slots = out.tolist()
        for i, slot in zip(ids, slots, strict=False):
            self.model.requests[i].append(slot)
        for slot in slots[len(ids) :]:
            self.model.requests[self.model.next_id] = [slot]
            self.model.next_id += 1

    @rule(num_pages=st.integers(0, 4))
    def alloc_raw(self, num_pages: int) -> None:
        out = self.same([a.alloc(num_pages * self.page_size) for a in self.allocs])
        if num_pages > self.free_page_count():
            assert out is None
        else:
            assert out is not None
            self.model.raw.append(out.tolist())

    @precondition(lambda self: bool(self.model.requests))
    @rule(data=st.data())
    def free_request(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.model.requests)))
        slots = data.draw(st.permutations(self.model.requests.pop(rid)))
        self.do_free(slots)

    @precondition(lambda self: bool(self.model.raw))
    @rule(data=st.data(), by_page=st.booleans())
    def free_raw(self, data: st.DataObject, by_page: bool) -> None:
        slots = self.model.raw.pop(data.draw(st.integers(0, len(self.model.raw) - 1)))
        if not by_page:
            self.do_free(slots)
            return
        pages = sorted(owned_pages(slots, self.page_size))
        for a in self.allocs:
            a.free_pages(idx(pages))
        if self.group_open:
            self.model.pending |= set(pages)
        self.model.freed.append(slots)

    @precondition(lambda self: bool(self.model.freed) and bool(self.model.freed[-1]))
    @rule()
    def double_free_is_refused(self) -> None:
        slots = self.model.freed[-1]
        before = [a.available_size() for a in self.allocs]
        for a in self.allocs:
            if a.checked and not owned_pages(slots, self.page_size) & self.held_pages():
                with pytest.raises(DoubleFree):
                    a.free(idx(slots))
        assert [a.available_size() for a in self.allocs] == before

    @precondition(lambda self: not self.group_open)
    @rule()
    def begin_group(self) -> None:
        for a in self.allocs:
            a.free_group_begin()
        self.group_open = True

    @precondition(lambda self: self.group_open)
    @rule()
    def end_group(self) -> None:
        for a in self.allocs:
            a.free_group_end()
        self.group_open = False
        self.model.pending = set()

    @precondition(lambda self: not self.group_open)
    @rule()
    def backup(self) -> None:
        self.saved = ([a.backup_state() for a in self.allocs], copy.deepcopy(self.model))

    @precondition(lambda self: not self.group_open and self.saved is not None)
    @rule()
    def restore(self) -> None:
        assert self.saved is not None
        states, model = self.saved
        for a, s in zip(self.allocs, states, strict=True):
            a.restore_state(s)
        self.model = copy.deepcopy(model)
        self.model.freed = []

    @rule()
    def clear_sometimes(self) -> None:
        if len(self.model.requests) < 6:
            return
        for a in self.allocs:
            a.clear()
        self.model = Model(next_id=self.model.next_id)
        self.group_open = False
        self.saved = None

    # ---- invariants -----------------------------------------------------------------------

    @invariant()
    def integrity(self) -> None:
        for a in self.allocs:
            a.check_integrity()
        for rid, slots in self.model.requests.items():
            check_layout(slots, self.page_size, f"request {rid}")
        assert not self.held_pages() & self.model.pending
        expected = self.free_page_count() * self.page_size
        assert [a.available_size() for a in self.allocs] == [expected] * len(self.allocs)


class PagedPage4(PagedMachine):
    page_size = 4


class PagedPage4Sorted(PagedMachine):
    page_size = 4
    sorted_reuse = True


class TokenPage1(PagedMachine):
    page_size = 1


TestPagedPage4 = PagedPage4.TestCase
TestPagedPage4.settings = MACHINE_SETTINGS
TestPagedPage4Sorted = PagedPage4Sorted.TestCase
TestPagedPage4Sorted.settings = MACHINE_SETTINGS
TestTokenPage1 = TokenPage1.TestCase
TestTokenPage1.settings = MACHINE_SETTINGS


class SWAMachine(RuleBasedStateMachine):
    """SWA in lockstep on both backends: requests extend and decode, slide their window
    (free_swa of their oldest pages), and are freed."""

    page_size = 2

    def __init__(self) -> None:
        super().__init__()
        kwargs = {"page_size": self.page_size, "num_pages": NUM_PAGES, "num_swa_pages": 6}
        self.allocs: list[SWAAllocator] = [
            make_swa(backend="numpy", **kwargs),
            make_swa(backend="torch", **kwargs),
        ]
        self.requests: dict[int, list[int]] = {}
        #: Per request, how many leading pages have released their SWA slots.
        self.slid: dict[int, int] = {}
        self.next_id = 0
        self.group_open = False
        self.saved: tuple[list[AllocatorState], dict[int, list[int]], dict[int, int]] | None = None

    def same(self, results: list[torch.Tensor | None]) -> torch.Tensor | None:
        first = results[0]
        for other in results[1:]:
            assert (first is None) == (other is None), "backends disagree on success"
            if first is not None and other is not None:
                assert torch.equal(first, other)
        return first

    def live_ids(self) -> list[int]:
        # A request whose last page lost its SWA slots cannot continue that page.
        size = self.page_size
        return sorted(i for i, s in self.requests.items() if self.slid[i] * size <= len(s) - 1)

    @rule(data=st.data(), num_new=st.integers(0, 2), decode=st.booleans())
    def grow(self, data: st.DataObject, num_new: int, decode: bool) -> None:
        ids = data.draw(st.lists(st.sampled_from(self.live_ids() or [-1]), unique=True))
        ids = [i for i in ids if i >= 0]
        prefix = [len(self.requests[i]) for i in ids] + [0] * num_new
        last = [self.requests[i][-1] for i in ids] + [-1] * num_new
        free_pages = self.allocs[0].available_size() // self.page_size
        if decode:
            seq = [p + 1 for p in prefix]
            out = self.same([a.alloc_decode(idx(seq), idx(last)) for a in self.allocs])
        else:
            ext = [data.draw(st.integers(1, 5)) for _ in prefix]
            seq = [p + e for p, e in zip(prefix, ext, strict=True)]
            out = self.same([a.alloc_extend(idx(prefix), idx(seq), idx(last)) for a in self.allocs])
        size = self.page_size
        need = sum(-(-s // size) - -(-p // size) for p, s in zip(prefix, seq, strict=True))
        if need > free_pages:
            assert out is None
            return
        assert out is not None
        slots, pos = out.tolist(), 0
        for i, p, s in zip(ids + [None] * num_new, prefix, seq, strict=True):
            new = slots[pos : pos + s - p]
            pos += s - p
            if i is None:
                i = self.next_id
                self.next_id += 1
                self.requests[i], self.slid[i] = [], 0
            self.requests[i] += new

    @precondition(lambda self: bool(self.requests))
    @rule(data=st.data())
    def slide_window(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.requests)))
        slots, size = self.requests[rid], self.page_size
        upto = data.draw(st.integers(self.slid[rid], -(-len(slots) // size)))
        for a in self.allocs:
            a.free_swa(idx(slots[self.slid[rid] * size : upto * size]))
        self.slid[rid] = upto

    @precondition(lambda self: bool(self.requests))
    @rule(data=st.data())
    def free_request(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.requests)))
        slots = self.requests.pop(rid)
        del self.slid[rid]
        for a in self.allocs:
            a.free(idx(slots))

    @rule()
    def toggle_group(self) -> None:
        for a in self.allocs:
            if self.group_open:
                a.free_group_end()
            else:
                a.free_group_begin()
        self.group_open = not self.group_open

    @precondition(lambda self: not self.group_open)
    @rule(restore=st.booleans())
    def backup_or_restore(self, restore: bool) -> None:
        if restore and self.saved is not None:
            states, requests, slid = self.saved
            for a, s in zip(self.allocs, states, strict=True):
                a.restore_state(s)
            self.requests, self.slid = copy.deepcopy(requests), dict(slid)
        else:
            states = [a.backup_state() for a in self.allocs]
            self.saved = (states, copy.deepcopy(self.requests), dict(self.slid))

    @invariant()
    def integrity(self) -> None:
        size = self.page_size
        full_pages: set[int] = set()
        swa_pages: set[int] = set()
        for a in self.allocs:
            a.check_integrity()
        reference = self.allocs[0]
        for rid, slots in self.requests.items():
            check_layout(slots, size, f"request {rid}")
            mine = owned_pages(slots, size)
            assert not full_pages & mine
            full_pages |= mine
            swa = reference.translate(idx(slots)).tolist()
            cut = self.slid[rid] * size
            assert all(v == 0 for v in swa[:cut]), "released SWA slots still mapped"
            assert all(v > 0 for v in swa[cut:]), "a live token lost its SWA slot"
            check_layout(swa[cut:], size, f"request {rid} SWA", first=cut)
            mine_swa = owned_pages(swa[cut:], size)
            assert not swa_pages & mine_swa
            swa_pages |= mine_swa
        if not self.group_open:
            assert reference.full_available_size() == (NUM_PAGES - len(full_pages)) * size
            assert reference.swa_available_size() == (6 - len(swa_pages)) * size


TestSWA = SWAMachine.TestCase
TestSWA.settings = MACHINE_SETTINGS


class MambaMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.allocs: list[MambaSlotAllocator] = [
            make_mamba(backend="numpy", size=10),
            make_mamba(backend="torch", size=10),
        ]
        self.held: list[int] = []

    @rule(n=st.integers(0, 4))
    def alloc(self, n: int) -> None:
        outs = [a.alloc(n) for a in self.allocs]
        if n > 10 - len(self.held):
            assert all(o is None for o in outs)
            return
        assert outs[0] is not None and outs[1] is not None and torch.equal(outs[0], outs[1])
        self.held += outs[0].tolist()

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        src = data.draw(st.lists(st.sampled_from(self.held), min_size=1, max_size=3))
        copies = [a.fork(idx(src)) for a in self.allocs]
        if len(src) > 10 - len(self.held):
            assert all(c is None for c in copies)
            return
        assert copies[0] is not None and copies[1] is not None
        assert copies[0].src.tolist() == src and torch.equal(copies[0].dst, copies[1].dst)
        assert not set(copies[0].dst.tolist()) & set(self.held)
        self.held += copies[0].dst.tolist()

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        gone = data.draw(st.lists(st.sampled_from(self.held), min_size=1, unique=True))
        for a in self.allocs:
            a.free(idx(gone))
        self.held = [s for s in self.held if s not in gone]

    @invariant()
    def integrity(self) -> None:
        assert len(set(self.held)) == len(self.held)
        for a in self.allocs:
            a.check_integrity()
            assert a.available_size() == 10 - len(self.held)


TestMamba = MambaMachine.TestCase
TestMamba.settings = MACHINE_SETTINGS
