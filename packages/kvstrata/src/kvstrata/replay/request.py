"""One request as the replay job drives it: a prompt of token ids and the answer length."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt


@dataclass(frozen=True, kw_only=True, eq=False)
class ReplayRequest:
    """A prompt to match, compute and insert, in arrival order.

    `token_ids` is a read-only int64 array (never empty). `output_length` is the number of answer
    tokens the trace or workload says the request produced; the replay job prefills only (the
    answer reaches the cache as part of the next turn's prompt), so it is reported, not decoded.
    `timestamp_ms` is the arrival time a trace gives, `None` for the embedded workload.
    `conversation` groups the turns of one conversation (`None` when unknown, as in traces).
    """

    token_ids: npt.NDArray[np.int64]
    output_length: int = 0
    timestamp_ms: int | None = None
    conversation: int | None = None

    def __post_init__(self) -> None:
        assert self.token_ids.dtype == np.int64, "ReplayRequest.token_ids must be int64"
        assert self.token_ids.ndim == 1 and self.token_ids.size > 0, (
            "ReplayRequest.token_ids must be a non-empty 1-D array"
        )
        # Requests are shared between passes of a replay: nobody may change a prompt in place.
        self.token_ids.flags.writeable = False

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.size)
