"""The index's entries in C (`index_core.c`), built at first use like the allocator's decode round
(`kvstrata.pool.native.native_library`: system C compiler, per-machine cache, `KVSTRATA_NATIVE=0`
turns it off, `kvstrata.pool.native.disabled()` keeps indexes made inside it off it). Without it
`PrefixIndex` keeps its entries in a Python dict (same answers, ~4-6x slower).

Why: on a large index a CPython dict probe is several cache misses (slot, entry, key object)
and every op pays Python bytecode around them; the measured floor of bare dict probes of the
bench's op stream sat at ~205k ops per CPU second, half the 400k target. The C table keeps the
whole key in a 64-byte entry next to its holders, so a probe is about two misses, and one
ctypes call serves a whole lookup or a whole event batch (keys passed joined, by address).

Hash collisions: a slot stores 32 bits of the key's 64-bit hash to skip most non-matches, but
every match compares the full key bytes, so two keys with one hash are two entries.
"""

from __future__ import annotations

import atexit
import ctypes
import shutil
import sys
import tempfile
import threading
import weakref
from array import array
from collections.abc import Callable, Sequence
from pathlib import Path

from kvstrata.pool.native import native_library
from kvstrata.unified_radix_cache import BlockRemoved, BlockStored, KVEvent

#: The C sources, compiled as one translation unit (`source()`): the table, entries and
#: operations, then the integrity check, the in-place key reads and the exported functions.
SOURCES = (Path(__file__).with_name("index_core.c"), Path(__file__).with_name("index_api.c"))

_combined: list[Path] = []
_lock = threading.Lock()


def source() -> Path:
    """The two C files as one, written once per process into a private temporary folder
    (removed at exit). `native_library` caches the build by the text it compiles, so an edit
    of either file makes a new library, and the same text on the same machine builds once."""
    with _lock:
        if not _combined:
            folder = Path(tempfile.mkdtemp(prefix="kvstrata-index-core-"))
            atexit.register(shutil.rmtree, folder, ignore_errors=True)
            path = folder / "index_core.c"
            path.write_bytes(b"".join(part.read_bytes() for part in SOURCES))
            _combined.append(path)
        return _combined[0]


#: Longest key the C entries hold (PageKeyer keys are 16 or 32 bytes).
MAX_KEY_BYTES = 32

_I64 = ctypes.c_int64
_INT = ctypes.c_int
_PTR = ctypes.c_void_p

_STORE, _REMOVE, _CLEAR = 0, 1, 2
_BYTES = {bytes}

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


class _Library:
    """The kvx_* functions. `apply1` and `match` (one call per op) have no argument types:
    ctypes then passes ints as C ints and bytes as their buffer, a third of the cost of a
    typed call here (~0.5 us against ~1.7 us); the C side takes exactly those."""

    def __init__(self, lib: ctypes.PyDLL) -> None:
        def typed(name: str, args: list[type], res: type | None) -> Callable[..., int]:
            fn = getattr(lib, name)
            fn.argtypes = args
            fn.restype = res
            return fn

        self.new = typed("kvx_new", [_I64, _I64, _I64], _INT)
        self.free = typed("kvx_free", [_INT], None)
        self.buffers = typed("kvx_buffers", [_INT, _PTR, _I64, _PTR, _I64, _PTR], None)
        self.layout = typed("kvx_layout", [_PTR, _PTR, _PTR], None)
        self.apply = typed("kvx_apply", [_INT, _INT, _PTR, _INT, ctypes.c_char_p], _INT)
        self.drop = typed("kvx_drop", [_INT, _INT], _I64)
        self.held = typed("kvx_held", [_INT, _I64], _I64)
        self.holdings = typed("kvx_holdings", [_INT, _I64, _PTR, _PTR], _I64)
        self.hashes = typed("kvx_hashes", [_INT, ctypes.c_char_p, _I64, _PTR], None)
        self.stats = typed("kvx_stats", [_INT, _PTR], None)
        self.check = typed("kvx_check", [_INT], _I64)
        self.fail_alloc = typed("kvx_fail_alloc", [_I64], _I64)
        self.apply1: Callable[..., int] = lib.kvx_apply1  # (id, iid, kind, bits, keys, n)
        self.match: Callable[..., int] = lib.kvx_match  # (id, keys, n, tiers)
        self.apply_seq: Callable[..., int] = lib.kvx_apply_seq  # (id, iid, kind, bits)
        self.match_seq: Callable[..., int] = lib.kvx_match_seq  # (id, tiers)
        #: Whether the C code may read tuples / lists of bytes in place (`object_layout_ok`).
        self.in_place = object_layout_ok()
        if self.in_place:
            self.layout(id(bytes), id(tuple), id(list))


def object_layout_ok() -> bool:
    """Whether this interpreter lays out bytes, tuple and list objects as `index_core.c`
    reads them in place (CPython 3.11-3.13 default builds: type at 8, size at 16, items at
    24, bytes data at 32), checked on probe objects; when not, keys are joined in Python."""
    if sys.implementation.name != "cpython":
        return False
    probe = bytes(range(40))
    pair = (probe, probe)
    one = [probe]
    ptr = ctypes.c_void_p.from_address
    size = ctypes.c_ssize_t.from_address
    try:
        return (
            ptr(id(probe) + 8).value == id(bytes)
            and size(id(probe) + 16).value == len(probe)
            and ctypes.string_at(id(probe) + 32, len(probe)) == probe
            and ptr(id(pair) + 8).value == id(tuple)
            and size(id(pair) + 16).value == 2
            and ptr(id(pair) + 24).value == id(probe)
            and ptr(id(one) + 8).value == id(list)
            and size(id(one) + 16).value == 1
            and ptr(ptr(id(one) + 24).value or 0).value == id(probe)
        )
    except (ValueError, OSError):
        return False


_loaded: dict[Path, _Library | None] = {}


def _library() -> _Library | None:
    made = native_library(source())
    if made.library is None or made.path is None:
        return None
    if made.path not in _loaded:
        try:
            # PyDLL: the same library, called with the GIL held (one thread at a time, as the
            # Python index's dicts are), and no GIL release per call.
            _loaded[made.path] = _Library(ctypes.PyDLL(str(made.path)))
        except (AttributeError, OSError):  # a library without the symbols: Python entries
            _loaded[made.path] = None
    return _loaded[made.path]


def native_status() -> str:
    """`native: <library>` or `python: <why the compiled core is not used>`."""
    made = native_library(source())
    if made.library is None:
        return f"python: {made.reason}"
    if _library() is None:
        return f"python: {made.path} lacks the kvx_* functions"
    return f"native: {made.path}"


class NativeCore:
    """One index's entries in C. Ids are the index's interned instance ids; `tier_bit` maps a
    tier name to its bit (rank order, best first). Callers validate events first (or use
    `apply_one`, which checks its keys): the C code trusts them."""

    def __init__(
        self, lib: _Library, key_bytes: int, tier_bit: dict[str, int], max_entries: int | None
    ) -> None:
        handle = lib.new(key_bytes, len(tier_bit), max_entries or 0)
        if handle < 0:
            raise MemoryError("the native prefix index could not allocate its table")
        self._lib = lib
        self._id = handle
        self._finalizer = weakref.finalize(self, lib.free, handle)
        self.key_bytes = key_bytes
        self.tier_bit = tier_bit
        self.all_tiers = sum(tier_bit.values())
        self.max_entries = max_entries
        self._apply1 = lib.apply1
        self._match = lib.match
        self._apply_seq = lib.apply_seq
        self._match_seq = lib.match_seq
        self._in_place = lib.in_place
        # args[0]: the address of the tuple / list of keys a *_seq call reads.
        self._args = array("q", [0])
        # kvx_match's output, grown when more instances exist or a run needs more pages.
        self._res = array("i", bytes(4 * 3 * 64))
        self._pages = array("B", bytes(4096))
        self._register()
        self._stats = array("q", bytes(8 * 4))

    def _register(self) -> None:
        self._lib.buffers(
            self._id,
            self._res.buffer_info()[0],
            len(self._res),
            self._pages.buffer_info()[0],
            len(self._pages),
            self._args.buffer_info()[0],
        )

    def apply_one(self, iid: int, removed: bool, bit: int, keys: Sequence[bytes]) -> bool:
        """Store (or remove) `keys` on tier `bit` for `iid` if every key is a bytes of the key
        length (checked here: the joined length and the longest key); False, having changed
        nothing, when one is not (the caller's checks then say which)."""
        if self._in_place:
            self._args[0] = id(keys)
            rc = self._apply_seq(self._id, iid, removed, bit)
            if rc == -4:
                return False
            if rc < 0:
                raise MemoryError("the native prefix index ran out of memory")
            return True
        try:
            joined = b"".join(keys)
            num = len(keys)
            kb = self.key_bytes
            if len(joined) != num * kb or (num and max(map(len, keys)) != kb):
                return False  # total and longest right: every key is kb bytes
        except TypeError:  # a key that is no bytes-like object
            return False
        if num and set(map(type, keys)) != _BYTES:
            return False
        if self._apply1(self._id, iid, removed, bit, joined, num) < 0:
            raise MemoryError("the native prefix index ran out of memory")
        return True

    def apply(self, iid: int, events: Sequence[KVEvent]) -> None:
        """`iid`'s validated events, in one call."""
        bit = self.tier_bit
        spec = array("q")
        parts: list[bytes] = []
        for event in events:
            if isinstance(event, BlockStored | BlockRemoved):
                kind = _STORE if isinstance(event, BlockStored) else _REMOVE
                spec.extend((kind, bit[event.tier], len(event.page_keys)))
                parts.extend(event.page_keys)
            else:
                tier = event.tier
                spec.extend((_CLEAR, self.all_tiers if tier is None else bit[tier], 0))
        if not spec:
            return
        joined = b"".join(parts)
        if self._lib.apply(self._id, iid, spec.buffer_info()[0], len(events), joined) < 0:
            raise MemoryError("the native prefix index ran out of memory")

    def raw_calls(self) -> tuple[Callable[..., int], Callable[..., int], int]:
        """(match, apply1, this index's number): the untyped C calls behind `match` and
        `apply_one` (match(number, joined keys, count, tiers); apply1(number, id, kind 0 store /
        1 remove, tier bits, joined keys, count)), for `opstream.native_floor`."""
        return self._match, self._apply1, self._id

    def drop(self, iid: int) -> int:
        return self._lib.drop(self._id, iid)

    def ensure_instances(self, count: int) -> None:
        """Room in the result buffer for `count` instances (ids handed out so far)."""
        if 3 * count > len(self._res):
            self._res = array("i", bytes(4 * 3 * 2 * count))
            self._register()

    def match(self, keys: Sequence[bytes], tiers: bool) -> int:
        """kvx_match over `keys` up to the first that is not a bytes of the key length (no
        entry can have it); the result is then in `res` and `pages` (see `index_core.c`)."""
        if self._in_place:
            self._args[0] = id(keys)
            got = self._match_seq(self._id, tiers)
            if got == -4:  # not a tuple / list of exactly bytes of the key length
                got = self._match_joined(keys, tiers)
        else:
            got = self._match_joined(keys, tiers)
        if got < -2:  # a run of mixed tiers longer than `pages`: nothing changed, again
            self._pages = array("B", bytes(2 * (-3 - got)))
            self._register()
            return self.match(keys, tiers)
        if got < 0:
            raise MemoryError("the native prefix index ran out of memory")
        return got

    @property
    def res(self) -> array[int]:
        return self._res

    @property
    def pages(self) -> array[int]:
        return self._pages

    def _match_joined(self, keys: Sequence[bytes], tiers: bool) -> int:
        num = len(keys)
        kb = self.key_bytes
        try:
            joined = b"".join(keys)
            if len(joined) == num * kb and (not num or max(map(len, keys)) == kb):
                return self._match(self._id, joined, num, tiers)
        except TypeError:
            pass  # a key that is no bytes-like object: it ends the match below
        for i, key in enumerate(keys):
            if not isinstance(key, bytes) or len(key) != kb:
                num = i
                break
        return self._match(self._id, b"".join(keys[:num]), num, tiers)

    def holdings(self, iid: int) -> list[tuple[bytes, int]]:
        """`iid`'s keys and the tier bits it holds each on."""
        held = self._lib.held(self._id, iid)
        keys = array("B", bytes(held * self.key_bytes))
        bits = array("i", bytes(4 * held))
        if held:
            self._lib.holdings(self._id, iid, keys.buffer_info()[0], bits.buffer_info()[0])
        raw, kb = keys.tobytes(), self.key_bytes
        return [(raw[i * kb : (i + 1) * kb], bits[i]) for i in range(held)]

    def held(self, iid: int) -> int:
        return self._lib.held(self._id, iid)

    def stats(self) -> tuple[int, int, int, int]:
        """(entries, pairs, evicted entries, bytes allocated by the C core)."""
        self._lib.stats(self._id, self._stats.buffer_info()[0])
        s = self._stats
        return s[0], s[1], s[2], s[3]

    def hashes(self, keys: Sequence[bytes]) -> array[int]:
        """The C core's 64-bit hash of each key; its low 32 bits pick the slot and are kept in
        it (tests use this to build keys that collide)."""
        out = array("Q", bytes(8 * len(keys)))
        self._lib.hashes(self._id, b"".join(keys), len(keys), out.buffer_info()[0])
        return out

    def fail_allocation(self, after: int) -> int:
        """Tests only: the C allocation after `after` more that succeed fails, once, as if
        memory ran out (-1: none fails). One setting for every index of the process. Returns
        the setting it replaces: -1 when the failure set before has happened, else how many
        allocations were still to succeed."""
        return self._lib.fail_alloc(after)

    def check(self) -> None:
        code = self._lib.check(self._id)
        assert code == 0, f"native index invariant {code} broken: {_CHECKS.get(code, '?')}"


def native_core(
    key_bytes: int, tier_bit: dict[str, int], max_entries: int | None
) -> NativeCore | None:
    """A C core for one index, or None (turned off, no compiler, inside `disabled()`, keys
    longer than the C entries hold)."""
    if key_bytes > MAX_KEY_BYTES:
        return None
    lib = _library()
    if lib is None:
        return None
    return NativeCore(lib, key_bytes, tier_bit, max_entries)
