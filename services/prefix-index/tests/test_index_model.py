"""The packed-int layout against a plain model (instance -> key -> set of tiers): many
instances sharing keys on several tiers, removals of one tier, clears, drops (ids reused);
holdings, matches and tiers agree and `check_integrity` holds after every step."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvstrata.prefix_index import PrefixIndex
from kvstrata.unified_radix_cache import AllBlocksCleared, BlockRemoved, BlockStored

KEYS = tuple(bytes([i]) * 32 for i in range(12))
TIERS = ("device", "host", "storage")
NAMES = ("a", "b", "c", "d", "e")
runs = st.tuples(st.integers(0, 11), st.integers(1, 6)).map(lambda t: KEYS[t[0] : t[0] + t[1]])


class IndexVersusModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.index = PrefixIndex(1)
        self.model: dict[str, dict[bytes, set[str]]] = {}

    @rule(name=st.sampled_from(NAMES), keys=runs, tier=st.sampled_from(TIERS))
    def store(self, name: str, keys: tuple[bytes, ...], tier: str) -> None:
        self.index.apply(
            name, [BlockStored(page_keys=keys, parent_key=None, tokens_per_page=1, tier=tier)]
        )
        held = self.model.setdefault(name, {})
        for key in keys:
            held.setdefault(key, set()).add(tier)

    @rule(
        name=st.sampled_from(NAMES),
        keys=st.lists(st.sampled_from(KEYS), max_size=6),
        tier=st.sampled_from(TIERS),
    )
    def remove(self, name: str, keys: list[bytes], tier: str) -> None:
        self.index.apply(name, [BlockRemoved(page_keys=tuple(keys), tier=tier)])
        held = self.model.get(name, {})
        for key in keys:
            if key in held:
                held[key].discard(tier)
                if not held[key]:
                    del held[key]

    @rule(name=st.sampled_from(NAMES), tier=st.sampled_from((*TIERS, None)))
    def clear(self, name: str, tier: str | None) -> None:
        self.index.apply(name, [AllBlocksCleared(tier=tier)])
        held = self.model.get(name, {})
        for key in list(held):
            held[key] -= set(TIERS) if tier is None else {tier}
            if not held[key]:
                del held[key]

    @rule(name=st.sampled_from(NAMES))
    def drop(self, name: str) -> None:
        expected = len(self.model.pop(name, {}))
        assert self.index.drop_instance(name) == expected

    @invariant()
    def agrees(self) -> None:
        self.index.check_integrity()
        for name in NAMES:
            want = {k: frozenset(t) for k, t in self.model.get(name, {}).items()}
            assert self.index.holdings(name) == want
        for start in (0, 3):
            query = list(KEYS[start:])
            got = self.index.find_matches(query).by_instance
            want: dict[str, tuple[str, ...]] = {}
            for name, held in self.model.items():
                tiers: list[str] = []
                for key in query:
                    if key not in held:
                        break
                    tiers.append(min(held[key], key=TIERS.index))  # best: device first
                if tiers:
                    want[name] = tuple(tiers)
            assert {n: m.tiers for n, m in got.items()} == want
            assert {n: m.num_pages for n, m in got.items()} == {n: len(t) for n, t in want.items()}
            assert self.index.match_lengths(query) == {n: len(t) for n, t in want.items()}


TestIndexVersusModel = IndexVersusModel.TestCase
TestIndexVersusModel.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
