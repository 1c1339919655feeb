"""Sizing a host pool (ratio, tokens, bytes; refusals) and sharing its pages with another
process."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import textwrap

import pytest
import torch

from kvstrata.pool_host import (
    HostLayout,
    MambaHostPool,
    MHAHostPool,
    MLAHostPool,
    PlainHostAllocator,
    SharedHostAllocator,
    host_memory,
)
from kvstrata.pool_host.errors import (
    HostPoolTooSmall,
    InsufficientHostMemory,
    InvalidHostPoolSize,
)
from kvstrata.testkit.host_pools import fill_random, make_device_pool, page_tokens, read_flat


def test_default_size_is_twice_the_device_pool() -> None:
    pool = make_device_pool("mha", num_pages=12, page_size=4)
    host = MHAHostPool(pool)
    assert host.size == 2 * pool.size
    assert host.num_pages == 24
    assert host.page_size_bytes == pool.page_size_bytes
    assert host.bytes_per_token == pool.bytes_per_token
    assert host.size_bytes == 24 * pool.page_size_bytes


def test_size_options_round_down_to_whole_pages() -> None:
    pool = make_device_pool("mla", num_pages=10, page_size=4)
    assert MLAHostPool(pool, ratio=0.5).num_pages == 5
    assert MLAHostPool(pool, size=19).num_pages == 4
    assert MLAHostPool(pool, size_bytes=3 * pool.page_size_bytes + 1).num_pages == 3
    mamba = make_device_pool("mamba", num_pages=7)
    assert MambaHostPool(mamba, ratio=1.0).num_pages == 7  # a Mamba page is one state slot


def test_layer_first_region_holds_every_buffer() -> None:
    pool = make_device_pool("mamba", dtype=torch.float8_e5m2)  # 315-byte pages: odd offsets
    host = MambaHostPool(pool, layout=HostLayout.layer_first, size=5)
    host.check_integrity()
    assert host.size_bytes >= 5 * pool.page_size_bytes


def test_sizes_below_one_page_are_refused() -> None:
    pool = make_device_pool("mha", page_size=4)
    with pytest.raises(HostPoolTooSmall, match="one page"):
        MHAHostPool(pool, size=3)
    with pytest.raises(HostPoolTooSmall):
        MHAHostPool(pool, size_bytes=pool.page_size_bytes - 1)
    with pytest.raises(HostPoolTooSmall):
        MHAHostPool(pool, ratio=0.01)


def test_conflicting_or_negative_sizes_are_refused() -> None:
    pool = make_device_pool("mha")
    with pytest.raises(InvalidHostPoolSize, match="at most one"):
        MHAHostPool(pool, size=8, ratio=1.0)
    with pytest.raises(InvalidHostPoolSize, match="negative"):
        MHAHostPool(pool, ratio=-1.0)
    for ratio in (float("inf"), float("nan")):
        with pytest.raises(InvalidHostPoolSize, match="finite"):
            MHAHostPool(pool, ratio=ratio)


@pytest.mark.parametrize("allocator", ["plain", "shared"])
def test_a_size_beyond_this_host_is_refused(allocator: str) -> None:
    pool = make_device_pool("mha")
    too_big = 2 * host_memory().total_bytes
    alloc = PlainHostAllocator() if allocator == "plain" else SharedHostAllocator()
    with pytest.raises(InsufficientHostMemory, match="available"):
        MHAHostPool(pool, size_bytes=too_big, allocator=alloc)


def test_make_allocator_covers_the_pool() -> None:
    host = MHAHostPool(make_device_pool("mha", page_size=4), size=40)
    allocator = host.make_allocator()
    assert (allocator.num_pages, allocator.page_size, allocator.size) == (10, 4, 40)


def test_shared_pool_pages_are_visible_from_another_process_without_copy() -> None:
    pool = make_device_pool("mha", page_size=4)
    fill_random(pool, seed=11)
    host = MHAHostPool(pool, size=40, allocator=SharedHostAllocator())
    assert host.shared_name is not None
    host.backup(pool, page_tokens([3], 4), page_tokens([6], 4)).wait()
    # The other process (standing in for the node's L3 store) maps the region by name with
    # plain mmap, hashes page 6 in place and writes a marker into page 2.
    script = textwrap.dedent(
        f"""
        import hashlib, mmap, os
        fd = os.open("/dev/shm/{host.shared_name}", os.O_RDWR)
        m = mmap.mmap(fd, 0)
        page = memoryview(m)[{host.page_offset(6)}:{host.page_offset(6) + host.page_size_bytes}]
        print(hashlib.sha256(page).hexdigest())
        page.release()
        m[{host.page_offset(2)}:{host.page_offset(2) + 4}] = b"L3ok"
        m.close()
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    ).stdout.strip()
    assert out == hashlib.sha256(read_flat(pool, [3]).numpy().tobytes()).hexdigest()
    assert bytes(host.page_view(2)[:4]) == b"L3ok"
    host.close()
