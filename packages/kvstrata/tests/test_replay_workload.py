"""The embedded workload: deterministic for a seed, and shaped like a chat service's traffic."""

from __future__ import annotations

import itertools
from collections import defaultdict

import numpy as np
import pytest

from kvstrata.replay import ReplayRequest, WorkloadSpec, WorkloadSpecError, generate_workload

SMALL = WorkloadSpec(
    num_system_prompts=3,
    system_prompt_tokens=(20, 40),
    num_conversations=12,
    turns_per_conversation=(1, 5),
    user_turn_tokens=(3, 9),
    assistant_turn_tokens=(2, 11),
    vocab_size=500,
    seed=7,
)


def _same(a: list[ReplayRequest], b: list[ReplayRequest]) -> bool:
    return len(a) == len(b) and all(
        np.array_equal(x.token_ids, y.token_ids)
        and x.output_length == y.output_length
        and x.conversation == y.conversation
        for x, y in zip(a, b, strict=True)
    )


def test_same_seed_same_workload() -> None:
    assert _same(generate_workload(SMALL), generate_workload(SMALL))


def test_other_seed_other_workload() -> None:
    other = WorkloadSpec(**{**SMALL.__dict__, "seed": 8})
    assert not _same(generate_workload(SMALL), generate_workload(other))


def test_default_workload_is_stable() -> None:
    # Pins the default stream: a change here changes every default replay figure in the README.
    requests = generate_workload()
    assert len(requests) == 369
    assert sum(r.num_tokens for r in requests) == 518_360
    assert max(r.num_tokens for r in requests) <= WorkloadSpec().max_prompt_tokens


def test_turns_extend_the_previous_prompt_and_answer() -> None:
    requests = generate_workload(SMALL)
    by_conversation: dict[int, list[ReplayRequest]] = defaultdict(list)
    for request in requests:
        assert request.conversation is not None
        by_conversation[request.conversation].append(request)
    assert set(by_conversation) == set(range(SMALL.num_conversations))
    for turns in by_conversation.values():
        low, high = SMALL.turns_per_conversation
        assert low <= len(turns) <= high
        first = turns[0].num_tokens
        assert SMALL.system_prompt_tokens[0] + SMALL.user_turn_tokens[0] <= first
        assert first <= SMALL.system_prompt_tokens[1] + SMALL.user_turn_tokens[1]
        for before, after in itertools.pairwise(turns):
            # after = before + answer (output_length tokens) + new user tokens
            assert np.array_equal(after.token_ids[: before.num_tokens], before.token_ids)
            user = after.num_tokens - before.num_tokens - before.output_length
            assert SMALL.user_turn_tokens[0] <= user <= SMALL.user_turn_tokens[1]
        for turn in turns:
            low, high = SMALL.assistant_turn_tokens
            assert low <= turn.output_length <= high


def test_conversations_share_system_prompts() -> None:
    requests = generate_workload(SMALL)
    openers = {r.token_ids[: SMALL.system_prompt_tokens[0]].tobytes() for r in requests}
    # At most one opener per system prompt, and with 12 conversations over 3 prompts some share.
    assert len(openers) <= SMALL.num_system_prompts
    assert len({r.conversation for r in requests}) > len(openers)


def test_turns_interleave_across_conversations() -> None:
    order = [r.conversation for r in generate_workload(SMALL)]
    runs = sum(1 for a, b in itertools.pairwise(order) if a != b)
    assert runs > SMALL.num_conversations  # not one conversation after the other


def test_tokens_stay_in_the_vocabulary_and_are_read_only() -> None:
    for request in generate_workload(SMALL):
        assert request.token_ids.dtype == np.int64
        assert int(request.token_ids.min()) >= 0 and int(request.token_ids.max()) < 500
        assert not request.token_ids.flags.writeable


@pytest.mark.parametrize(
    "overrides",
    [
        {"num_system_prompts": 0},
        {"num_conversations": 0},
        {"vocab_size": 1},
        {"system_prompt_tokens": (0, 5)},
        {"turns_per_conversation": (3, 2)},
        {"user_turn_tokens": (0, 4)},
        {"assistant_turn_tokens": (-1, 4)},
    ],
)
def test_bad_parameters_are_refused(overrides: dict[str, object]) -> None:
    with pytest.raises(WorkloadSpecError):
        WorkloadSpec(**overrides)  # pyright: ignore[reportArgumentType]
