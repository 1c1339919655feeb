"""`kvstrata bench alloc`'s batch-decode figure: 256 running requests decode one token each,
through `kvstrata.allocation.BatchAllocator.prepare_decode` as one batch call (one
`alloc_decode`, one gather, one scatter into the request table) against 256 calls of the same
method with one request each (the per-request path), side by side in one process.

Setup per repeat: a small Llama-shaped model (2 layers, 2 KV heads of 8, float32) built with
`kvstrata.build.build`, 256 requests of 33 distinct tokens admitted and prefilled (so a decode
step crosses pages at different times), then `steps` decode steps timed on each path in turn
(the order alternates between repeats). The figure is the median per-step time of each path
and their ratio (per-request / batch).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from kvstrata.allocation import BatchAllocator, Running
from kvstrata.build import BuildOptions, ModelMemorySpec, SizingParams, build

BATCH = 256
PROMPT = 33
PAGE = 16
MODEL: dict[str, object] = {
    "model_type": "llama",
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "max_position_embeddings": 256,
    "torch_dtype": "float32",
}


def _setup(steps: int) -> tuple[BatchAllocator, list[Running]]:
    spec = ModelMemorySpec.from_hf_config(MODEL)
    context = 128
    tokens = BATCH * (-(-(PROMPT + 2 * steps) // PAGE) + 1) * PAGE
    sizing = SizingParams(page_size=PAGE, context_len=context, max_running_requests=BATCH)
    budget = (BATCH + 1) * context * 4 + tokens * spec.full_kv_bytes_per_token
    system = build(spec, budget, BuildOptions(sizing=sizing))
    assert system.req_to_token is not None
    alloc = BatchAllocator(
        system.cache, kv_allocator=system.kv_allocator, req_to_token=system.req_to_token
    )
    batch: list[Running] = []
    for i in range(BATCH):
        running = alloc.admit([1000 + i * PROMPT + t for t in range(PROMPT)])
        assert running is not None
        batch.append(running)
    assert alloc.prepare_extend([(r, PROMPT) for r in batch]) is not None
    return alloc, batch


def _batched(alloc: BatchAllocator, batch: list[Running], steps: int) -> float:
    tokens = [7] * len(batch)
    start = time.perf_counter()
    for _ in range(steps):
        if alloc.prepare_decode(batch, tokens) is None:
            raise RuntimeError("batch decode ran out of room")
    return (time.perf_counter() - start) / steps


def _per_request(alloc: BatchAllocator, batch: list[Running], steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        for r in batch:
            if alloc.prepare_decode([r], [7]) is None:
                raise RuntimeError("per-request decode ran out of room")
    return (time.perf_counter() - start) / steps


def run_batch_decode(*, quick: bool = False) -> dict[str, Any]:
    """The JSON record of the figure (module docstring)."""
    repeats, steps = (3, 2) if quick else (7, 8)
    batched: list[float] = []
    single: list[float] = []
    for repeat in range(repeats):
        alloc, batch = _setup(steps)
        if repeat % 2:
            single.append(_per_request(alloc, batch, steps))
            batched.append(_batched(alloc, batch, steps))
        else:
            batched.append(_batched(alloc, batch, steps))
            single.append(_per_request(alloc, batch, steps))
    b, s = statistics.median(batched), statistics.median(single)
    return {
        "workload": "batch_decode",
        "batch": BATCH,
        "page_size": PAGE,
        "repeats": repeats,
        "steps": steps,
        "batch_call_s": b,
        "per_request_calls_s": s,
        "ratio": s / b,
        "baseline": f"{BATCH} calls of prepare_decode with one request each",
    }
