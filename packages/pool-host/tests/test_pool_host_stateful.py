"""A host pool and its allocator under random backups, loads and frees, against a model of
what each host page must hold."""

from __future__ import annotations

import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvstrata.pool_host import HostLayout, HostSlotAllocator, MHAHostPool
from kvstrata.testkit.host_pools import fill_random, make_device_pool, page_tokens, read_flat

PAGE = 2
DEVICE_PAGES = 8  # usable device pages 1..8
HOST_PAGES = 6


class HostPoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = make_device_pool("mha", page_size=PAGE, num_pages=DEVICE_PAGES, num_layers=2)
        fill_random(self.pool, seed=0)
        self.host: MHAHostPool | None = None
        self.allocator: HostSlotAllocator | None = None
        self.model: dict[int, bytes] = {}

    @initialize(layout=st.sampled_from(list(HostLayout)))
    def build(self, layout: HostLayout) -> None:
        self.host = MHAHostPool(self.pool, layout=layout, size=HOST_PAGES * PAGE)
        self.allocator = self.host.make_allocator()

    @rule(page=st.integers(1, DEVICE_PAGES), seed=st.integers(0, 2**16))
    def scribble_device_page(self, page: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        data = torch.randint(
            0, 256, (1, self.pool.page_size_bytes), dtype=torch.uint8, generator=gen
        )
        self.pool.write_pages(torch.tensor([page]), data)

    @rule(device_pages=st.lists(st.integers(1, DEVICE_PAGES), min_size=1, max_size=4))
    def backup(self, device_pages: list[int]) -> None:
        assert self.host is not None and self.allocator is not None
        host_pages = self.allocator.alloc_pages(len(device_pages))
        if host_pages is None:
            return
        expected = read_flat(self.pool, device_pages)
        self.host.backup(self.pool, page_tokens(device_pages, PAGE), page_tokens(host_pages, PAGE))
        for host_page, row in zip(host_pages.tolist(), expected, strict=True):
            self.model[host_page] = row.numpy().tobytes()

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        assert self.allocator is not None
        pages = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, unique=True))
        self.allocator.free_pages(torch.tensor(pages))
        for page in pages:
            del self.model[page]

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def load_back(self, data: st.DataObject) -> None:
        assert self.host is not None
        host_pages = data.draw(
            st.lists(st.sampled_from(sorted(self.model)), min_size=1, max_size=4, unique=True)
        )
        targets = data.draw(
            st.lists(
                st.integers(1, DEVICE_PAGES),
                min_size=len(host_pages),
                max_size=len(host_pages),
                unique=True,
            )
        )
        self.host.load_layers(self.pool, page_tokens(host_pages, PAGE), page_tokens(targets, PAGE))
        got = read_flat(self.pool, targets)
        for host_page, row in zip(host_pages, got, strict=True):
            assert row.numpy().tobytes() == self.model[host_page]

    @invariant()
    def host_pages_hold_what_was_backed_up(self) -> None:
        if self.host is None or self.allocator is None:
            return
        self.host.check_integrity()
        self.allocator.check_integrity()
        assert self.allocator.num_free_pages() == HOST_PAGES - len(self.model)
        buf = bytearray(self.host.page_size_bytes)
        for page, expected in self.model.items():
            self.host.read_page_into(page, buf)
            assert bytes(buf) == expected
            if self.host.layout is not HostLayout.layer_first:
                assert bytes(self.host.page_view(page)) == expected


TestHostPoolMachine = HostPoolMachine.TestCase
