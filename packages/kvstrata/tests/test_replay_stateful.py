"""Hypothesis state machine: random multi-turn traffic through a small, tight memory system.

After every step the whole system must be consistent (allocators, pools, tree: free +
evictable + protected == capacity per pool), nothing may stay locked, and every hit must read
back the KV written for exactly those tokens (`verify=True`).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from kvstrata.build import MemorySystem, SWAModel, build_memory_system
from kvstrata.replay import ReplayEngine, ReplayRequest

PAGE = 4
CAPACITY = 96
LONGEST = 72
SYSTEM_PROMPTS = (tuple(range(100, 109)), tuple(range(200, 206)))
tokens = st.lists(st.integers(0, 50), min_size=1, max_size=12)


class ReplayMachine(RuleBasedStateMachine):
    family = "mha"
    prompts = Bundle("prompts")

    @initialize()
    def build(self) -> None:
        self.system: MemorySystem = build_memory_system(
            family=self.family,
            capacity_tokens=CAPACITY,
            page_size=PAGE,
            model=SWAModel(sliding_window=8) if self.family == "swa" else None,
            swa_ratio=0.75,
            mamba_slots=4,
        )
        self.engine = ReplayEngine(self.system, verify=True)
        self.expected_prompt_tokens = 0

    def _run(self, prompt: tuple[int, ...]) -> tuple[int, ...]:
        prompt = prompt[:LONGEST]  # the longest prompt every pool can hold (SWA: 75 %)
        request = ReplayRequest(token_ids=np.array(prompt, dtype=np.int64))
        result = self.engine.step(request)
        usable = (len(prompt) - 1) // PAGE * PAGE
        assert 0 <= result.hit_tokens <= usable
        assert result.computed_tokens == len(prompt) - result.hit_tokens
        self.expected_prompt_tokens += len(prompt)
        return prompt

    @rule(target=prompts, opener=st.sampled_from(SYSTEM_PROMPTS), user=tokens)
    def new_conversation(self, opener: tuple[int, ...], user: list[int]) -> tuple[int, ...]:
        return self._run(opener + tuple(user))

    @rule(target=prompts, previous=prompts, answer=tokens, user=tokens)
    def next_turn(
        self, previous: tuple[int, ...], answer: list[int], user: list[int]
    ) -> tuple[int, ...]:
        return self._run(previous + tuple(answer) + tuple(user))

    @rule(previous=prompts)
    def repeat(self, previous: tuple[int, ...]) -> None:
        self._run(previous)

    @rule()
    def reset(self) -> None:
        self.system.reset()
        assert self.system.tree.total_size("full") == 0

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "system"):
            return
        assert self.system.tree.num_locked == 0
        self.system.check_integrity()
        stats = self.engine.stats()
        assert stats.prompt_tokens == self.expected_prompt_tokens
        assert stats.hit_tokens + stats.computed_tokens == stats.prompt_tokens


class SWAReplayMachine(ReplayMachine):
    family = "swa"


class MambaReplayMachine(ReplayMachine):
    family = "mamba"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# Each step is a full request through the stack: fewer examples than the profile's default.
TestMHAReplay = ReplayMachine.TestCase
TestSWAReplay = SWAReplayMachine.TestCase
TestMambaReplay = MambaReplayMachine.TestCase
TestMHAReplay.settings = settings(max_examples=20, stateful_step_count=30)
TestSWAReplay.settings = TestMHAReplay.settings
TestMambaReplay.settings = TestMHAReplay.settings
