"""The embedded default workload: shared system prompts and multi-turn conversations.

A seeded generator stands in for a trace when `kvstrata replay` runs without `--trace`. It has
the two kinds of reuse a chat service sees:

- every conversation opens with one of `num_system_prompts` shared system prompts, so different
  conversations share a prefix;
- each turn's prompt is the previous turn's prompt, then the previous answer, then the new user
  tokens, so a conversation reuses all of its own history:

      turn 0:  [system prompt][user 0]
      turn 1:  [system prompt][user 0][answer 0][user 1]
      turn 2:  [system prompt][user 0][answer 0][user 1][answer 1][user 2]

Turns of different conversations interleave in a seeded random order (turn k of a conversation
always comes after its turn k - 1), so with a bounded cache a conversation's history competes
with everyone else's for room between its turns.

Parameters (`WorkloadSpec`; every range is inclusive and drawn uniformly):

| parameter | default | meaning |
|---|---:|---|
| `num_system_prompts` | 8 | distinct system prompts; each conversation picks one uniformly |
| `system_prompt_tokens` | 256 .. 1024 | length of each system prompt |
| `num_conversations` | 80 | conversations in the workload |
| `turns_per_conversation` | 1 .. 8 | requests per conversation |
| `user_turn_tokens` | 16 .. 160 | new user tokens appended by each turn |
| `assistant_turn_tokens` | 16 .. 320 | answer length of each turn (its `output_length`) |
| `vocab_size` | 32,000 | token ids are drawn from `0 .. vocab_size - 1` |
| `seed` | 0 | seed of `numpy.random.default_rng`; equal specs give equal workloads |

The defaults give 369 requests and 518,360 prompt tokens: a replay of a few seconds on two
cores.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvstrata.replay.errors import WorkloadSpecError
from kvstrata.replay.request import ReplayRequest

TokenRange = tuple[int, int]


@dataclass(frozen=True, kw_only=True)
class WorkloadSpec:
    """Parameters of the embedded workload (see the module docstring for what each means)."""

    num_system_prompts: int = 8
    system_prompt_tokens: TokenRange = (256, 1024)
    num_conversations: int = 80
    turns_per_conversation: TokenRange = (1, 8)
    user_turn_tokens: TokenRange = (16, 160)
    assistant_turn_tokens: TokenRange = (16, 320)
    vocab_size: int = 32_000
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_system_prompts < 1:
            raise WorkloadSpecError(
                f"num_system_prompts must be >= 1, got {self.num_system_prompts}"
            )
        if self.num_conversations < 1:
            raise WorkloadSpecError(f"num_conversations must be >= 1, got {self.num_conversations}")
        if self.vocab_size < 2:
            raise WorkloadSpecError(f"vocab_size must be >= 2, got {self.vocab_size}")
        # A user turn of 0 tokens would make turn k + 1's prompt a prefix of turn k's prompt plus
        # an answer, which is legal; a system prompt or a first turn of 0 tokens is not a prompt.
        for name, low_bound in (
            ("system_prompt_tokens", 1),
            ("turns_per_conversation", 1),
            ("user_turn_tokens", 1),
            ("assistant_turn_tokens", 0),
        ):
            low, high = getattr(self, name)
            if not low_bound <= low <= high:
                raise WorkloadSpecError(
                    f"{name} must be a range ({low_bound} <= low <= high), got ({low}, {high})"
                )

    @property
    def max_prompt_tokens(self) -> int:
        """Upper bound of any prompt's length (the last turn of the longest conversation)."""
        turns = self.turns_per_conversation[1]
        return (
            self.system_prompt_tokens[1]
            + turns * self.user_turn_tokens[1]
            + (turns - 1) * self.assistant_turn_tokens[1]
        )


def generate_workload(spec: WorkloadSpec | None = None) -> list[ReplayRequest]:
    """The requests of `spec` (default: `WorkloadSpec()`) in arrival order.

    Deterministic: the same spec gives equal token ids, lengths and order on every machine
    (numpy's PCG64 stream is stable across platforms). Cost O(total prompt tokens).
    """
    spec = spec if spec is not None else WorkloadSpec()
    rng = np.random.default_rng(spec.seed)

    def draw(bounds: TokenRange) -> int:
        return int(rng.integers(bounds[0], bounds[1], endpoint=True))

    def tokens(count: int) -> npt.NDArray[np.int64]:
        return rng.integers(0, spec.vocab_size, size=count, dtype=np.int64)

    system_prompts = [
        tokens(draw(spec.system_prompt_tokens)) for _ in range(spec.num_system_prompts)
    ]
    first_prompt: list[npt.NDArray[np.int64]] = []
    turns_left: list[int] = []
    for _ in range(spec.num_conversations):
        system = system_prompts[int(rng.integers(0, spec.num_system_prompts))]
        first_prompt.append(system)
        turns_left.append(draw(spec.turns_per_conversation))

    # The k-th occurrence of conversation c in the shuffled list is c's turn k: a uniform random
    # interleaving that keeps each conversation's turns in order.
    order = np.repeat(np.arange(spec.num_conversations), turns_left)
    rng.shuffle(order)

    history = first_prompt  # prompt so far plus the last answer, per conversation
    requests: list[ReplayRequest] = []
    for conversation in order.tolist():
        prompt = np.concatenate([history[conversation], tokens(draw(spec.user_turn_tokens))])
        answer = tokens(draw(spec.assistant_turn_tokens))
        history[conversation] = np.concatenate([prompt, answer])
        requests.append(
            ReplayRequest(
                token_ids=prompt, output_length=int(answer.size), conversation=conversation
            )
        )
    return requests
