"""vLLM and SGLang KV events -> kvstrata events, re-keyed with kvstrata's `PageKeyer`.

Wire formats (msgpack of msgspec structs; both engines publish the same envelope):

    batch   [ts, events, dp_rank?]                or {"ts", "events", "data_parallel_rank" |
                                                      "attn_dp_rank"}
    vLLM    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
             medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind, sliding_window]
            ["BlockRemoved", block_hashes, medium, group_idx]
            ["AllBlocksCleared"]
    SGLang  ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
             medium, metadata {"cache_salt"}]
            ["BlockRemoved", block_hashes, medium]
            ["AllBlocksCleared"]

Each event is either that tagged array or a map with a "type" key and the same field names.
Fields after the ones listed are ignored; trailing optional ones may be absent. Hashes are bytes
or ints. Unknown event types are skipped and counted.

Keys are re-derived from `token_ids`, never taken from the engine's hashes: every engine and
hash algorithm lands in one key space, the one kvstrata's own trees and storage use. Per
instance, `EngineKeyMap` remembers for each engine block hash where its chain stands:

    block (engine size B)   |  b0  |  b1  |  b2  |  b3  |  b4  |      B = 16, index page P = 32
    index pages             |   page 0    |   page 1    |  ...       b1 completes page 0,
    state after b4          prev_key = key(page 1), pending = tokens of b4

so a block of 16 tokens on an index of page 32 counts when its page completes, a block of 64
yields two pages, and `BlockRemoved` (hashes only) removes the pages the block completed.
Engines evict leaf-first, so a page's completing block goes no later than the blocks before it.
A block whose parent hash the map does not know (events lost before a resync) cannot be keyed:
it is skipped and counted in `orphan_blocks`, and so are its descendants.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeAlias

import msgpack

from kvstrata.prefix_index.errors import EngineDecodeError, UnknownFormat
from kvstrata.prefix_index.tiers import tier_of_medium
from kvstrata.storage import PageKeyer
from kvstrata.unified_radix_cache import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

FORMATS = ("vllm", "sglang")

EngineHash: TypeAlias = int | bytes

# Positions of the fields in the array form (index 0 is the tag).
_STORED_FIELDS: dict[str, tuple[str, ...]] = {
    "vllm": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
    ),
    "sglang": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "metadata",
    ),
}
_REMOVED_FIELDS: dict[str, tuple[str, ...]] = {
    "vllm": ("block_hashes", "medium", "group_idx"),
    "sglang": ("block_hashes", "medium"),
}


@dataclass(frozen=True, kw_only=True)
class EngineStored:
    block_hashes: tuple[EngineHash, ...]
    parent: EngineHash | None
    token_ids: tuple[int, ...]
    block_size: int
    tier: str
    extra_key: str | None
    cache_salt: str | None
    group: int | None


@dataclass(frozen=True, kw_only=True)
class EngineRemoved:
    block_hashes: tuple[EngineHash, ...]
    tier: str
    group: int | None


@dataclass(frozen=True, kw_only=True)
class EngineCleared:
    pass


EngineEvent: TypeAlias = EngineStored | EngineRemoved | EngineCleared


@dataclass(frozen=True, kw_only=True)
class DecodedBatch:
    """A decoded EventBatch: its timestamp, data-parallel rank, events in order, and how many
    events of unknown type it skipped (by tag)."""

    ts: float
    dp_rank: int | None
    events: tuple[EngineEvent, ...]
    unknown: Mapping[str, int]


def decode_engine_batch(payload: bytes, format: str) -> DecodedBatch:
    """Decode one msgpack EventBatch of `format` ("vllm" or "sglang"). Pure. Raises
    UnknownFormat, or EngineDecodeError naming the first malformed part."""
    if format not in FORMATS:
        raise UnknownFormat(f"engine event format {format!r}; choose one of {FORMATS}")
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (msgpack.UnpackException, ValueError, TypeError) as exc:
        raise EngineDecodeError(f"not a msgpack EventBatch: {exc}") from exc
    if isinstance(batch, list | tuple) and len(batch) >= 2:
        ts, rows = batch[0], batch[1]
        rank = batch[2] if len(batch) > 2 else None
    elif isinstance(batch, dict) and "events" in batch:
        ts, rows = batch.get("ts", 0.0), batch["events"]
        rank = batch.get("data_parallel_rank", batch.get("attn_dp_rank"))
    else:
        raise EngineDecodeError(f"EventBatch must be [ts, events, ...] or a map, got {batch!r:.80}")
    if not isinstance(ts, int | float) or not isinstance(rows, list | tuple):
        raise EngineDecodeError("EventBatch needs a numeric ts and a list of events")
    if rank is not None and not isinstance(rank, int):
        raise EngineDecodeError(f"data-parallel rank must be an int, got {rank!r}")
    events: list[EngineEvent] = []
    unknown: dict[str, int] = {}
    for i, row in enumerate(rows):
        tag, fields = _split(row, format)
        try:
            if tag == "BlockStored":
                events.append(_stored(fields))
            elif tag == "BlockRemoved":
                events.append(_removed(fields))
            elif tag == "AllBlocksCleared":
                events.append(EngineCleared())
            else:
                name = str(tag)
                unknown[name] = unknown.get(name, 0) + 1
        except EngineDecodeError as exc:
            raise EngineDecodeError(f"event {i} ({tag}): {exc}") from exc
    return DecodedBatch(ts=float(ts), dp_rank=rank, events=tuple(events), unknown=unknown)


def _split(row: object, format: str) -> tuple[object, dict[str, object]]:
    """An event's tag and its fields by name (array form mapped through the field order)."""
    if isinstance(row, dict):
        tag = row.get("type")
        return tag, {str(k): v for k, v in row.items()}
    if isinstance(row, list | tuple) and row:
        tag = row[0]
        if tag == "BlockStored":
            names = _STORED_FIELDS[format]
        elif tag == "BlockRemoved":
            names = _REMOVED_FIELDS[format]
        else:
            names = ()
        return tag, dict(zip(names, row[1:], strict=False))
    return None, {}


def _hashes(value: object, what: str) -> tuple[EngineHash, ...]:
    if not isinstance(value, list | tuple):
        raise EngineDecodeError(f"{what} must be a list, got {type(value).__name__}")
    for h in value:
        if isinstance(h, bool) or not isinstance(h, int | bytes):
            raise EngineDecodeError(f"{what} holds {h!r:.40}: hashes are ints or bytes")
    return tuple(value)


def _optional_str(value: object, what: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    raise EngineDecodeError(f"{what} must be a string, an int or null, got {value!r:.40}")


def _stored(f: dict[str, object]) -> EngineStored:
    hashes = _hashes(f.get("block_hashes"), "block_hashes")
    parent = f.get("parent_block_hash")
    if parent is not None and (isinstance(parent, bool) or not isinstance(parent, int | bytes)):
        raise EngineDecodeError(f"parent_block_hash {parent!r:.40} is not an int, bytes or null")
    tokens = f.get("token_ids")
    if not isinstance(tokens, list | tuple) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    ):
        raise EngineDecodeError("token_ids must be a list of ints")
    size = f.get("block_size")
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise EngineDecodeError(f"block_size must be a positive int, got {size!r}")
    if len(tokens) != len(hashes) * size:
        raise EngineDecodeError(
            f"{len(hashes)} blocks of {size} tokens need {len(hashes) * size} token ids, "
            f"got {len(tokens)}"
        )
    medium = _optional_str(f.get("medium"), "medium")
    lora = _optional_str(f.get("lora_name"), "lora_name") or _optional_str(
        f.get("lora_id"), "lora_id"
    )
    salt = f.get("cache_salt")
    metadata = f.get("metadata")
    if isinstance(metadata, dict):
        salt = metadata.get("cache_salt", salt)
    elif isinstance(metadata, list | tuple) and metadata:
        salt = metadata[0]
    group = f.get("group_idx")
    if group is not None and (not isinstance(group, int) or isinstance(group, bool)):
        raise EngineDecodeError(f"group_idx must be an int or null, got {group!r}")
    return EngineStored(
        block_hashes=hashes,
        parent=parent,
        token_ids=tuple(tokens),
        block_size=size,
        tier=tier_of_medium(medium),
        extra_key=lora,
        cache_salt=_optional_str(salt, "cache_salt"),
        group=group,
    )


def _removed(f: dict[str, object]) -> EngineRemoved:
    group = f.get("group_idx")
    if group is not None and (not isinstance(group, int) or isinstance(group, bool)):
        raise EngineDecodeError(f"group_idx must be an int or null, got {group!r}")
    return EngineRemoved(
        block_hashes=_hashes(f.get("block_hashes"), "block_hashes"),
        tier=tier_of_medium(_optional_str(f.get("medium"), "medium")),
        group=group,
    )


@dataclass(slots=True)
class _Block:
    """Where the key chain stands after an engine block (see the module docstring)."""

    prev_key: bytes | None
    pending: tuple[int, ...]
    completes: tuple[bytes, ...]
    extra_key: str | None
    cache_salt: str | None
    tiers: set[str] = field(default_factory=set)


class EngineKeyMap:
    """One instance's engine hash -> page key state. `group`: the KV-cache group indexed for
    hybrid models (vLLM `group_idx`; events of other groups are skipped and counted)."""

    def __init__(self, keyer: PageKeyer, *, group: int = 0) -> None:
        self.keyer = keyer
        self.group = group
        self._blocks: dict[EngineHash, _Block] = {}
        self.orphan_blocks = 0
        self.other_group_events = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def convert(self, events: Sequence[EngineEvent]) -> list[KVEvent]:
        """kvstrata events for `events`, in order. Mutates the map (stores, removals)."""
        out: list[KVEvent] = []
        for event in events:
            if isinstance(event, EngineCleared):
                self._blocks.clear()
                out.append(AllBlocksCleared(tier=None))
            elif event.group is not None and event.group != self.group:
                self.other_group_events += 1
            elif isinstance(event, EngineStored):
                stored = self._stored(event)
                if stored is not None:
                    out.append(stored)
            else:
                keys: list[bytes] = []
                for h in event.block_hashes:
                    block = self._blocks.get(h)
                    if block is None or event.tier not in block.tiers:
                        continue
                    block.tiers.discard(event.tier)
                    if not block.tiers:
                        del self._blocks[h]
                    keys.extend(block.completes)
                if keys:
                    out.append(BlockRemoved(page_keys=tuple(keys), tier=event.tier))
        return out

    def _stored(self, event: EngineStored) -> BlockStored | None:
        page = self.keyer.page_size
        if event.parent is None:
            prev, pending = None, ()
            extra, salt = event.extra_key, event.cache_salt
        else:
            parent = self._blocks.get(event.parent)
            if parent is None:
                # Children of an orphan are orphans too: remember nothing for them.
                self.orphan_blocks += len(event.block_hashes)
                return None
            prev, pending = parent.prev_key, parent.pending
            extra, salt = parent.extra_key, parent.cache_salt
        first_parent = prev
        keys: list[bytes] = []
        size = event.block_size
        tokens = event.token_ids
        for j, h in enumerate(event.block_hashes):
            run = pending + tokens[j * size : (j + 1) * size]
            whole = len(run) // page * page
            new = (
                self.keyer.page_keys(run[:whole], extra_key=extra, cache_salt=salt, parent=prev)
                if whole
                else []
            )
            if new:
                prev = new[-1]
            pending = run[whole:]
            block = self._blocks.get(h)
            if block is None:
                block = _Block(prev, pending, tuple(new), extra, salt)
                self._blocks[h] = block
            block.tiers.add(event.tier)
            keys.extend(new)
        if not keys:
            return None
        return BlockStored(
            page_keys=tuple(keys),
            parent_key=first_parent,
            tokens_per_page=page,
            tier=event.tier,
        )
