"""The storage checksums of a batch of pages in one compiled call (`page_sums.c`).

A backup stores a CRC-32 beside every page and a prefetch checks every page it reads against
its own (storage_io.py). In Python that is a `zlib.crc32`, a `struct.pack` and a memoryview
per page, about 0.8 us at 512-byte pages; on the 12,031-request `bench tiers` trace that is
about 230,000 pages. `page_sums.c` computes the same CRC (zlib's) of a whole batch with
carry-less multiplies where the CPU has them (else a table) and makes only the results.

`page_sums_module()` is the module, built at first use by `kvstrata.pool.native.
native_extension` (None when turned off with `KVSTRATA_NATIVE=0`, inside
`kvstrata.pool.native.disabled()` or without a compiler): a `StorageRunner` asks once, when
it is made, and otherwise keeps the Python checksums (the same bytes; tests compare both).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol, cast

from kvstrata.pool.native import native_extension

SOURCE = Path(__file__).with_name("page_sums.c")
MODULE_NAME = "_kvstrata_page_sums"


class PageSums(Protocol):
    """The functions of the compiled module, positional only."""

    #: (views, table) -> per view a memoryview of its CRC-32's 4 little-endian bytes (the
    #: `page_checksum` bytes); `table`: the byte table, not the multiplies (tests)
    crc32_views: Callable[[list[memoryview], bool], list[memoryview]]
    #: (views, sums, table) -> per view whether `sums[k]` holds exactly its checksum's bytes
    crc32_agree: Callable[[list[memoryview], list[bytearray], bool], list[bool]]
    #: () -> whether the CRC runs on carry-less multiplies
    uses_clmul: Callable[[], bool]


def page_sums_module() -> PageSums | None:
    """The compiled module, or None (then the runner keeps the Python checksums)."""
    return cast("PageSums | None", native_extension(SOURCE, MODULE_NAME).module)
