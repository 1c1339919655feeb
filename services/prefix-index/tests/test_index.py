"""PrefixIndex scenarios: matching, tiers and scores, the entry bound, sequencing, errors,
re-entry."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

import pytest

from kvstrata.pool import native
from kvstrata.prefix_index import (
    InvalidEvent,
    InvalidInstance,
    InvalidParameter,
    PrefixIndex,
    ReentrantCall,
)
from kvstrata.prefix_index.errors import REENTERED
from kvstrata.storage import PageKeyer
from kvstrata.unified_radix_cache import AllBlocksCleared, BlockRemoved, BlockStored

KEYER = PageKeyer(page_size=4)


def stored(keys: list[bytes], tier: str = "device", page: int = 4) -> BlockStored:
    return BlockStored(page_keys=tuple(keys), parent_key=None, tokens_per_page=page, tier=tier)


def prompt(n_pages: int, start: int = 0) -> list[int]:
    return list(range(start, start + 4 * n_pages))


def test_longest_run_per_instance_and_tiers() -> None:
    index = PrefixIndex(4)
    keys = KEYER.page_keys(prompt(5))
    index.apply("a", [stored(keys[:3])])
    index.apply("b", [stored(keys[:1]), stored(keys[2:5])])  # hole at page 1
    index.apply("c", [stored(keys[:2], "host"), stored(keys[:1], "storage")])
    m = index.find_matches(prompt(5))
    assert m.num_pages == 5
    assert {n: x.num_pages for n, x in m.by_instance.items()} == {"a": 3, "b": 1, "c": 2}
    # Page 0 of c is on host and storage: the best tier is reported.
    assert m.by_instance["c"].tiers == ("host", "host")
    assert m.longest() == 3
    assert index.find_matches(keys).by_instance == m.by_instance  # keys or tokens alike
    assert index.find_matches(prompt(5, 99)).by_instance == {}
    assert index.find_matches([]).by_instance == {}


def test_score_weights_are_configurable() -> None:
    keys = KEYER.page_keys(prompt(2))
    default = PrefixIndex(4)
    default.apply("a", [stored(keys, "device")])
    default.apply("b", [stored(keys, "storage")])
    assert default.score(keys) == {"a": 2.0, "b": 1.0}
    custom = PrefixIndex(4, tier_weights={"device": 1.0, "storage": 3.0})
    custom.apply("a", [stored(keys, "device")])
    custom.apply("b", [stored(keys, "storage")])
    assert custom.score(keys) == {"a": 2.0, "b": 6.0}
    assert custom.find_matches(keys).by_instance["b"].tiers == ("storage", "storage")
    with pytest.raises(InvalidEvent, match="host"):
        custom.apply("a", [stored(keys, "host")])


def test_remove_and_clear_per_tier() -> None:
    index = PrefixIndex(4)
    keys = KEYER.page_keys(prompt(3))
    index.apply("a", [stored(keys), stored(keys, "host")])
    index.apply("a", [BlockRemoved(page_keys=(keys[2],), tier="device")])
    assert index.find_matches(keys).by_instance["a"].tiers == ("device", "device", "host")
    index.apply("a", [AllBlocksCleared(tier="device")])
    assert index.find_matches(keys).by_instance["a"].tiers == ("host",) * 3
    index.apply("a", [AllBlocksCleared(tier=None)])
    assert len(index) == 0
    index.check_integrity()


def test_bound_evicts_least_recently_matched_tail_first() -> None:
    index = PrefixIndex(4, max_entries=6)
    hot = KEYER.page_keys(prompt(3))
    cold = KEYER.page_keys(prompt(3, 500))
    index.apply("a", [stored(hot), stored(cold)])
    assert len(index) == 6
    index.find_matches(hot)  # hot is now more recent than cold
    new = KEYER.page_keys(prompt(2, 900))
    index.apply("b", [stored(new)])
    assert len(index) == 6
    assert index.stats().evicted_entries == 2
    held = set(index.holdings("a"))
    assert set(hot) <= held
    assert cold[0] not in held and cold[1] not in held and cold[2] in held
    # Matching touches deepest first: the head of a prefix outlives its tail.
    index.find_matches(cold)  # matches nothing now (head gone): touches nothing
    index.find_matches(new)
    index.find_matches(hot)
    index.apply("c", [stored(KEYER.page_keys(prompt(1, 1300)))])
    assert cold[2] not in set(index.holdings("a"))
    index.apply("c", [stored(KEYER.page_keys(prompt(1, 1400)))])
    # Next victim is new's tail (page 1), not its head.
    assert new[0] in set(index.holdings("b")) and new[1] not in set(index.holdings("b"))
    index.check_integrity()


def test_sequenced_batches_gap_and_dump() -> None:
    index = PrefixIndex(4)
    keys = KEYER.page_keys(prompt(3))
    assert index.apply_sequenced("a", 0, [stored(keys[:1])])
    assert not index.apply_sequenced("a", 0, [stored(keys[:1])])  # duplicate, ignored
    assert not index.apply_sequenced("a", 2, [stored(keys[1:2])])  # batch 1 lost
    assert index.needs_dump("a") and index.stats().gaps == 1
    assert index.holdings("a") == {}
    assert not index.apply_sequenced("a", 3, [stored(keys[2:])])  # ignored until the dump
    index.load_dump("a", [stored(keys)], next_seq=4)
    assert not index.needs_dump("a")
    assert index.apply_sequenced("a", 4, [BlockRemoved(page_keys=(keys[2],))])
    assert index.find_matches(keys).by_instance["a"].num_pages == 2
    assert index.drop_instance("a") == 2
    assert index.instances() == []
    assert index.apply_sequenced("a", 0, [])  # a restarted instance counts from 0 again


def test_errors_change_nothing() -> None:
    index = PrefixIndex(4)
    keys = KEYER.page_keys(prompt(2))
    index.apply("a", [stored(keys[:1])])
    before = index.holdings("a")
    bad_batches = [
        [stored(keys[1:]), stored(keys, page=8)],
        [stored(keys[1:]), stored([b"short"])],
        [stored(keys[1:]), stored(keys, "nvme")],
        [stored(keys[1:]), "not an event"],
    ]
    for batch in bad_batches:
        with pytest.raises(InvalidEvent):
            index.apply("a", batch)
        assert index.holdings("a") == before
    with pytest.raises(InvalidEvent):
        index.apply_sequenced("a", -1, [])
    with pytest.raises(InvalidEvent):
        index.load_dump("a", [], next_seq=-1)
    for name in ("", None, 3):
        with pytest.raises(InvalidInstance):
            index.apply(name, [])  # type: ignore[arg-type]
    assert index.holdings("a") == before
    for kwargs in (
        {"page_size": 0},
        {"page_size": 4, "max_entries": 0},
        {"page_size": 4, "tier_weights": {"device": -1.0}},
        {"page_size": 4, "tier_weights": {}},
        {"page_size": 4, "keyer": PageKeyer(page_size=8)},
    ):
        with pytest.raises(InvalidParameter):
            PrefixIndex(**kwargs)  # type: ignore[arg-type]


class _Key(bytes):
    """A bytes subclass: a valid page key (hashed and compared as its bytes)."""


def test_page_keys_of_a_bytes_subclass_are_keys() -> None:
    """Either core (this folder also runs with KVSTRATA_NATIVE=0): events and lookups whose
    keys are a bytes subclass act as with the plain bytes; a wrong length is still refused."""
    index = PrefixIndex(4)
    keys = KEYER.page_keys(prompt(3))
    index.apply("a", [stored([keys[0], _Key(keys[1]), keys[2]])])
    index.apply(
        "b", [stored(keys[:2], "host"), BlockRemoved(page_keys=(_Key(keys[1]),), tier="host")]
    )
    index.check_integrity()
    query = [keys[0], _Key(keys[1]), keys[2]]
    assert index.match_lengths(query) == {"a": 3, "b": 1}
    assert index.find_matches(tuple(query)).by_instance["a"].num_pages == 3
    with pytest.raises(InvalidEvent, match="page keys"):
        index.apply("a", [stored([keys[0], _Key(keys[1][:5])])])
    assert index.match_lengths(list(keys)) == {"a": 3, "b": 1}


# ----------------------------------------------------------------------------------------------
# Re-entry: Python code run inside a call (a finalizer, a name's __hash__, an event's attribute)
# that calls the same index is refused with ReentrantCall, on both cores, and changes nothing.
# ----------------------------------------------------------------------------------------------
KEYS = KEYER.page_keys(prompt(4))
#: The finalizer-bearing object a test arms; emptying the list runs its finalizer right there.
_ARMED: list[object] = []


class _Finalized:
    """Calls `call` from its finalizer and appends the outcome: ("ok", result) or (error type,
    message)."""

    def __init__(self, call: Callable[[], object], outcomes: list[tuple[object, object]]) -> None:
        self.call = call
        self.outcomes = outcomes

    def __del__(self) -> None:
        try:
            self.outcomes.append(("ok", self.call()))
        except Exception as exc:  # noqa: BLE001 - the test compares it
            self.outcomes.append((type(exc), str(exc)))


class _TripName(str):
    """An instance name whose hashing runs the armed finalizer (the index hashes names in
    the middle of its calls)."""

    __slots__ = ()

    def __hash__(self) -> int:
        _ARMED.clear()
        return str.__hash__(self)


class _TripStored(BlockStored):
    """A BlockStored whose `page_keys` read runs the armed finalizer."""

    def __getattribute__(self, name: str) -> object:
        if name == "page_keys":
            _ARMED.clear()
        return super().__getattribute__(name)


INNER: dict[str, Callable[[PrefixIndex], object]] = {
    "apply": lambda ix: ix.apply("z", [stored(KEYS[:1])]),
    "apply_sequenced": lambda ix: ix.apply_sequenced("z", 0, [stored(KEYS[:1])]),
    "load_dump": lambda ix: ix.load_dump("z", [stored(KEYS[:1])], 3),
    "apply_engine_batch": lambda ix: ix.apply_engine_batch("z", b"\x90"),
    "drop_instance": lambda ix: ix.drop_instance("c"),
    "find_matches": lambda ix: ix.find_matches(KEYS),
    "find_matches(tokens)": lambda ix: ix.find_matches(prompt(2)),
    "match_lengths": lambda ix: ix.match_lengths(KEYS),
    "score": lambda ix: ix.score(KEYS),
    "holdings": lambda ix: ix.holdings("c"),
    "check_integrity": lambda ix: ix.check_integrity(),
}
#: The plain reads: answered at any time (a metrics scrape makes them from its own thread).
READS: dict[str, Callable[[PrefixIndex], object]] = {
    "stats": lambda ix: ix.stats(),
    "len": len,
    "instances": lambda ix: ix.instances(),
    "evicted_entries": lambda ix: ix.evicted_entries,
    "needs_dump": lambda ix: ix.needs_dump("a"),
}
#: (the call with a tripwire, the same call without one)
OUTER: dict[str, tuple[Callable[[PrefixIndex], object], Callable[[PrefixIndex], object]]] = {
    "apply(event)": (
        lambda ix: ix.apply(
            "a", [_TripStored(page_keys=tuple(KEYS), parent_key=None, tokens_per_page=4)]
        ),
        lambda ix: ix.apply("a", [stored(KEYS)]),
    ),
    "apply(new name)": (
        lambda ix: ix.apply(_TripName("b"), [stored(KEYS[1:3])]),
        lambda ix: ix.apply("b", [stored(KEYS[1:3])]),
    ),
    "apply_sequenced": (
        lambda ix: ix.apply_sequenced(_TripName("a"), 0, [stored(KEYS[2:])]),
        lambda ix: ix.apply_sequenced("a", 0, [stored(KEYS[2:])]),
    ),
    "load_dump": (
        lambda ix: ix.load_dump(_TripName("a"), [stored(KEYS[:3], "host")], 5),
        lambda ix: ix.load_dump("a", [stored(KEYS[:3], "host")], 5),
    ),
    "drop_instance": (
        lambda ix: ix.drop_instance(_TripName("a")),
        lambda ix: ix.drop_instance("a"),
    ),
    "holdings": (lambda ix: ix.holdings(_TripName("a")), lambda ix: ix.holdings("a")),
}


def _index(core: str) -> PrefixIndex:
    if core == "python":
        with native.disabled():
            index = PrefixIndex(4)
    else:
        index = PrefixIndex(4)
    index.apply("a", [stored(KEYS[:2])])
    index.apply("c", [stored(KEYS[:1], "host")])
    return index


def _state(index: PrefixIndex) -> object:
    index.check_integrity()
    return (
        index.stats(),
        index.instances(),
        {name: index.holdings(name) for name in index.instances()},
        index.find_matches(KEYS),
        [index.needs_dump(name) for name in index.instances()],
    )


@pytest.mark.parametrize("inner", list(INNER))
@pytest.mark.parametrize("outer", list(OUTER))
@pytest.mark.parametrize("core", ["default", "python"])
def test_a_finalizer_that_calls_the_index_mid_call_is_refused(
    core: str, outer: str, inner: str
) -> None:
    """A finalizer runs in the middle of `outer` and calls `inner` on the same index: the
    inner call raises ReentrantCall (before changing anything), the outer call goes on, and
    the index ends as the outer call alone leaves it. (Before: `drop_instance`, `holdings`
    and the Python core ran the inner call mid-update; the native `apply` raised a plain
    RuntimeError.) The default core is the native one where it builds."""
    index, plain = _index(core), _index(core)
    tripped, untripped = OUTER[outer]
    outcomes: list[tuple[object, object]] = []
    _ARMED.append(_Finalized(lambda: INNER[inner](index), outcomes))
    try:
        got = tripped(index)
    finally:
        _ARMED.clear()
    assert outcomes == [(ReentrantCall, REENTERED)]
    assert got == untripped(plain)
    assert _state(index) == _state(plain)


@pytest.mark.parametrize("core", ["default", "python"])
def test_a_finalizer_that_lets_the_refusal_escape_reports_it_as_unraisable(
    core: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The refusal cannot reach the finalizer's caller: Python reports it to
    `sys.unraisablehook`, as a ReentrantCall; the outer call is unaffected."""
    index, plain = _index(core), _index(core)
    seen: list[BaseException | None] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: seen.append(unraisable.exc_value))

    class Careless:
        def __del__(self) -> None:
            index.apply("z", [stored(KEYS[:1])])

    _ARMED.append(Careless())
    OUTER["apply(event)"][0](index)
    OUTER["apply(event)"][1](plain)
    assert len(seen) == 1 and isinstance(seen[0], ReentrantCall)
    assert _state(index) == _state(plain)


def test_a_second_call_from_another_thread_is_refused_while_one_runs() -> None:
    """The index is not thread-safe: a call from another thread while one runs (here held at
    a name's hashing) is refused like a re-entry, not run over it."""
    index, plain = _index("default"), _index("default")
    outcomes: list[tuple[object, object]] = []

    def from_thread() -> None:
        worker = threading.Thread(target=lambda: outcomes.append(_outcome(index)))
        worker.start()
        worker.join()

    _ARMED.append(_Finalized(from_thread, []))
    OUTER["drop_instance"][0](index)
    OUTER["drop_instance"][1](plain)
    assert outcomes == [(ReentrantCall, REENTERED)]
    assert _state(index) == _state(plain)


def _outcome(index: PrefixIndex) -> tuple[object, object]:
    try:
        return ("ok", index.apply("z", [stored(KEYS[:1])]))
    except ReentrantCall as exc:
        return (ReentrantCall, str(exc))


@pytest.mark.parametrize("outer", list(OUTER))
@pytest.mark.parametrize("core", ["default", "python"])
def test_a_finalizer_may_read_the_counters_mid_call(core: str, outer: str) -> None:
    """The plain reads take no guard: from a finalizer run in the middle of `outer` (where it
    runs, before `outer` changes anything) they answer what they answered before the call."""
    index, plain = _index(core), _index(core)
    tripped, untripped = OUTER[outer]
    before = {what: read(index) for what, read in READS.items()}
    outcomes: list[tuple[object, object]] = []
    _ARMED.append(_Finalized(lambda: {what: read(index) for what, read in READS.items()}, outcomes))
    try:
        tripped(index)
    finally:
        _ARMED.clear()
    untripped(plain)
    assert outcomes == [("ok", before)]
    assert _state(index) == _state(plain)


def test_a_scrape_thread_reads_the_counters_while_a_call_runs() -> None:
    """A metrics scrape reads `stats()` from its own thread, with no lock: while the index is
    in the middle of a call it gets the counters, not ReentrantCall."""
    index = _index("default")
    before = index.stats()
    read: list[object] = []

    def scrape() -> None:
        worker = threading.Thread(target=lambda: read.append((index.stats(), len(index))))
        worker.start()
        worker.join()

    _ARMED.append(_Finalized(scrape, []))
    OUTER["drop_instance"][0](index)
    assert read == [(before, before.num_entries)]
