"""The tiers' page-key chain: `PageKeyer.chain` of a sha256 keyer in one compiled call.

Every page a backup stores and every page a prefetch asks for is named by its chained key
(`kvstrata.storage.keys`): with storage on, the tiers hash about 250,000 pages on the
12,031-request `bench tiers` trace. `PageKeyer._chain` spends most of its ~1.3 us a page on
its Python step (a slice, a concatenation, a hash object, a digest object); `page_keys.c`
runs the same chain in C, the rounds on the CPU's SHA extensions where it has them (else
portable C), and makes only the keys.

`chain_of(keyer)` is what the tiers call instead of `keyer.chain`: the compiled chain for a
`PageKeyer` (exactly that class) with hash "sha256" on a little-endian machine, when the
module builds (`kvstrata.pool.native.native_extension`; None when turned off with
`KVSTRATA_NATIVE=0`, inside `kvstrata.pool.native.disabled()` or without a compiler), else
`keyer.chain` itself. Both give the same keys (tests/test_key_chain.py compares them, and
both rounds with hashlib); a token array that is not C-contiguous native int64 goes to
`keyer.chain`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Protocol, cast

import numpy as np
import numpy.typing as npt

from kvstrata.pool.native import native_extension
from kvstrata.storage.keys import PageKeyer

SOURCE = Path(__file__).with_name("page_keys.c")
MODULE_NAME = "_kvstrata_page_keys"

#: (tokens, parent) -> the keys of the whole pages of `tokens`, chained from `parent`: the
#: contract of `PageKeyer.chain`; `tokens` may also be the native int64 bytes of the ids.
Chain = Callable[[npt.NDArray[np.int64] | bytes, bytes], list[bytes]]

_INT64 = np.dtype(np.int64)
_TOKEN_BYTES = 8


class PageKeysModule(Protocol):
    """The functions of the compiled module, positional only."""

    #: (data, end, parent, step, portable) -> one key per `step` bytes of data[:end]
    sha256_chain: Callable[[npt.NDArray[np.int64] | bytes, int, bytes, int, bool], list[bytes]]
    #: () -> whether the rounds run on the SHA extensions
    uses_sha_extensions: Callable[[], bool]


def page_keys_module() -> PageKeysModule | None:
    """The compiled module, or None (then `chain_of` gives `keyer.chain`)."""
    return cast("PageKeysModule | None", native_extension(SOURCE, MODULE_NAME).module)


def chain_of(keyer: PageKeyer) -> Chain:
    """`keyer.chain` (taking native int64 bytes too), compiled where it can be (see the
    module docstring). Asked once, by whoever holds the keyer: the answer is kept."""
    if type(keyer) is not PageKeyer or keyer.hash != "sha256" or sys.byteorder != "little":
        return partial(_python_chain, keyer)
    module = page_keys_module()
    if module is None:
        return partial(_python_chain, keyer)
    return partial(_compiled_chain, module.sha256_chain, keyer)


def _python_chain(
    keyer: PageKeyer, tokens: npt.NDArray[np.int64] | bytes, parent: bytes
) -> list[bytes]:
    if isinstance(tokens, bytes):
        tokens = np.frombuffer(tokens, dtype=np.int64)
    return keyer.chain(tokens, parent)


def _compiled_chain(
    sha256_chain: Callable[[npt.NDArray[np.int64] | bytes, int, bytes, int, bool], list[bytes]],
    keyer: PageKeyer,
    tokens: npt.NDArray[np.int64] | bytes,
    parent: bytes,
) -> list[bytes]:
    page = keyer.page_size
    if isinstance(tokens, bytes):
        whole = len(tokens) // (page * _TOKEN_BYTES) * page
    elif tokens.dtype is _INT64 and tokens.flags.c_contiguous:
        whole = tokens.size // page * page
    else:
        return keyer.chain(tokens, parent)
    return sha256_chain(tokens, whole * _TOKEN_BYTES, parent, page * _TOKEN_BYTES, False)
