"""`build(spec, budget, options)`: real models' specs built on CPU within small budgets; every
pool has exactly the plan's capacity and bytes, and the system works (allocate, write, cache)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from kvstrata.build import (
    BudgetTooSmall,
    BuildOptions,
    DeviceUnavailable,
    InvalidCapacity,
    InvalidModel,
    ModelMemorySpec,
    SizingParams,
    UnknownPolicy,
    build,
    build_tiered,
    build_with_plan,
    collectors,
)
from kvstrata.pool import MambaPool, MHAKVPool, MLAKVPool, SWAKVPool
from kvstrata.pool_host import MLAHostPool
from kvstrata.testkit.hf_configs import (
    DEEPSEEK_V3,
    FALCON_H1_7B,
    GEMMA_3_27B,
    GPT_OSS_120B,
    JAMBA_V0_1,
    LLAMA_3_1_8B,
    QWEN3_NEXT_80B,
)
from kvstrata.unified_radix_cache import RadixKey

MiB = 1 << 20


def _options(context_len: int = 256, requests: int = 4) -> BuildOptions:
    return BuildOptions(sizing=SizingParams(context_len=context_len, max_running_requests=requests))


def test_dense_model_pools_match_the_plan() -> None:
    spec = ModelMemorySpec.from_hf_config(LLAMA_3_1_8B, tp_size=8, kv_dtype="fp8_e4m3")
    built = build_with_plan(spec, 16 * MiB, _options())
    system, plan = built.system, built.plan
    assert system.family == "mha"
    pool = system.kv_pool
    assert isinstance(pool, MHAKVPool)
    assert pool.size == plan.full_tokens == system.capacity_tokens
    assert pool.bytes_per_token == spec.full_kv_bytes_per_token == 8192
    # The pool's buffers: the plan's bytes plus the dummy page 0.
    assert pool.size_bytes == plan.full_kv_bytes + plan.page_bytes
    assert system.req_to_token is not None
    assert system.req_to_token.size == 4 and system.req_to_token.max_context_len == 256
    assert system.req_to_token.size_bytes == plan.req_table_bytes
    assert plan.used_bytes <= 16 * MiB
    assert system.attention_layer_ids == tuple(range(32))
    system.check_integrity()


def test_dense_system_allocates_writes_and_caches() -> None:
    spec = ModelMemorySpec.from_hf_config(LLAMA_3_1_8B, tp_size=8)
    system = build(spec, "8MiB", _options())
    loc = system.kv_allocator.alloc(32)
    assert loc is not None
    k = torch.randn(32, 1, 128, dtype=torch.bfloat16)
    system.layers.set_kv(5, loc, k, k + 1)
    assert torch.equal(system.layers.get_key_buffer(5)[loc], k)
    key = RadixKey(list(range(32)))
    result = system.tree.insert(key, loc)
    assert result is not None
    assert system.tree.match_prefix(key).device_indices.numel() == 32
    system.check_integrity()


def test_mla_model_gets_a_latent_pool() -> None:
    spec = ModelMemorySpec.from_hf_config(DEEPSEEK_V3, tp_size=8, kv_dtype="fp8_e4m3")
    built = build_with_plan(spec, 16 * MiB, _options())
    pool = built.system.kv_pool
    assert built.system.family == "mla"
    assert isinstance(pool, MLAKVPool)
    assert pool.size == built.plan.full_tokens
    assert pool.bytes_per_token == 35_136
    assert pool.size_bytes == built.plan.full_kv_bytes + built.plan.page_bytes
    built.system.check_integrity()


@pytest.mark.parametrize("config", [GPT_OSS_120B, GEMMA_3_27B], ids=["gpt-oss", "gemma-3"])
def test_swa_model_gets_both_pools_at_the_plan_sizes(config: dict[str, object]) -> None:
    spec = ModelMemorySpec.from_hf_config(config, tp_size=8)
    built = build_with_plan(spec, 48 * MiB, _options(context_len=512))
    system, plan = built.system, built.plan
    pool = system.kv_pool
    assert system.family == "swa"
    assert isinstance(pool, SWAKVPool)
    assert pool.full_pool.size == plan.full_tokens
    assert pool.swa_pool.size == plan.swa_tokens
    assert system.sliding_window == spec.sliding_window
    assert plan.used_bytes <= 48 * MiB
    system.check_integrity()


@pytest.mark.parametrize(
    ("config", "tp"), [(QWEN3_NEXT_80B, 8), (JAMBA_V0_1, 8)], ids=["qwen3-next", "jamba"]
)
def test_mamba_hybrid_gets_a_state_pool(config: dict[str, object], tp: int) -> None:
    spec = ModelMemorySpec.from_hf_config(config, tp_size=tp)
    built = build_with_plan(spec, 96 * MiB, _options())
    system, plan = built.system, built.plan
    assert system.family == "mamba"
    state = system.mamba_pool
    assert isinstance(state, MambaPool)
    assert state.size == plan.mamba_slots >= 3
    # One slot of the state pool, all layers: exactly the spec's bytes per request.
    assert state.bytes_per_token == spec.state_bytes_per_request
    assert system.mamba_layer_ids == spec.mamba_layer_ids
    assert system.attention_layer_ids == spec.full_layer_ids
    assert system.kv_pool.size == plan.full_tokens
    system.check_integrity()


def test_falcon_h1_layers_get_a_kv_id_and_a_state_id() -> None:
    spec = ModelMemorySpec.from_hf_config(FALCON_H1_7B, tp_size=8)
    built = build_with_plan(spec, "1GiB", _options(context_len=4096))
    system, plan = built.system, built.plan
    layers = len(spec.layer_kinds)
    assert system.family == "mamba" and system.parallel_state_offset == layers
    assert system.attention_layer_ids == tuple(range(layers))
    assert system.mamba_layer_ids == tuple(range(layers, 2 * layers))
    assert [system.state_layer_id(i) for i in (0, 43)] == [layers, layers + 43]
    state = system.mamba_pool
    assert isinstance(state, MambaPool) and state.size == plan.mamba_slots
    assert state.bytes_per_token == spec.state_bytes_per_request
    assert system.kv_pool.size == plan.full_tokens
    assert plan.used_bytes <= plan.budget_bytes
    system.check_integrity()
    with pytest.raises(KeyError, match="no Mamba state"):
        build(ModelMemorySpec.from_hf_config(LLAMA_3_1_8B), "1GiB", _options()).state_layer_id(0)


def test_swa_with_mamba_is_refused_naming_the_missing_tree_family() -> None:
    mamba = ModelMemorySpec.from_hf_config(JAMBA_V0_1)
    gemma = ModelMemorySpec.from_hf_config(GEMMA_3_27B)
    kinds = ("swa", "full", "mamba", "swa")
    layout = replace(
        mamba.layout,
        layer_kinds=kinds,
        swa=gemma.layout.swa,
        sliding_window=gemma.sliding_window,
        full=gemma.layout.full,
    )
    spec = ModelMemorySpec.from_layout(layout, kv_dtype=None, mamba_ssm_dtype="float32", tp_size=1)
    with pytest.raises(InvalidModel, match="no tree family has both an SWA and a Mamba"):
        build(spec, "1GiB", _options())


def test_refusals_come_before_any_allocation() -> None:
    llama = ModelMemorySpec.from_hf_config(LLAMA_3_1_8B)
    with pytest.raises(UnknownPolicy, match="'lifo'"):
        build(llama, "1GiB", BuildOptions(policy="lifo"))
    with pytest.raises(BudgetTooSmall, match="cannot hold one request"):
        build(llama, "16MiB", _options(context_len=4096))
    if not torch.cuda.is_available():
        with pytest.raises(DeviceUnavailable):
            build(llama, "1GiB", BuildOptions(device="cuda"))


def test_fractional_budget_uses_the_given_free_memory() -> None:
    spec = ModelMemorySpec.from_hf_config(LLAMA_3_1_8B, tp_size=8, kv_dtype="fp8_e4m3")
    options = BuildOptions(
        sizing=SizingParams(context_len=256, max_running_requests=4),
        free_device_bytes=32 * MiB,
    )
    built = build_with_plan(spec, "50%", options)
    assert built.plan.budget_bytes == 16 * MiB
    assert built.plan.used_bytes <= 16 * MiB


def _qwen3_next_tiered() -> tuple[ModelMemorySpec, BuildOptions]:
    """Qwen3-Next on one of 8 ranks, a host tier as large as the device and memory storage."""
    spec = ModelMemorySpec.from_hf_config(QWEN3_NEXT_80B, tp_size=8)
    options = BuildOptions(
        sizing=SizingParams(context_len=256, max_running_requests=4, host_ratio=1.0),
        free_host_bytes=1 << 40,
        storage_url="memory://?capacity_bytes=100000000",
    )
    return spec, options


def test_tiered_build_adds_the_plans_host_tier_and_storage() -> None:
    spec, options = _qwen3_next_tiered()
    tiered = build_tiered(spec, 96 * MiB, options)
    try:
        plan = build_with_plan(spec, 96 * MiB, options).plan
        assert plan.host is not None
        assert tiered.host_tokens == plan.host.full_tokens == tiered.system.capacity_tokens
        assert tiered.host_state_slots == plan.mamba_slots
        assert tiered.storage is not None
        tiered.check_integrity()
    finally:
        tiered.close()


def test_tiered_build_refusals() -> None:
    llama = ModelMemorySpec.from_hf_config(LLAMA_3_1_8B, tp_size=8)
    with pytest.raises(InvalidCapacity, match="needs a host tier"):
        build_tiered(llama, "8MiB", _options())


def test_tiered_mla_build_mirrors_the_latent_pool() -> None:
    deepseek = ModelMemorySpec.from_hf_config(DEEPSEEK_V3, tp_size=8, kv_dtype="fp8_e4m3")
    options = BuildOptions(
        sizing=SizingParams(context_len=256, max_running_requests=4, host_ratio=1.5),
        free_host_bytes=1 << 40,
        storage_url="memory://?capacity_bytes=10000000",
    )
    tiered = build_tiered(deepseek, "16MiB", options)
    try:
        plan = build_with_plan(deepseek, "16MiB", options).plan
        assert plan.host is not None
        assert isinstance(tiered.host_pool, MLAHostPool)
        assert tiered.host_pool.device_pool is tiered.system.kv_pool
        assert tiered.host_tokens == plan.host.full_tokens
        assert (tiered.host_state_slots, tiered.host_swa_tokens) == (None, None)
        assert tiered.storage is not None
        tiered.check_integrity()
    finally:
        tiered.close()


def test_collectors_export_every_wired_part() -> None:
    spec, options = _qwen3_next_tiered()
    tiered = build_tiered(spec, 96 * MiB, options)
    try:
        registry = CollectorRegistry()
        for collector in collectors(tiered.system, tiered):
            registry.register(collector)
        text = generate_latest(registry).decode()
        for prefix in (
            "kvstrata_pool_",
            "kvstrata_allocator_",
            "kvstrata_radix_",
            "kvstrata_host_",
            "kvstrata_tier_",
            "kvstrata_storage_",
            "kvstrata_tiered_cache_",
        ):
            assert prefix in text, prefix
        assert 'pool="req_to_token"' in text and 'pool="mamba"' in text
    finally:
        tiered.close()
    device_only = collectors(
        build(ModelMemorySpec.from_hf_config(LLAMA_3_1_8B, tp_size=8), "8MiB", _options())
    )
    assert len(device_only) == 3
