"""Mooncake-format request traces.

One JSON object a line (the format of kvcache-ai/Mooncake's FAST'25 traces):

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2, ...]}

`hash_ids` names the prompt's blocks in order and is chained: two requests with equal ids up to
block i have equal prompts up to block i. The replay turns block id h into the T tokens

    h*T, h*T + 1, ..., h*T + T - 1          (T = tokens_per_block)

so equal id chains become equal token prefixes and distinct blocks never share a token run. The
prompt of a request is then `len(hash_ids) * T` tokens: the prompt "as the trace gives it", which
is what the hit rate is a share of (not `input_length`, whose last block the trace rounds up).

`hash_ids` is required (a non-empty list of non-negative integers). `timestamp`,
`input_length` and `output_length` are optional, but when present they must be non-negative
integers. Blank lines are skipped. Anything else is a `TraceFormatError` naming the line,
including a line that is not UTF-8; a file with no request at all is an `EmptyTrace`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import numpy.typing as npt

from kvstrata.replay.errors import EmptyTrace, ReplayOptionError, TraceFormatError
from kvstrata.replay.request import ReplayRequest

_OPTIONAL_INTS = ("timestamp", "input_length", "output_length")


def block_tokens(hash_ids: list[int], tokens_per_block: int) -> npt.NDArray[np.int64]:
    """The token ids of a chain of blocks: block h becomes h*T .. h*T + T - 1 (int64)."""
    ids = np.asarray(hash_ids, dtype=np.int64)
    offsets = np.arange(tokens_per_block, dtype=np.int64)
    return (ids[:, None] * tokens_per_block + offsets[None, :]).reshape(-1)


def parse_trace_line(
    line: str, *, tokens_per_block: int, line_number: int = 1, path: Path | str = "<trace>"
) -> ReplayRequest | None:
    """The request on one trace line, or None for a blank line.

    Raises `TraceFormatError(path, line_number, reason)` for anything that is not a request.
    """
    if not line.strip():
        return None
    try:
        record: object = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(path, line_number, f"not JSON ({exc.msg})") from exc
    if not isinstance(record, dict):
        raise TraceFormatError(path, line_number, f"expected a JSON object, got {_kind(record)}")
    if "hash_ids" not in record:
        raise TraceFormatError(path, line_number, "missing key 'hash_ids'")
    hash_ids = record["hash_ids"]
    if not isinstance(hash_ids, list) or not hash_ids:
        raise TraceFormatError(
            path, line_number, f"'hash_ids' must be a non-empty list, got {_kind(hash_ids)}"
        )
    for position, block in enumerate(hash_ids):
        if not _is_count(block):
            raise TraceFormatError(
                path,
                line_number,
                f"'hash_ids'[{position}] must be a non-negative integer, got {block!r}",
            )
    for name in _OPTIONAL_INTS:
        if name in record and not _is_count(record[name]):
            raise TraceFormatError(
                path, line_number, f"{name!r} must be a non-negative integer, got {record[name]!r}"
            )
    # Token ids are int64: the largest block id must not overflow h*T + T - 1.
    if max(hash_ids) > (2**63 - 1) // tokens_per_block - 1:
        raise TraceFormatError(path, line_number, "a block id is too large for int64 token ids")
    timestamp = record.get("timestamp")
    return ReplayRequest(
        token_ids=block_tokens(hash_ids, tokens_per_block),
        output_length=int(record.get("output_length", 0)),
        timestamp_ms=None if timestamp is None else int(timestamp),
    )


def iter_trace(
    path: Path | str, *, tokens_per_block: int = 16, limit: int | None = None
) -> Iterator[ReplayRequest]:
    """The requests of a trace file in file order, at most `limit` of them (None: all).

    Validates the options before opening the file. A malformed line (not UTF-8, not JSON, not a
    request) raises `TraceFormatError` when the iteration reaches it; the requests before it
    have been yielded. A file that holds no request at all (empty, or only blank lines) raises
    `EmptyTrace` at its end, unless `limit` is 0.
    """
    if tokens_per_block < 1:
        raise ReplayOptionError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
    if limit is not None and limit < 0:
        raise ReplayOptionError(f"limit must be >= 0, got {limit}")
    if limit == 0:
        return
    count = 0
    # Bytes, decoded a line at a time: a line that is not UTF-8 is then an error naming its
    # line, not a UnicodeDecodeError from inside the file object.
    with Path(path).open("rb") as lines:
        for line_number, raw in enumerate(lines, start=1):
            if limit is not None and count >= limit:
                return
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise TraceFormatError(
                    path,
                    line_number,
                    f"not UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1})",
                ) from exc
            request = parse_trace_line(
                line, tokens_per_block=tokens_per_block, line_number=line_number, path=path
            )
            if request is not None:
                count += 1
                yield request
    if count == 0:
        raise EmptyTrace(path)


def read_trace(
    path: Path | str, *, tokens_per_block: int = 16, limit: int | None = None
) -> list[ReplayRequest]:
    """All requests of a trace file (or the first `limit`), read and validated up front."""
    return list(iter_trace(path, tokens_per_block=tokens_per_block, limit=limit))


def _is_count(value: object) -> bool:
    # bool is an int subclass; `true` is not a block id.
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _kind(value: object) -> str:
    return {dict: "an object", list: "a list", str: "a string"}.get(type(value), repr(value))
