"""Tiny Hugging Face configs (float32) of the cache kinds, for engines run on a CPU.

Each carries the fields `kvstrata.build.ModelMemorySpec.from_hf_config` reads and the few a
reference model needs (`vocab_size`, `intermediate_size`). Small enough that a model with
seeded random weights runs a few hundred tokens in well under a second per step.
"""

from __future__ import annotations

from kvstrata.build import BuildOptions, MemorySystem, ModelMemorySpec, SizingParams, build

_COMMON: dict[str, object] = {
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "torch_dtype": "float32",
    "vocab_size": 61,
    "intermediate_size": 48,
}

#: MHA / GQA: 2 full-attention layers, 4 query heads over 2 KV heads of 8.
TINY_LLAMA: dict[str, object] = {**_COMMON, "model_type": "llama", "num_hidden_layers": 2}

#: MLA: 2 layers of a 12-wide latent plus a 4-wide rotary part per token.
TINY_DEEPSEEK: dict[str, object] = {
    **_COMMON,
    "model_type": "deepseek_v3",
    "num_hidden_layers": 2,
    "kv_lora_rank": 12,
    "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 8,
    "v_head_dim": 8,
}

#: SWA hybrid: sliding (window 8), full, sliding, full.
TINY_GPT_OSS: dict[str, object] = {
    **_COMMON,
    "model_type": "gpt_oss",
    "head_dim": 8,
    "num_hidden_layers": 4,
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
}

#: Mamba hybrid: Mamba-1 layers 0, 2, 3 and attention at layer 1 (period 4, offset 1).
TINY_JAMBA: dict[str, object] = {
    **_COMMON,
    "model_type": "jamba",
    "num_hidden_layers": 4,
    "attn_layer_offset": 1,
    "attn_layer_period": 4,
    "mamba_d_conv": 4,
    "mamba_d_state": 4,
    "mamba_expand": 1,
}

#: Parallel hybrid (Falcon-H1): 2 layers, each an attention and a Mamba-2 mixer side by side
#: (2 SSM heads of 8 over d_state 4; conv over 16 + 2 x 4 channels).
TINY_FALCON_H1: dict[str, object] = {
    **_COMMON,
    "model_type": "falcon_h1",
    "head_dim": 8,
    "num_hidden_layers": 2,
    "mamba_d_conv": 4,
    "mamba_d_head": 8,
    "mamba_d_ssm": 16,
    "mamba_d_state": 4,
    "mamba_expand": 1,
    "mamba_n_groups": 1,
    "mamba_n_heads": 2,
}

TINY_MODELS: dict[str, dict[str, object]] = {
    "mha": TINY_LLAMA,
    "mla": TINY_DEEPSEEK,
    "swa": TINY_GPT_OSS,
    "mamba": TINY_JAMBA,
    "falcon_h1": TINY_FALCON_H1,
}


def tiny_system(
    kind: str,
    *,
    kv_tokens: int,
    page_size: int = 4,
    rows: int = 8,
    context_len: int = 64,
    mamba_slots: int = 12,
) -> MemorySystem:
    """A memory system of `TINY_MODELS[kind]` built through `kvstrata.build.build` with a
    budget of about `kv_tokens` KV tokens (full + SWA cells, as the plan charges them), `rows`
    request rows of `context_len` and, for Mamba, `mamba_slots` states. CPU."""
    spec = ModelMemorySpec.from_hf_config(TINY_MODELS[kind])
    sizing = SizingParams(
        page_size=page_size,
        context_len=context_len,
        max_running_requests=rows,
        mamba_cache_size=mamba_slots if spec.mamba_layer_ids else None,
    )
    table = (rows + 1) * context_len * 4
    states = mamba_slots * spec.state_bytes_per_request if spec.mamba_layer_ids else 0
    cell = spec.full_kv_bytes_per_token + spec.swa_kv_bytes_per_token
    return build(spec, table + states + kv_tokens * cell, BuildOptions(sizing=sizing))
