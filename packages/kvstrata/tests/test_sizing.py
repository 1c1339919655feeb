"""`plan_memory`: SGLang's sizing rules worked by hand on real models, the errors, and the
invariants (never past the budget, whole pages, monotone in the budget) under Hypothesis."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.build import (
    BudgetTooSmall,
    HostMemoryExceeded,
    InvalidCapacity,
    InvalidModel,
    ModelMemorySpec,
    SizingParams,
    plan_memory,
)
from kvstrata.build.budget import format_bytes, free_host_memory, parse_size, resolve_budget
from kvstrata.testkit.hf_configs import (
    DEEPSEEK_V3,
    FALCON_H1_7B,
    GPT_OSS_120B,
    LLAMA_3_1_8B,
    NEMOTRON_H_8B,
    QWEN3_NEXT_80B,
)

GiB = 1 << 30


def test_dense_plan_follows_sglang_rules_by_hand() -> None:
    spec = ModelMemorySpec.from_hf_config(LLAMA_3_1_8B)
    plan = plan_memory(spec, "80GiB")
    budget = 80 * GiB
    # Request rows: the whole budget holds 80 GiB / 128 KiB = 655_360 tokens; 655_360 / 131_072
    # x 512 = 2560, inside [2048, 4096].
    assert plan.max_running_requests == 2560
    # Table: 2561 rows (row 0 pads) x 131_072 int32.
    assert plan.req_table_bytes == 2561 * 131_072 * 4
    # KV: (budget - table) // 131_072 B = 645_116 tokens, 645_104 in whole pages of 16.
    assert (budget - plan.req_table_bytes) // 131_072 == 645_116
    assert plan.full_tokens == 645_104
    assert plan.swa_tokens == 0 and plan.mamba_slots == 0
    assert plan.used_bytes <= budget
    assert plan.unused_bytes == budget - plan.req_table_bytes - 645_104 * 131_072
    # One request of 131_072 tokens takes 131_072 slots: 4 fit at once.
    assert plan.max_concurrent_requests() == 4
    assert plan.max_concurrent_requests(8192) == min(645_104 // 8192, 2560)


def test_mla_plan_counts_the_latent() -> None:
    spec = ModelMemorySpec.from_hf_config(DEEPSEEK_V3, tp_size=8, kv_dtype="fp8_e4m3")
    plan = plan_memory(spec, 40 * GiB, SizingParams(context_len=32_768, max_running_requests=512))
    table = 513 * 32_768 * 4
    assert plan.req_table_bytes == table
    assert plan.full_tokens == (40 * GiB - table) // 35_136 // 16 * 16


def test_swa_split_by_hand() -> None:
    spec = ModelMemorySpec.from_hf_config(GPT_OSS_120B)  # F = S = 36_864 B/token
    params = SizingParams(context_len=8192, max_running_requests=256, page_size=64)
    plan = plan_memory(spec, 40 * GiB, params)
    table = 257 * 8192 * 4
    tokens = (40 * GiB - table) // 73_728  # SGLang's cell: full + SWA bytes of one token
    # full = tokens x (F + S) / (F + 0.8 S) = tokens x 2 / 1.8; swa = 0.8 x full; whole pages.
    full = int(tokens * 73_728 / (36_864 + 0.8 * 36_864))
    assert plan.full_tokens == full // 64 * 64
    assert plan.swa_tokens == int(full * 0.8) // 64 * 64
    assert plan.full_kv_bytes + plan.swa_kv_bytes <= tokens * 73_728
    # One request: 8192 full slots; the SWA window of 128 tokens is 2 pages, plus one.
    assert plan.request_needs(8192) == (8192, 3 * 64)


def test_mamba_carve_out_by_hand() -> None:
    spec = ModelMemorySpec.from_hf_config(QWEN3_NEXT_80B)
    state = spec.state_bytes_per_request  # 77_266_944
    params = SizingParams(context_len=32_768, max_running_requests=64)
    plan = plan_memory(spec, 40 * GiB, params)
    rest = 40 * GiB - 65 * 32_768 * 4
    # state memory = rest x 0.9 / 1.9, in whole per-request states
    slots = int(rest * 0.9 / 1.9) // state
    assert plan.mamba_slots == slots
    # running requests: at most a third of the state slots
    assert plan.max_running_requests == min(64, slots // 3)
    assert plan.full_tokens == (rest - slots * state) // 24_576 // 16 * 16
    assert plan.max_concurrent_requests() <= plan.mamba_slots


def test_mamba_rows_it_cannot_back_go_to_kv() -> None:
    # Default request rows (2048) but far fewer states: the spare rows are not kept.
    spec = ModelMemorySpec.from_hf_config(QWEN3_NEXT_80B)
    plan = plan_memory(spec, 40 * GiB, SizingParams(context_len=32_768))
    assert plan.max_running_requests == plan.mamba_slots // 3
    assert plan.req_table_bytes == (plan.max_running_requests + 1) * 32_768 * 4
    assert plan.unused_bytes < 24_576 * 16 + spec.state_bytes_per_request


def test_explicit_mamba_cache_size() -> None:
    spec = ModelMemorySpec.from_hf_config(FALCON_H1_7B)
    plan = plan_memory(spec, "24GiB", SizingParams(context_len=4096, mamba_cache_size=30))
    assert plan.mamba_slots == 30
    assert plan.max_running_requests == 10


def test_budget_too_small_names_the_numbers() -> None:
    spec = ModelMemorySpec.from_hf_config(LLAMA_3_1_8B)
    with pytest.raises(BudgetTooSmall) as info:
        plan_memory(spec, "16GiB", SizingParams(max_running_requests=1))
    message = str(info.value)
    assert "cannot hold one request of 131072 tokens" in message
    assert "one request needs 131072 tokens (17179869184 bytes)" in message
    assert "17179869184" in message and "131072 bytes" in message
    with pytest.raises(BudgetTooSmall, match="Mamba states"):
        plan_memory(
            ModelMemorySpec.from_hf_config(QWEN3_NEXT_80B), "300MiB", SizingParams(context_len=1024)
        )
    # The table alone past the budget
    with pytest.raises(BudgetTooSmall, match="request table"):
        plan_memory(spec, "1GiB")


def test_host_tier_from_ratio_and_bytes() -> None:
    spec = ModelMemorySpec.from_hf_config(GPT_OSS_120B)
    params = SizingParams(context_len=8192, max_running_requests=64, host_ratio=2.0)
    plan = plan_memory(spec, 8 * GiB, params, free_host_bytes=1 << 40)
    assert plan.host is not None
    assert plan.host.full_tokens == plan.full_tokens * 2
    assert plan.host.swa_tokens == plan.swa_tokens * 2
    assert plan.host.size_bytes == 2 * (plan.full_kv_bytes + plan.swa_kv_bytes)
    by_bytes = SizingParams(context_len=8192, max_running_requests=64, host_bytes=3 * GiB)
    host = plan_memory(spec, 8 * GiB, by_bytes, free_host_bytes=1 << 40).host
    assert host is not None and host.size_bytes <= 3 * GiB
    assert host.full_tokens % 16 == 0 and host.swa_tokens % 16 == 0
    mamba = plan_memory(
        ModelMemorySpec.from_hf_config(QWEN3_NEXT_80B),
        40 * GiB,
        SizingParams(context_len=4096, host_ratio=1.5),
        free_host_bytes=1 << 40,
    )
    assert mamba.host is not None and mamba.host.mamba_slots == int(mamba.mamba_slots * 1.5)
    with pytest.raises(HostMemoryExceeded, match=r"exceeds the free host memory, 1.00 GiB"):
        plan_memory(spec, 8 * GiB, params, free_host_bytes=GiB)
    with pytest.raises(InvalidCapacity, match="holds no whole page"):
        plan_memory(
            spec,
            8 * GiB,
            SizingParams(context_len=8192, max_running_requests=64, host_bytes=100),
            free_host_bytes=1 << 40,
        )


@pytest.mark.parametrize(
    ("params", "match"),
    [
        (SizingParams(page_size=0), "page_size must be >= 1"),
        (SizingParams(context_len=0), "context_len must be >= 1"),
        (SizingParams(swa_full_tokens_ratio=1.5), "swa_full_tokens_ratio"),
        (SizingParams(mamba_full_memory_ratio=0), "mamba_full_memory_ratio"),
        (SizingParams(max_running_requests=0), "max_running_requests must be >= 1"),
        (SizingParams(mamba_cache_size=0), "mamba_cache_size must be >= 1"),
        (SizingParams(host_ratio=2, host_bytes=10), "not both"),
        (SizingParams(host_ratio=-1), "host_ratio must be > 0"),
        (SizingParams(host_bytes=0), "host_bytes must be >= 1"),
    ],
)
def test_bad_params_are_refused(params: SizingParams, match: str) -> None:
    spec = ModelMemorySpec.from_hf_config(LLAMA_3_1_8B)
    with pytest.raises(InvalidCapacity, match=match):
        plan_memory(spec, "80GiB", params)


def test_context_len_is_required_without_max_position_embeddings() -> None:
    config = {k: v for k, v in LLAMA_3_1_8B.items() if k != "max_position_embeddings"}
    spec = ModelMemorySpec.from_hf_config(config)
    with pytest.raises(InvalidCapacity, match="give context_len"):
        plan_memory(spec, "80GiB")
    assert plan_memory(spec, "80GiB", SizingParams(context_len=4096)).context_len == 4096
    with pytest.raises(InvalidCapacity, match="context_len must be >= 1"):
        plan_memory(spec, "80GiB", SizingParams(context_len=4096)).max_concurrent_requests(0)


def test_budgets_parse() -> None:
    assert parse_size("40GiB") == 40 * GiB
    assert parse_size("40 gib") == 40 * GiB
    assert parse_size("80GB") == 80 * 10**9
    assert parse_size("1.5TiB") == 3 * (1 << 39)
    assert parse_size("512M") == 512 << 20
    assert parse_size("1073741824") == GiB
    assert resolve_budget(12345, free_bytes=None) == 12345
    assert resolve_budget("90%", free_bytes=1000) == 900
    assert resolve_budget("0.5", free_bytes=1000) == 500
    assert resolve_budget(0.25, free_bytes=1000) == 250
    assert resolve_budget("1.0", free_bytes=1000) == 1000
    assert format_bytes(40 * GiB) == "40.00 GiB" and format_bytes(12) == "12 B"
    assert free_host_memory() > 0


def test_free_host_memory_reads_memavailable(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 100 kB\nMemFree: 10 kB\nMemAvailable: 42 kB\n")
    assert free_host_memory(meminfo) == 42 * 1024


@pytest.mark.parametrize(
    ("budget", "free", "match"),
    [
        ("40XB", None, "unknown unit 'XB'"),
        ("forty", None, "not a size"),
        ("0GiB", None, "must be positive"),
        (0, None, "must be positive"),
        (True, None, "not a budget"),
        ("90%", None, "no free memory figure"),
        (0.5, None, "no free memory figure"),
        ("150%", 1000, r"must be in \(0, 1\]"),
        (1.5, 1000, r"must be in \(0, 1\]"),
    ],
)
def test_bad_budgets_are_refused(budget: str | int | float, free: int | None, match: str) -> None:
    with pytest.raises(InvalidCapacity, match=match):
        resolve_budget(budget, free_bytes=free)


def test_a_model_without_attention_cannot_be_sized_by_tokens() -> None:
    # Nemotron-H written with Mamba and MLP layers only
    spec = ModelMemorySpec.from_hf_config({**NEMOTRON_H_8B, "hybrid_override_pattern": "M-" * 26})
    with pytest.raises(InvalidModel, match="no attention layer"):
        plan_memory(spec, "80GiB")


# --- invariants --------------------------------------------------------------------------------

SPECS = [
    ModelMemorySpec.from_hf_config(LLAMA_3_1_8B, tp_size=4),
    ModelMemorySpec.from_hf_config(DEEPSEEK_V3, kv_dtype="fp8_e4m3"),
    ModelMemorySpec.from_hf_config(GPT_OSS_120B),
    ModelMemorySpec.from_hf_config(QWEN3_NEXT_80B, tp_size=2),
    ModelMemorySpec.from_hf_config(FALCON_H1_7B),
]


@settings(max_examples=150, deadline=None)
@given(
    spec=st.sampled_from(SPECS),
    budget=st.integers(min_value=1 << 20, max_value=200 * GiB),
    extra=st.integers(min_value=0, max_value=4 * GiB),
    page_size=st.sampled_from([1, 16, 64]),
    context_len=st.integers(min_value=1, max_value=65_536),
    requests=st.one_of(st.none(), st.integers(min_value=1, max_value=512)),
    swa_ratio=st.floats(min_value=0.05, max_value=1.0),
)
def test_plans_stay_within_budget_whole_pages_and_monotone(
    spec: ModelMemorySpec,
    budget: int,
    extra: int,
    page_size: int,
    context_len: int,
    requests: int | None,
    swa_ratio: float,
) -> None:
    params = SizingParams(
        page_size=page_size,
        context_len=context_len,
        max_running_requests=requests,
        swa_full_tokens_ratio=swa_ratio,
    )
    try:
        small = plan_memory(spec, budget, params)
    except BudgetTooSmall:
        return
    assert small.used_bytes <= budget
    assert small.full_tokens % page_size == 0 and small.swa_tokens % page_size == 0
    assert small.max_concurrent_requests() >= 1
    full_need, swa_need = small.request_needs(context_len)
    assert small.full_tokens >= full_need and small.swa_tokens >= swa_need
    large = plan_memory(spec, budget + extra, params)
    assert large.used_bytes <= budget + extra
    if requests is not None:
        # With the request rows fixed, more memory never means less of any pool. With Mamba
        # layers the state slots grow, and the KV pools may dip by one state's bytes (and by
        # the table rows the extra states back) plus page rounding.
        assert large.mamba_slots >= small.mamba_slots
        if spec.state_bytes_per_request:
            small_kv = small.full_kv_bytes + small.swa_kv_bytes
            large_kv = large.full_kv_bytes + large.swa_kv_bytes
            rows = large.req_table_bytes - small.req_table_bytes
            pages = 2 * page_size * spec.kv_bytes_per_token
            assert small_kv - large_kv <= spec.state_bytes_per_request + rows + pages
        else:
            assert large.full_tokens >= small.full_tokens
            assert large.swa_tokens >= small.swa_tokens


def test_storage_tokens_are_whole_pages() -> None:
    plan = plan_memory(ModelMemorySpec.from_hf_config(LLAMA_3_1_8B), "80GiB")
    assert plan.page_bytes == 16 * 131_072
    assert plan.storage_tokens(GiB) == GiB // (16 * 131_072) * 16 == 8192
    assert plan.storage_tokens(16 * 131_072 - 1) == 0
    with pytest.raises(InvalidCapacity, match="storage size must be >= 0"):
        plan.storage_tokens(-1)
