"""The index's entries in C: `index_core.c` (the table), `index_convert.c` (Python objects in
and out) and `index_ext.c` (the Python type `Core`), compiled as one source into an extension
module of this interpreter at first use (`kvstrata.pool.native.native_extension`: system C
compiler, the interpreter's headers, per-machine cache; `KVSTRATA_NATIVE=0` turns it off,
`kvstrata.pool.native.disabled()` keeps indexes made inside it off it). Without it (no
compiler, no Python headers, turned off) `PrefixIndex` keeps its entries in Python dicts:
same answers and errors, ~5x slower; `native_status()` says which and why.

Why an extension module: with the table in C the index's cost was the Python around each call
(argument checks, instance lookup, result objects) and ctypes' argument conversion (~1 us a
call, as much as the table work). `Core.apply(instance, events)` validates a whole event batch
(raising the Python core's exceptions, with its messages, before any change) and applies it in
one call; `Core.find_matches(keys)` matches a lookup and builds the `PrefixMatches` result in
C; both read the keys straight from the bytes objects. On a native index these are the
index's own `apply` / `find_matches` / `match_lengths` (no Python frame per call).

Re-entry: Python code can run inside a call (an event's attribute, a key's `__hash__`, the
callbacks, a finalizer at any allocation). One call at a time: a call of the core made inside
another raises `ReentrantCall` before it changes anything, and the index's own methods that
make several calls take the core with `hold()` / `release()` for their whole run (see the
guard in `index_ext.c`); the Python core refuses the same calls with the same error.

Hash collisions: a slot stores 32 bits of the key's 64-bit hash to skip most non-matches, but
every match compares the full key bytes, so two keys with one hash are two entries.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Protocol, cast

from kvstrata.pool.native import joined_source, native_extension
from kvstrata.prefix_index.errors import InvalidEvent, InvalidInstance, ReentrantCall
from kvstrata.prefix_index.results import InstanceMatch, PrefixMatches
from kvstrata.unified_radix_cache import AllBlocksCleared, BlockRemoved, BlockStored

#: The C sources, compiled as one translation unit (`source()`): the table, entries,
#: operations and integrity check; the conversions from and to Python objects; the type.
SOURCES = tuple(
    Path(__file__).with_name(name) for name in ("index_core.c", "index_convert.c", "index_ext.c")
)
#: The extension module's name (its `PyInit_` function).
MODULE = "kvstrata.prefix_index._core"


def source() -> Path:
    """The C files as one (`kvstrata.pool.native.joined_source`)."""
    return joined_source(SOURCES)


#: Longest key the C entries hold (PageKeyer keys are 16 or 32 bytes).
MAX_KEY_BYTES = 32

_CHECKS = {
    1: "a slot names a bad or free entry",
    2: "a slot's hash bits or place are wrong (or a key is in the table twice)",
    3: "slot count != live entries",
    4: "holders unsorted, on no tier or on unknown tier bits",
    5: "a holder's position disagrees with its instance's key list",
    6: "pair counts disagree",
    7: "least-recently-matched order broken or incomplete",
    8: "entry bound exceeded",
    9: "free list broken",
}


class Core(Protocol):
    """The compiled `Core` of one index (`index_ext.c`). Instance ids are the index's interned
    ids; `set_name` tells the core the name its results give an id (`apply` records the name
    of an id it interns itself). Every method but `stats`, `check` and `fail_allocation`
    raises `ReentrantCall`, before any change, when called inside another call of the core;
    `set_name`, `drop` and `holdings` also run inside `hold()`, `apply_held` only there.
    The hold records no owner: these raw methods (and `release`) are the index's own, for
    use between its `hold()` and `release()`; code outside the index must not call them."""

    def apply(self, instance: str, events: Iterable[object], /) -> None:
        """`PrefixIndex.apply`: validate `instance` and every event (InvalidInstance /
        InvalidEvent as the Python core raises them, before any change), intern a new name
        (`intern`), apply the batch. MemoryError mid-batch: applied in part."""
        ...

    def find_matches(
        self, query: object, /, *, extra_key: str | None = None, cache_salt: str | None = None
    ) -> PrefixMatches:
        """`PrefixIndex.find_matches`: page keys (a list / tuple, empty or opening with a
        bytes key) as they are, anything else keyed by `as_keys`."""
        ...

    def lengths(self, keys: Sequence[bytes], /) -> dict[str, int]: ...

    def set_name(self, iid: int, name: str | None, /) -> None: ...

    def drop(self, iid: int, /) -> int: ...

    def holdings(self, iid: int, /) -> list[tuple[bytes, int]]:
        """`iid`'s keys and the tier bits (1 << rank) it holds each on."""
        ...

    def stats(self) -> tuple[int, int, int, int]:
        """(entries, pairs, evicted entries, bytes allocated by the C side)."""
        ...

    def check(self) -> int: ...

    def hashes(self, keys: Sequence[bytes], /) -> list[int]:
        """The 64-bit hash of each key; its low 32 bits pick the slot and are kept in it."""
        ...

    def match_count(self, keys: Sequence[bytes], /) -> int:
        """The lookup without names or result objects: how many instances match."""
        ...

    def apply_keys(self, iid: int, kind: int, bits: int, keys: Sequence[bytes], /) -> None:
        """One store (kind 0) or removal (1) of `keys` on tier `bits`, no events, no names."""
        ...

    def hold(self) -> None:
        """Take the core for one method of the index that makes several calls (ReentrantCall
        when a call runs): until `release()`, only set_name, drop, holdings and apply_held
        run."""
        ...

    def release(self) -> None:
        """The end of `hold()` (RuntimeError without one)."""
        ...

    def __enter__(self) -> None:
        """`with core:` holds the core (`hold()`) for the block, then `release()`s it."""
        ...

    def __exit__(self, *exc: object) -> None: ...

    def apply_held(self, instance: str, events: Iterable[object], /) -> None:
        """`apply`, inside `hold()` (RuntimeError outside one)."""
        ...

    def fail_allocation(self, after: int, /) -> int:
        """Tests only: the C allocation after `after` more that succeed fails, once (-1:
        none). One setting for the whole process. Returns the setting it replaces: -1 once
        the failure set before has happened, else how many were still to succeed."""
        ...


class _CoreType(Protocol):
    def __call__(self, *args: object) -> Core: ...


def _module_core() -> tuple[_CoreType | None, str]:
    made = native_extension(source(), MODULE)
    if made.module is None:
        return None, made.reason
    core = getattr(made.module, "Core", None)
    if core is None:
        return None, f"{made.path} has no Core type"
    return cast("_CoreType", core), str(made.path)


def native_status() -> str:
    """`native: <extension module>` or `python: <why the compiled core is not used>`."""
    core, said = _module_core()
    return f"native: {said}" if core is not None else f"python: {said}"


def native_core(
    key_bytes: int,
    tier_bit: Mapping[str, int],
    max_entries: int | None,
    *,
    page_size: int = 1,
    ids: dict[str, int] | None = None,
    intern: Callable[[str], int] | None = None,
    as_keys: Callable[..., Sequence[bytes]] | None = None,
) -> Core | None:
    """A C core for one index, or None (turned off, no compiler or headers, inside
    `disabled()`, keys longer than the C entries hold). `tier_bit`: tier name -> 1 << rank,
    best tier first; `page_size`: the tokens per page a BlockStored must have; `ids`: the
    index's own dict instance name -> id, which `Core.apply` reads (a new one when None);
    `intern(name) -> id`: gives a new name its id, and the core records the name (None:
    `apply` of an unknown name raises LookupError); `as_keys(query, extra_key, cache_salt)`:
    the page keys of token ids (None: `find_matches` takes page keys only)."""
    if key_bytes > MAX_KEY_BYTES:
        return None
    make, _ = _module_core()
    if make is None:
        return None
    return make(
        key_bytes,
        page_size,
        max_entries or 0,
        dict(tier_bit),
        tuple(sorted(tier_bit, key=tier_bit.__getitem__)),
        str(sorted(tier_bit)),
        {} if ids is None else ids,
        (BlockStored, BlockRemoved, AllBlocksCleared, PrefixMatches, InstanceMatch),
        (InvalidEvent, InvalidInstance, ReentrantCall),
        intern,
        as_keys,
    )


def check_core(core: Core) -> None:
    """AssertionError naming the first invariant of the C structures that does not hold."""
    code = core.check()
    assert code == 0, f"native index invariant {code} broken: {_CHECKS.get(code, '?')}"
