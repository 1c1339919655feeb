"""The index equals the union of the instances' trees, whatever the interleaving of requests,
delivered and lost event batches, dumps after gaps, instance deaths and cache resets."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstrata.prefix_index import PrefixIndex, SimInstance, dump_tree
from kvstrata.unified_radix_cache import BlockStored, KVEvent

PAGE = 2
NAMES: tuple[str, ...] = ("a", "b", "c")
# Prompts over a tiny alphabet in whole pages, so instances share prefixes and trees split.
prompts = st.lists(st.integers(0, 2), min_size=1, max_size=6).map(
    lambda pages: [t for p in pages for t in (p, p + 10)]
)


def tree_keys(instance: SimInstance) -> frozenset[bytes]:
    out: set[bytes] = set()
    for event in dump_tree(instance.tree):
        assert isinstance(event, BlockStored)
        out.update(event.page_keys)
    return frozenset(out)


class IndexVersusTrees(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.index = PrefixIndex(PAGE)
        self.instances = {n: SimInstance(n, capacity_pages=5, page_size=PAGE) for n in NAMES}
        # Per instance: batches produced and not yet delivered or lost, oldest first.
        self.pending: dict[str, list[tuple[int, list[KVEvent], frozenset[bytes]]]] = {
            n: [] for n in NAMES
        }
        self.produced = dict.fromkeys(NAMES, 0)
        # What the index must hold per instance: the tree as of the last batch it applied.
        self.expected: dict[str, frozenset[bytes]] = dict.fromkeys(NAMES, frozenset())
        # A batch lost since the last dump and not yet noticed (the gap shows at the next one).
        self.lost = dict.fromkeys(NAMES, False)

    @rule(name=st.sampled_from(NAMES), prompt=prompts)
    def serve(self, name: str, prompt: list[int]) -> None:
        inst = self.instances[name]
        inst.serve(prompt)
        self._publish(name)

    @rule(name=st.sampled_from(NAMES))
    def reset_cache(self, name: str) -> None:
        self.instances[name].tree.reset()
        self._publish(name)

    @precondition(lambda self: any(self.pending.values()))
    @rule(data=st.data())
    def deliver(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from([n for n in NAMES if self.pending[n]]))
        seq, events, after = self.pending[name].pop(0)
        applied = self.index.apply_sequenced(name, seq, events)
        if applied:
            self.expected[name] = after
        elif self.index.needs_dump(name):
            self.expected[name] = frozenset()

    @precondition(lambda self: any(self.pending.values()))
    @rule(data=st.data())
    def lose(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from([n for n in NAMES if self.pending[n]]))
        self.pending[name].pop(0)
        self.lost[name] = True

    @rule(name=st.sampled_from(NAMES))
    def dump(self, name: str) -> None:
        inst = self.instances[name]
        self.index.load_dump(name, dump_tree(inst.tree), next_seq=self.produced[name])
        self.expected[name] = tree_keys(inst)
        self.lost[name] = False

    @rule(name=st.sampled_from(NAMES))
    def instance_dies(self, name: str) -> None:
        self.index.drop_instance(name)
        self.instances[name] = SimInstance(name, capacity_pages=5, page_size=PAGE)
        self.pending[name] = []
        self.produced[name] = 0
        self.expected[name] = frozenset()
        self.lost[name] = False

    @rule(prompt=prompts)
    def query(self, prompt: list[int]) -> None:
        keys = self.index.page_keys(prompt)
        want: dict[str, int] = {}
        for name, held in self.expected.items():
            n = 0
            while n < len(keys) and keys[n] in held:
                n += 1
            if n:
                want[name] = n
        assert self.index.match_lengths(keys) == want
        matches = self.index.find_matches(prompt)
        assert {n: m.num_pages for n, m in matches.by_instance.items()} == want
        assert all(set(m.tiers) == {"device"} for m in matches.by_instance.values())

    def _publish(self, name: str) -> None:
        inst = self.instances[name]
        seq = self.produced[name]
        self.produced[name] = seq + 1
        self.pending[name].append((seq, inst.take_events(), tree_keys(inst)))

    @invariant()
    def index_matches_model(self) -> None:
        self.index.check_integrity()
        for name in NAMES:
            assert frozenset(self.index.holdings(name)) == self.expected[name], name
            if not (self.index.needs_dump(name) or self.pending[name] or self.lost[name]):
                # Nothing in flight and no gap: the index is the tree.
                assert self.expected[name] == tree_keys(self.instances[name])


IndexVersusTrees.TestCase.settings = settings(
    max_examples=40, stateful_step_count=30, deadline=None
)
TestIndexVersusTrees = IndexVersusTrees.TestCase
