"""vLLM and SGLang EventBatch decoding, against payloads encoded by msgspec from structs with the
field lists of the engines' published event classes (vLLM `distributed/kv_events.py`, SGLang
`srt/disaggregation/kv_events.py`), in both the array and the map encodings."""

from __future__ import annotations

from typing import Any

import msgpack
import msgspec
import pytest

from kvstrata.prefix_index import (
    EngineDecodeError,
    InvalidInstance,
    PrefixIndex,
    SimInstance,
    UnknownFormat,
)
from kvstrata.storage import PageKeyer

# --- vLLM, newest layout: map form ("type" tag), trailing optional fields --------------------


class VBatch(msgspec.Struct, omit_defaults=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VEvent(msgspec.Struct, omit_defaults=True, tag=True):
    pass


class VStored(VEvent, tag="BlockStored"):
    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class VRemoved(VEvent, tag="BlockRemoved"):
    block_hashes: list[Any]
    medium: str | None
    group_idx: int | None = None


class VCleared(VEvent, tag="AllBlocksCleared"):
    pass


class VTransferred(VEvent, tag="BlockTransferred"):
    block_hashes: list[Any]


# --- vLLM, older layout: array form -----------------------------------------------------------


class VBatchA(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VEventA(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


class VStoredA(VEventA, tag="BlockStored"):
    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class VRemovedA(VEventA, tag="BlockRemoved"):
    block_hashes: list[Any]
    medium: str | None


# --- SGLang: array form, medium, metadata {cache_salt} on the salted variant ------------------


class SBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Any]
    attn_dp_rank: int | None = None


class SEvent(msgspec.Struct, array_like=True, tag=True):
    pass


class SStored(SEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None


class SMetadata(msgspec.Struct, omit_defaults=True):
    cache_salt: str


class SStoredSalted(SStored, tag="BlockStored", kw_only=True):
    metadata: SMetadata


class SRemoved(SEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


def enc(obj: object) -> bytes:
    return msgspec.msgpack.encode(obj)


def pack(obj: object) -> bytes:
    packed = msgpack.packb(obj)
    assert isinstance(packed, bytes)
    return packed


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def pages_of(index: PrefixIndex, instance: str, toks: list[int], **ns: str) -> int:
    match = index.find_matches(toks, **ns).by_instance.get(instance)
    return 0 if match is None else match.num_pages


@pytest.mark.parametrize("hash_kind", ["bytes", "int"])
@pytest.mark.parametrize("form", ["map", "array"])
def test_vllm_store_then_remove(form: str, hash_kind: str) -> None:
    index = PrefixIndex(16)
    h = [b"\x01" * 32, b"\x02" * 32, b"\x03" * 32] if hash_kind == "bytes" else [11, 12, 13]
    toks = tokens(48)
    if form == "map":
        stored: object = VStored(h[:2], None, toks[:32], 16, None, "GPU", None)
        child: object = VStored(h[2:], h[1], toks[32:], 16, None, "GPU", None)
        removed: object = VRemoved([h[2]], "GPU")
        batch = VBatch(1.0, [stored, child], 0)
        later = VBatch(2.0, [removed], 0)
    else:
        stored = VStoredA(h[:2], None, toks[:32], 16, None, "GPU")
        child = VStoredA(h[2:], h[1], toks[32:], 16, None, "GPU")
        batch = VBatchA(1.0, [stored, child], 0)
        later = VBatchA(2.0, [VRemovedA([h[2]], "GPU")], 0)
    result = index.apply_engine_batch("v0", enc(batch), "vllm")
    assert result.applied_events == 2
    assert pages_of(index, "v0", toks) == 3
    # Keys are kvstrata's: the same as PageKeyer's for these tokens.
    assert set(index.holdings("v0")) == set(PageKeyer(page_size=16).page_keys(toks))
    index.apply_engine_batch("v0", enc(later), "vllm")
    assert pages_of(index, "v0", toks) == 2
    index.check_integrity()


def test_engine_and_kvstrata_instances_share_one_key_space() -> None:
    index = PrefixIndex(16)
    toks = tokens(64, 1000)
    tree = SimInstance("tree", capacity_pages=100, page_size=16)
    tree.serve(toks)
    index.apply("tree", tree.take_events())
    batch = VBatch(0.0, [VStored([1, 2, 3, 4], None, toks, 16, None, None, None)])
    index.apply_engine_batch("vllm", enc(batch))
    matches = index.find_matches(toks)
    assert {n: m.num_pages for n, m in matches.by_instance.items()} == {"tree": 4, "vllm": 4}


def test_trailing_fields_and_unknown_types() -> None:
    index = PrefixIndex(16)
    toks = tokens(16)
    ev = VStored([7], None, toks, 16, None, "GPU", None, [None], 0, "full_attention", None)
    raw = msgpack.unpackb(enc(VBatch(0.0, [ev, VTransferred([7])], 3)))
    raw["events"][0]["future_field"] = [1, 2]
    raw["future_envelope_field"] = "x"
    result = index.apply_engine_batch("v", pack(raw), "vllm")
    assert result.unknown == {"BlockTransferred": 1}
    assert index.unknown_engine_events == 1
    assert pages_of(index, "v", toks) == 1
    # The array form with fields past the newest known ones (lora_name, extra_keys, group_idx,
    # spec kind, sliding window) at both levels.
    arr = msgpack.unpackb(enc(VBatchA(0.0, [VStoredA([9], None, tokens(16, 500), 16, None, None)])))
    arr[1][0] = [*arr[1][0], None, None, 0, "full_attention", None, "extra", 42]
    arr.append({"more": True})
    index.apply_engine_batch("w", pack(arr), "vllm")
    assert pages_of(index, "w", tokens(16, 500)) == 1


@pytest.mark.parametrize(("block", "page"), [(16, 32), (16, 48), (64, 32), (16, 64)])
def test_mismatched_block_sizes(block: int, page: int) -> None:
    index = PrefixIndex(page)
    toks = tokens(block * 12)
    # One block per event, each chained to the previous one.
    events: list[object] = []
    for i in range(12):
        parent = None if i == 0 else i - 1 + 100
        chunk = toks[i * block : (i + 1) * block]
        events.append(VStored([i + 100], parent, chunk, block, None, "GPU", None))
    index.apply_engine_batch("v", enc(VBatch(0.0, events)))
    whole = len(toks) // page
    assert pages_of(index, "v", toks) == whole
    assert set(index.holdings("v")) == set(PageKeyer(page_size=page).page_keys(toks))
    # Leaf-first removal of the last block removes exactly the pages it completed.
    last_end = 12 * block
    expect_after = (last_end - block) // page
    index.apply_engine_batch("v", enc(VBatch(1.0, [VRemoved([111], "GPU")])))
    assert pages_of(index, "v", toks) == expect_after
    index.check_integrity()


def test_sglang_medium_salt_and_lora() -> None:
    index = PrefixIndex(16)
    toks = tokens(32, 7)
    plain = SStored([1, 2], None, toks, 16, None)  # older SGLang: no medium
    host = SStored([3, 4], None, toks, 16, None, "CPU_PINNED")
    salted = SStoredSalted([5, 6], None, toks, 16, None, "GPU", metadata=SMetadata("tenant-a"))
    index.apply_engine_batch("s_plain", enc(SBatch(0.0, [plain], 0)), "sglang")
    index.apply_engine_batch("s_host", enc(SBatch(0.0, [host])), "sglang")
    index.apply_engine_batch("s_salt", enc(SBatch(0.0, [salted])), "sglang")
    matches = index.find_matches(toks)
    assert set(matches.by_instance) == {"s_plain", "s_host"}
    assert matches.by_instance["s_host"].tiers == ("host", "host")
    assert matches.by_instance["s_plain"].tiers == ("device", "device")
    salted_match = index.find_matches(toks, cache_salt="tenant-a").by_instance
    assert set(salted_match) == {"s_salt"}
    scores = index.score(toks)
    assert scores["s_plain"] == pytest.approx(2.0)
    assert scores["s_host"] == pytest.approx(1.6)
    # Removal on the host tier by hash.
    index.apply_engine_batch("s_host", enc(SBatch(1.0, [SRemoved([4], "CPU_PINNED")])), "sglang")
    assert pages_of(index, "s_host", toks) == 1
    # A LoRA adapter is a namespace of its own (lora_name first, else lora_id).
    lora = VStored([8], None, toks[:16], 16, 3, "GPU", "my-adapter")
    index.apply_engine_batch("lora", enc(VBatch(0.0, [lora])))
    assert pages_of(index, "lora", toks[:16], extra_key="my-adapter") == 1
    assert pages_of(index, "lora", toks[:16]) == 0


def test_orphans_other_groups_and_clear() -> None:
    index = PrefixIndex(16)
    toks = tokens(32)
    orphan = VStored([2], 999, toks[16:], 16, None, None, None)
    swa = VStored([5], None, toks[:16], 16, None, None, None, None, 1)
    result = index.apply_engine_batch("v", enc(VBatch(0.0, [orphan, swa])))
    assert result.orphan_blocks == 1
    assert len(index) == 0
    full = VStored([1], None, toks[:16], 16, None, None, None, None, 0)
    index.apply_engine_batch("v", enc(VBatch(0.0, [full])))
    assert pages_of(index, "v", toks) == 1
    index.apply_engine_batch("v", enc(VBatch(1.0, [VCleared()])))
    assert len(index) == 0
    index.check_integrity()


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"\xc1not msgpack", "not a msgpack"),
        (msgpack.packb(5), "EventBatch must be"),
        (msgpack.packb(["ts", []]), "numeric ts"),
        (enc(VBatch(0.0, [VStored([1], None, tokens(15), 16, None, None, None)])), "token ids"),
        (enc(VBatch(0.0, [VStored([1.5], None, tokens(16), 16, None, None, None)])), "hashes"),
        (enc(VBatch(0.0, [VStored([1], None, tokens(16), 0, None, None, None)])), "block_size"),
        (msgpack.packb([0.0, [], "rank"]), "rank"),
        (
            enc(
                VBatch(
                    0.0,
                    [
                        VStored([3], None, tokens(16, 50), 16, None, None, None),
                        VStored([4], None, tokens(15, 70), 16, None, None, None),
                    ],
                )
            ),
            "event 1",
        ),
    ],
)
def test_decode_errors_leave_the_index_unchanged(payload: bytes, message: str) -> None:
    index = PrefixIndex(16)
    good = VBatch(0.0, [VStored([1], None, tokens(16), 16, None, None, None)])
    index.apply_engine_batch("v", enc(good))
    before = index.holdings("v")
    # A good event before the bad one must not be applied either.
    with pytest.raises(EngineDecodeError, match=message):
        index.apply_engine_batch("v", payload)
    assert index.holdings("v") == before


def test_unknown_format_and_bad_instance() -> None:
    index = PrefixIndex(16)
    payload = enc(VBatch(0.0, []))
    with pytest.raises(UnknownFormat):
        index.apply_engine_batch("v", payload, "trtllm")
    with pytest.raises(InvalidInstance):
        index.apply_engine_batch("", payload)
