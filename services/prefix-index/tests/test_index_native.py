"""The compiled core (`index_core.c` + `index_ext.c`, an extension module built by
`kvstrata.prefix_index.native`) against the Python entries it replaces: twin indexes, one made
inside `kvstrata.pool.native.disabled()`, fed the same random event streams (stores, removals
per tier, clears, multi-event batches, drops with ids reused, bad events and bad instance
names, events as lists, tuples and generators, queries as lists, tuples and token ids),
bounded and unbounded, must give the same find_matches, match_lengths, score, holdings, len and
stats (and the same errors, type and message) after every step, and pass check_integrity; a
call made from inside a batch being applied is refused alike (ReentrantCall). Keys whose hashes
collide in the C table's slot bits stay distinct entries."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvstrata.pool import native
from kvstrata.prefix_index import PrefixIndex, ReentrantCall
from kvstrata.prefix_index.errors import REENTERED
from kvstrata.prefix_index.native import Core, native_core
from kvstrata.prefix_index.opstream import build_op_stream
from kvstrata.unified_radix_cache import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

pytestmark = pytest.mark.skipif(
    native_core(32, {"device": 1}, None) is None, reason="no compiled index core"
)

KEYS = tuple(bytes([i]) * 31 + bytes([i % 3]) for i in range(14))
TIERS = ("device", "host", "storage")
NAMES = ("a", "b", "c", "d", "e", "f")
runs = st.tuples(st.integers(0, 13), st.integers(1, 7)).map(lambda t: KEYS[t[0] : t[0] + t[1]])
queries = st.lists(st.sampled_from(KEYS), max_size=9) | runs.map(list)


def twins(**kwargs: object) -> tuple[PrefixIndex, PrefixIndex]:
    """A native index and a Python one."""
    fast = PrefixIndex(1, **kwargs)  # pyright: ignore[reportArgumentType]
    with native.disabled():
        slow = PrefixIndex(1, **kwargs)  # pyright: ignore[reportArgumentType]
    assert fast.core == "native" and slow.core == "python"
    return fast, slow


def core_of(index: PrefixIndex) -> Core:
    core = index._core
    assert core is not None
    return core


def both(fast: PrefixIndex, slow: PrefixIndex, op: Callable[[PrefixIndex], object]) -> object:
    """Run `op` on both: the same result, or the same error (type and message)."""
    outcomes: list[tuple[str, object]] = []
    for index in (fast, slow):
        try:
            outcomes.append(("ok", op(index)))
        except Exception as exc:  # noqa: BLE001 - compared below
            outcomes.append((type(exc).__name__, str(exc)))
    assert outcomes[0] == outcomes[1]
    return outcomes[0][1]


events = st.one_of(
    st.builds(
        lambda keys, tier: BlockStored(
            page_keys=keys, parent_key=None, tokens_per_page=1, tier=tier
        ),
        runs,
        st.sampled_from(TIERS),
    ),
    st.builds(
        lambda keys, tier: BlockRemoved(page_keys=tuple(keys), tier=tier),
        st.lists(st.sampled_from(KEYS), max_size=7),
        st.sampled_from(TIERS),
    ),
    st.builds(lambda tier: AllBlocksCleared(tier=tier), st.sampled_from((*TIERS, None))),
)
bad_events = st.sampled_from(
    [
        BlockStored(page_keys=(b"short",), parent_key=None, tokens_per_page=1),
        BlockStored(page_keys=KEYS[:2], parent_key=None, tokens_per_page=2),
        BlockRemoved(page_keys=KEYS[:1], tier="tape"),
        AllBlocksCleared(tier="tape"),
    ]
)


def shaped(batch: list[KVEvent], form: str) -> Iterable[KVEvent]:
    """The batch as a list, a tuple or a one-shot generator (apply reads each once)."""
    if form == "tuple":
        return tuple(batch)
    if form == "iter":
        return (event for event in batch)
    return batch


forms = st.sampled_from(("list", "tuple", "iter"))

#: Calls made from inside another call of the index (see `NativeVersusPython.reenter`).
REENTRIES: dict[str, Callable[[PrefixIndex], object]] = {
    "apply": lambda ix: ix.apply(
        "f", [BlockStored(page_keys=KEYS[:1], parent_key=None, tokens_per_page=1)]
    ),
    "apply_sequenced": lambda ix: ix.apply_sequenced("f", 0, []),
    "load_dump": lambda ix: ix.load_dump("a", [], 0),
    "drop_instance": lambda ix: ix.drop_instance("a"),
    "find_matches": lambda ix: ix.find_matches(list(KEYS)),
    "match_lengths": lambda ix: ix.match_lengths(list(KEYS)),
    "holdings": lambda ix: ix.holdings("a"),
    "check_integrity": lambda ix: ix.check_integrity(),
}


class NativeVersusPython(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.fast, self.slow = twins()

    @rule(bound=st.sampled_from((None, 3, 6, 10)))
    def restart(self, bound: int | None) -> None:
        """Start over with a bound (small ones evict on most stores)."""
        self.fast, self.slow = twins(max_entries=bound)

    @rule(name=st.sampled_from(NAMES), batch=st.lists(events, max_size=4), form=forms)
    def apply(self, name: str, batch: list[KVEvent], form: str) -> None:
        both(self.fast, self.slow, lambda ix: ix.apply(name, shaped(batch, form)))

    @rule(
        name=st.sampled_from(NAMES),
        good=st.lists(events, max_size=2),
        bad=bad_events,
        form=forms,
    )
    def apply_bad(self, name: str, good: list[KVEvent], bad: KVEvent, form: str) -> None:
        err = both(self.fast, self.slow, lambda ix: ix.apply(name, shaped([*good, bad], form)))
        assert isinstance(err, str), "a bad event must be refused"

    @rule(name=st.sampled_from(("", None, 7, b"a")), batch=st.lists(events, max_size=2))
    def apply_bad_name(self, name: object, batch: list[KVEvent]) -> None:
        err = both(self.fast, self.slow, lambda ix: ix.apply(name, batch))  # pyright: ignore[reportArgumentType]
        assert isinstance(err, str), "a bad instance name must be refused"

    @rule(name=st.sampled_from(NAMES), keys=runs, inner=st.sampled_from(sorted(REENTRIES)))
    def reenter(self, name: str, keys: tuple[bytes, ...], inner: str) -> None:
        """An event's attribute read (Python code run inside `apply`) calls the index: the
        inner call is refused alike on both cores, and the batch is applied as if it had
        not been made."""

        def outer(ix: PrefixIndex) -> list[object]:
            seen: list[object] = []

            class Calling(BlockStored):
                def __getattribute__(self, attr: str) -> object:
                    if attr == "tier" and not seen:
                        try:
                            seen.append(("ok", REENTRIES[inner](ix)))
                        except Exception as exc:  # noqa: BLE001 - compared below
                            seen.append((type(exc).__name__, str(exc)))
                    return super().__getattribute__(attr)

            ix.apply(name, [Calling(page_keys=keys, parent_key=None, tokens_per_page=1)])
            return seen

        assert both(self.fast, self.slow, outer) == [("ReentrantCall", REENTERED)]

    @rule(name=st.sampled_from(NAMES))
    def drop(self, name: str) -> None:
        both(self.fast, self.slow, lambda ix: ix.drop_instance(name))

    @rule(query=queries, as_tuple=st.booleans())
    def find(self, query: list[bytes], as_tuple: bool) -> None:
        asked = tuple(query) if as_tuple else query
        both(self.fast, self.slow, lambda ix: ix.find_matches(asked))

    @rule(tokens=st.lists(st.integers(0, 3), max_size=6))
    def find_tokens(self, tokens: list[int]) -> None:
        both(self.fast, self.slow, lambda ix: ix.find_matches(np.asarray(tokens, np.int64)))

    @rule(query=queries)
    def lengths(self, query: list[bytes]) -> None:
        both(self.fast, self.slow, lambda ix: ix.match_lengths(query))

    @rule(query=queries)
    def score(self, query: list[bytes]) -> None:
        both(self.fast, self.slow, lambda ix: ix.score(query))

    @invariant()
    def agree(self) -> None:
        for index in (self.fast, self.slow):
            index.check_integrity()
        assert len(self.fast) == len(self.slow)
        assert self.fast.stats() == self.slow.stats()
        assert self.fast.evicted_entries == self.slow.evicted_entries
        assert self.fast.instances() == self.slow.instances()
        for name in NAMES:
            assert self.fast.holdings(name) == self.slow.holdings(name)
        # The same answers for the same prefix-ordered queries (touching both alike).
        for query in (list(KEYS), list(KEYS[5:]), [KEYS[0], KEYS[2], KEYS[1]]):
            assert self.fast.find_matches(query) == self.slow.find_matches(query)


TestNativeVersusPython = NativeVersusPython.TestCase
TestNativeVersusPython.settings = settings(max_examples=120, stateful_step_count=30, deadline=None)


def test_queries_with_odd_keys_stop_where_the_python_index_stops() -> None:
    fast, slow = twins()
    for index in (fast, slow):
        index.apply("a", [BlockStored(page_keys=KEYS[:4], parent_key=None, tokens_per_page=1)])
    # A 33-byte key then a 31-byte one: joined they are 64 bytes, as two keys would be.
    spliced = [KEYS[0], KEYS[1] + KEYS[2][:1], KEYS[2][1:], KEYS[3]]
    queries = (spliced, [KEYS[0], "text", KEYS[1]], [KEYS[0], KEYS[1][:16]], [], tuple(KEYS))
    for query in queries:
        assert fast.find_matches(query) == slow.find_matches(query)
        assert fast.match_lengths(query) == slow.match_lengths(query)
    assert fast.find_matches(spliced).by_instance["a"].num_pages == 1


def _colliding_keys(core: Core) -> tuple[bytes, bytes]:
    """Two distinct keys whose hashes agree in the 32 bits a slot keeps (same home slot, same
    tag): only the full key comparison tells them apart. Birthday search, fixed seed."""
    rng = np.random.default_rng(7)
    raw = rng.integers(0, 256, size=(300_000, 32), dtype=np.uint8)
    keys = [row.tobytes() for row in raw]
    low = np.array(core.hashes(keys), dtype=np.uint64) & np.uint64(0xFFFFFFFF)
    order = np.argsort(low, kind="stable")
    same = np.flatnonzero(low[order][1:] == low[order][:-1])
    assert same.size, "no 32-bit collision among 300k keys (probability ~3e-5)"
    a, b = keys[order[same[0]]], keys[order[same[0] + 1]]
    assert a != b
    return a, b


def test_keys_that_collide_in_the_table_stay_distinct() -> None:
    fast, slow = twins(max_entries=4)
    core = core_of(fast)
    a, b = _colliding_keys(core)
    hashes = core.hashes([a, b])
    assert hashes[0] & 0xFFFFFFFF == hashes[1] & 0xFFFFFFFF
    for index in (fast, slow):
        index.apply("x", [BlockStored(page_keys=(a,), parent_key=None, tokens_per_page=1)])
        index.apply(
            "y", [BlockStored(page_keys=(b,), parent_key=None, tokens_per_page=1, tier="host")]
        )
        index.check_integrity()
    assert fast.find_matches([a]) == slow.find_matches([a])
    assert fast.find_matches([a]).by_instance == {"x": (1, ("device",))}
    assert fast.find_matches([b]).by_instance == {"y": (1, ("host",))}
    assert fast.match_lengths([a, b]) == {"x": 1}
    fast.apply("x", [BlockRemoved(page_keys=(a,))])
    fast.check_integrity()
    assert fast.find_matches([a]).by_instance == {}
    assert fast.find_matches([b]).by_instance == {"y": (1, ("host",))}
    assert len(fast) == 1


def test_twins_agree_on_every_lookup_of_an_op_stream() -> None:
    rng = np.random.default_rng(3)
    prompts = [
        [int(t) for t in rng.integers(0, 4, size=int(rng.integers(2, 30)))] for _ in range(300)
    ]
    stream = build_op_stream(prompts, num_instances=3, capacity_pages=120)
    for bound in (None, 150, 40):
        fast, slow = twins(max_entries=bound)
        for req in stream.requests:
            assert fast.find_matches(req.page_keys) == slow.find_matches(req.page_keys)
            fast.apply(req.instance, req.events)
            slow.apply(req.instance, req.events)
        fast.check_integrity()
        assert fast.stats() == slow.stats()
        assert fast.native_bytes() > 0 and slow.native_bytes() == 0


def test_kvstrata_native_0_keeps_the_python_core(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvstrata.pool.native import build_extension
    from kvstrata.prefix_index.native import MODULE, source

    monkeypatch.setenv("KVSTRATA_NATIVE", "0")
    made = build_extension(source(), MODULE)
    assert made.module is None and "KVSTRATA_NATIVE" in made.reason


class _Key(bytes):
    """A bytes subclass: hashed and compared as its bytes, so the Python entries take it."""


def test_keys_of_a_bytes_subclass_count_as_their_bytes() -> None:
    fast, slow = twins()
    for index in (fast, slow):
        index.apply("a", [BlockStored(page_keys=KEYS[:4], parent_key=None, tokens_per_page=1)])
    odd = [KEYS[0], _Key(KEYS[1]), KEYS[2]]
    queries = (
        odd,
        tuple(odd),
        [_Key(KEYS[0]), *KEYS[1:4]],
        [KEYS[0], _Key(KEYS[1][:16]), KEYS[2]],  # a subclass of the wrong length ends the run
    )
    for query in queries:
        assert fast.find_matches(query) == slow.find_matches(query)
        assert fast.match_lengths(query) == slow.match_lengths(query)
    assert fast.match_lengths(odd) == {"a": 3}
    # Events whose keys are of the subclass: one event (the fast path) and batches.
    host = BlockStored(page_keys=tuple(odd), parent_key=None, tokens_per_page=1, tier="host")
    batches: list[tuple[str, list[KVEvent]]] = [
        ("b", [host]),
        ("a", [BlockRemoved(page_keys=(_Key(KEYS[3]),))]),
        (
            "c",
            [
                BlockStored(page_keys=(_Key(KEYS[0]), KEYS[1]), parent_key=None, tokens_per_page=1),
                BlockRemoved(page_keys=(_Key(KEYS[1]),)),
            ],
        ),
    ]
    for name, batch in batches:
        for index in (fast, slow):
            index.apply(name, batch)
            index.check_integrity()
        for query in (list(KEYS[:4]), odd):
            assert fast.find_matches(query) == slow.find_matches(query)
        assert fast.stats() == slow.stats()
        for held in ("a", "b", "c"):
            assert fast.holdings(held) == slow.holdings(held)
    assert fast.match_lengths(odd) == {"a": 3, "b": 3, "c": 1}


def _state(index: PrefixIndex) -> tuple[object, int, dict[str, object]]:
    return (
        index.stats(),
        len(index),
        {name: index.holdings(name) for name in index.instances()},
    )


@pytest.mark.parametrize("bound", [None, 17])
def test_a_failed_allocation_changes_nothing(bound: int | None) -> None:
    """`a` holds 16 keys (its key list full): storing a 17th grows the list. Each allocation
    in turn fails: MemoryError, and the index is as before (no entry without holders, no
    eviction on a bounded index); once none fails, the twins agree."""
    new = bytes([99]) * 32
    failures = 0
    for after in range(40):
        fast, slow = twins(max_entries=bound)
        core = core_of(fast)
        owned = tuple(bytes([i]) * 32 for i in range(100, 116))
        for index in (fast, slow):
            index.apply(
                "b", [BlockStored(page_keys=(KEYS[0],), parent_key=None, tokens_per_page=1)]
            )
            index.apply("a", [BlockStored(page_keys=owned, parent_key=None, tokens_per_page=1)])
        before = _state(fast)
        event = BlockStored(page_keys=(new,), parent_key=None, tokens_per_page=1)
        core.fail_allocation(after)
        try:
            fast.apply("a", [event])
        except MemoryError:
            failures += 1
            fast.check_integrity()
            assert _state(fast) == before == _state(slow)
            continue
        finally:
            left = core.fail_allocation(-1)
        # No error: the failure did not happen.
        slow.apply("a", [event])
        fast.check_integrity()
        assert _state(fast) == _state(slow)
        assert fast.find_matches([new]) == slow.find_matches([new])
        if left >= 0:  # no allocation failed: every one was tried
            break
    else:
        pytest.fail("the store failed for every allocation")
    assert failures, "no allocation failed: the path under test was not taken"


def test_a_batch_cut_short_by_a_failed_allocation_stays_consistent() -> None:
    """A store of 3000 new keys grows the table, the entries, the key list and the scratch
    arrays: each allocation in turn fails. MemoryError, a consistent index holding part of
    the batch; the same batch applied again then gives what the Python index holds."""
    keys = tuple(i.to_bytes(32, "big") for i in range(3000))
    event = BlockStored(page_keys=keys, parent_key=None, tokens_per_page=1)
    failures = 0
    for after in range(80):
        fast, slow = twins(max_entries=2500)
        core = core_of(fast)
        core.fail_allocation(after)
        try:
            fast.apply("a", [event])
        except MemoryError:
            failures += 1
            fast.check_integrity()
            assert set(fast.holdings("a")) <= set(keys)
            fast.apply("a", [event])
        finally:
            left = core.fail_allocation(-1)
        slow.apply("a", [event])
        fast.check_integrity()
        assert _state(fast) == _state(slow)
        if left >= 0:  # no allocation failed: every one was tried
            break
    else:
        pytest.fail("the store failed for every allocation")
    assert failures >= 5


def test_a_dropped_native_index_is_collected() -> None:
    """The C core holds the index's bound methods (interning, keying): a cycle the garbage
    collector must see and break."""
    import gc
    import weakref

    index = PrefixIndex(1)
    index.apply("a", [BlockStored(page_keys=KEYS[:3], parent_key=None, tokens_per_page=1)])
    gone = weakref.ref(index)
    del index
    gc.collect()
    assert gone() is None


def test_a_new_instance_fed_a_generator_gets_every_event() -> None:
    fast, slow = twins()
    batch = [
        BlockStored(page_keys=KEYS[:4], parent_key=None, tokens_per_page=1),
        BlockRemoved(page_keys=KEYS[2:3]),
    ]
    for index in (fast, slow):
        index.apply("new", (event for event in batch))
        index.check_integrity()
    assert fast.holdings("new") == slow.holdings("new") and len(fast.holdings("new")) == 3
    assert fast.find_matches(list(KEYS[:4])) == slow.find_matches(list(KEYS[:4]))


def test_the_core_refuses_bad_arguments_without_changing_anything() -> None:
    fast, _ = twins()
    fast.apply("a", [BlockStored(page_keys=KEYS[:2], parent_key=None, tokens_per_page=1)])
    core = core_of(fast)
    before = core.stats()
    with pytest.raises(TypeError, match="keyword"):
        fast.find_matches(list(KEYS), extra=1)  # pyright: ignore[reportCallIssue]
    with pytest.raises(ValueError, match="key 1"):
        core.apply_keys(0, 0, 1, [KEYS[3], b"short"])
    with pytest.raises(ValueError, match="kind 0 or 1"):
        core.apply_keys(0, 2, 1, [KEYS[3]])
    with pytest.raises(ValueError, match="tier bits"):
        core.apply_keys(0, 0, 64, [KEYS[3]])
    with pytest.raises(ValueError, match="out of range"):
        core.apply_keys(-1, 0, 1, [KEYS[3]])
    with pytest.raises(ValueError, match="out of range"):
        core.set_name(1 << 30, "x")
    with pytest.raises(ValueError, match="key 0"):
        core.hashes(["text"])  # pyright: ignore[reportArgumentType]
    assert core.stats() == before
    bare = native_core(32, {"device": 1}, None)
    assert bare is not None
    stored = BlockStored(page_keys=KEYS[:1], parent_key=None, tokens_per_page=1)
    with pytest.raises(LookupError, match="no id"):
        bare.apply("a", [stored])  # no interning callback: an unknown name is an error
    with pytest.raises(TypeError, match="page keys"):
        bare.find_matches([1, 2, 3])  # no keyer: token ids are refused
    bare.apply_keys(0, 0, 1, list(KEYS[:3]))
    assert bare.match_count(list(KEYS[:2])) == 1 and bare.stats()[:2] == (3, 3)


def test_a_call_that_re_enters_the_core_is_refused_and_changes_nothing() -> None:
    """Python code can run inside a native call (here an event's attribute read): a call of
    the same core from there would move its scratch buffers under the outer call, so it
    raises ReentrantCall (a RuntimeError), and the outer call, which then fails, has changed
    nothing."""
    index = PrefixIndex(1)
    index.apply("a", [BlockStored(page_keys=KEYS[:2], parent_key=None, tokens_per_page=1)])
    seen: list[BaseException] = []

    class Sneaky(BlockStored):
        def __getattribute__(self, name: str) -> object:
            if name == "page_keys":
                try:
                    index.find_matches(list(KEYS))
                except ReentrantCall as exc:
                    seen.append(exc)
                    raise
            return super().__getattribute__(name)

    before = index.stats(), index.holdings("a")
    with pytest.raises(ReentrantCall, match="called again"):
        index.apply("a", [Sneaky(page_keys=KEYS[2:4], parent_key=None, tokens_per_page=1)])
    assert seen and (index.stats(), index.holdings("a")) == before
    index.check_integrity()
    assert index.find_matches(list(KEYS)).by_instance["a"].num_pages == 2


def test_an_event_list_changed_during_apply_is_read_as_it_was_at_the_call() -> None:
    """Python code run inside `apply` (an event's attribute read) empties the caller's list
    and allocates over the freed storage: the native core reads a snapshot taken at the call
    (it read the list in place and crashed), so the batch applied is the one passed."""
    fast, slow = twins()
    events: list[KVEvent] = []

    class Shrinking(BlockStored):
        def __getattribute__(self, name: str) -> object:
            if name == "tier" and events:
                events.clear()
                _ = [object() for _ in range(10_000)]
            return super().__getattribute__(name)

    plain = [BlockStored(page_keys=(k,), parent_key=None, tokens_per_page=1) for k in KEYS[1:]]
    events += [Shrinking(page_keys=KEYS[:1], parent_key=None, tokens_per_page=1), *plain]
    fast.apply("a", events)
    assert events == []
    slow.apply("a", [BlockStored(page_keys=KEYS[:1], parent_key=None, tokens_per_page=1), *plain])
    fast.check_integrity()
    assert fast.holdings("a") == slow.holdings("a") and fast.stats() == slow.stats()


def test_without_python_headers_the_python_core_runs_and_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvstrata.pool.native import ExtensionBuild
    from kvstrata.prefix_index import native as index_native

    reason = "no Python headers (Python.h) in '/nowhere'"
    monkeypatch.setattr(
        index_native, "native_extension", lambda *_: ExtensionBuild(None, None, reason)
    )
    assert index_native.native_status() == f"python: {reason}"
    index = PrefixIndex(1)
    assert index.core == "python"
    index.apply("a", [BlockStored(page_keys=KEYS[:2], parent_key=None, tokens_per_page=1)])
    assert index.match_lengths(list(KEYS)) == {"a": 2}


def test_both_cores_take_the_same_arguments_and_a_subclass_keeps_its_overrides() -> None:
    """The first argument of apply / find_matches / match_lengths is positional-only on both
    cores (the C methods take no keywords for it), and an override in a subclass is called,
    not bypassed by the C method bound on the instance."""
    fast, slow = twins()
    stored = [BlockStored(page_keys=KEYS[:2], parent_key=None, tokens_per_page=1)]
    for index in (fast, slow):
        with pytest.raises(TypeError):
            index.apply(instance="a", events=stored)  # pyright: ignore[reportCallIssue]
        with pytest.raises(TypeError):
            index.find_matches(tokens_or_page_keys=list(KEYS))  # pyright: ignore[reportCallIssue]
        with pytest.raises(TypeError):
            index.match_lengths(page_keys=list(KEYS))  # pyright: ignore[reportCallIssue]
        index.apply("a", stored)
    assert fast.match_lengths(list(KEYS)) == slow.match_lengths(list(KEYS)) == {"a": 2}
    calls: list[str] = []

    class Counting(PrefixIndex):
        def apply(self, instance: str, events: Iterable[KVEvent], /) -> None:
            calls.append(instance)
            super().apply(instance, events)

    counting = Counting(1)
    assert counting.core == "native"
    counting.apply("b", stored)
    assert calls == ["b"] and counting.match_lengths(list(KEYS)) == {"b": 2}


def test_every_core_method_but_the_reads_refuses_a_call_inside_another() -> None:
    """Called from inside `Core.apply` (an event's attribute read), every method of the core
    raises ReentrantCall, the index's own multi-call ones (set_name, drop, holdings, hold,
    apply_held) included; stats and check, which run no Python code mid-read, answer. The
    outer apply then completes."""
    fast, slow = twins()
    for index in (fast, slow):
        index.apply("a", [BlockStored(page_keys=KEYS[:3], parent_key=None, tokens_per_page=1)])
    core = core_of(fast)
    stored = [BlockStored(page_keys=KEYS[:1], parent_key=None, tokens_per_page=1)]
    calls: dict[str, Callable[[], object]] = {
        "apply": lambda: core.apply("b", stored),
        "apply_held": lambda: core.apply_held("b", stored),
        "find_matches": lambda: core.find_matches(list(KEYS)),
        "lengths": lambda: core.lengths(list(KEYS)),
        "set_name": lambda: core.set_name(0, None),
        "drop": lambda: core.drop(0),
        "holdings": lambda: core.holdings(0),
        "hold": core.hold,
        "hashes": lambda: core.hashes(list(KEYS)),
        "match_count": lambda: core.match_count(list(KEYS)),
        "apply_keys": lambda: core.apply_keys(0, 1, 1, list(KEYS)),
    }
    seen: dict[str, object] = {}

    class Calling(BlockStored):
        def __getattribute__(self, name: str) -> object:
            if name == "tier" and not seen:
                for what, call in calls.items():
                    try:
                        seen[what] = call()
                    except ReentrantCall as exc:
                        seen[what] = str(exc)
                seen["stats"], seen["check"] = core.stats(), core.check()
            return super().__getattribute__(name)

    fast.apply("a", [Calling(page_keys=KEYS[3:5], parent_key=None, tokens_per_page=1)])
    slow.apply("a", [BlockStored(page_keys=KEYS[3:5], parent_key=None, tokens_per_page=1)])
    assert {what: seen[what] for what in calls} == dict.fromkeys(calls, REENTERED)
    stats = seen["stats"]
    assert isinstance(stats, tuple) and stats[:3] == (3, 3, 0) and seen["check"] == 0
    fast.check_integrity()
    assert _state(fast) == _state(slow) and fast.holdings("a") == slow.holdings("a")


def test_hold_lets_only_the_index_s_own_calls_through() -> None:
    """Inside `hold()` the public calls are refused and set_name / drop / holdings /
    apply_held run; release() or apply_held() outside a hold is a RuntimeError, and nothing
    changes on a refused call."""
    index = PrefixIndex(1)
    index.apply("a", [BlockStored(page_keys=KEYS[:2], parent_key=None, tokens_per_page=1)])
    core = core_of(index)
    stored = [BlockStored(page_keys=KEYS[2:3], parent_key=None, tokens_per_page=1)]
    with pytest.raises(RuntimeError, match=r"release\(\) without hold"):
        core.release()
    with pytest.raises(RuntimeError, match=r"apply_held\(\) outside hold"):
        core.apply_held("a", stored)
    before = _state(index)
    core.hold()
    try:
        for refused in (
            lambda: index.apply("a", stored),
            lambda: index.find_matches(list(KEYS)),
            lambda: index.match_lengths(list(KEYS)),
            core.hold,
            lambda: index.drop_instance("a"),
            lambda: index.holdings("a"),
        ):
            with pytest.raises(ReentrantCall):
                refused()
        assert index.stats() == before[0] and len(index) == before[1]  # plain reads answer
        assert sorted(core.holdings(0)) == [(KEYS[0], 1), (KEYS[1], 1)]
        core.apply_held("a", stored)
        assert len(core.holdings(0)) == 3
    finally:
        core.release()
    assert _state(index) != before and index.match_lengths(list(KEYS)) == {"a": 3}
    index.check_integrity()
