"""Hugging Face `config.json` excerpts of the families `kvstrata.build.ModelMemorySpec` reads.

Each dict carries the fields of the published config that size the cache (not the whole file),
with the values of the named checkpoint. Tests price them and compare with hand computation.
"""

from __future__ import annotations

# meta-llama/Llama-3.1-8B-Instruct
LLAMA_3_1_8B: dict[str, object] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
    "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
}
# Qwen/Qwen2.5-7B-Instruct (no head_dim: 3584 / 28 = 128)
QWEN2_5_7B: dict[str, object] = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 3584,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "num_hidden_layers": 28,
    "max_position_embeddings": 32768,
    "torch_dtype": "bfloat16",
}
# Qwen/Qwen3-8B (head_dim given)
QWEN3_8B: dict[str, object] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 4096,
    "head_dim": 128,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 36,
    "max_position_embeddings": 40960,
    "torch_dtype": "bfloat16",
}
# mistralai/Mistral-7B-v0.1: a sliding_window, served as full attention (as SGLang does)
MISTRAL_7B: dict[str, object] = {
    "architectures": ["MistralForCausalLM"],
    "model_type": "mistral",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
    "sliding_window": 4096,
    "max_position_embeddings": 32768,
    "torch_dtype": "bfloat16",
}
# deepseek-ai/DeepSeek-V3
DEEPSEEK_V3: dict[str, object] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "num_hidden_layers": 61,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "num_nextn_predict_layers": 1,
    "max_position_embeddings": 163840,
    "torch_dtype": "bfloat16",
}
# deepseek-ai/DeepSeek-V2-Lite
DEEPSEEK_V2_LITE: dict[str, object] = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "num_hidden_layers": 27,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "max_position_embeddings": 163840,
    "torch_dtype": "bfloat16",
}
# moonshotai/Kimi-K2-Instruct
KIMI_K2: dict[str, object] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "kimi_k2",
    "num_hidden_layers": 61,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
}
# google/gemma-2-2b (float32 weights; no layer_types: layers alternate, sliding first)
GEMMA_2_2B: dict[str, object] = {
    "architectures": ["Gemma2ForCausalLM"],
    "model_type": "gemma2",
    "hidden_size": 2304,
    "head_dim": 256,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "num_hidden_layers": 26,
    "sliding_window": 4096,
    "max_position_embeddings": 8192,
    "torch_dtype": "float32",
}
# google/gemma-3-27b-it: the text model nested under text_config, dtype at the top level
GEMMA_3_27B: dict[str, object] = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "model_type": "gemma3",
    "torch_dtype": "bfloat16",
    "text_config": {
        "model_type": "gemma3_text",
        "hidden_size": 5376,
        "head_dim": 128,
        "num_attention_heads": 32,
        "num_key_value_heads": 16,
        "num_hidden_layers": 62,
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
    },
}
# openai/gpt-oss-120b (layer_types alternate, sliding first)
GPT_OSS_120B: dict[str, object] = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "hidden_size": 2880,
    "head_dim": 64,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "num_hidden_layers": 36,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 18,
    "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
}
# Qwen/Qwen3-Next-80B-A3B-Instruct (newer transformers write "dtype")
QWEN3_NEXT_80B: dict[str, object] = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "hidden_size": 2048,
    "head_dim": 256,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "num_hidden_layers": 48,
    "full_attention_interval": 4,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_value_head_dim": 128,
    "max_position_embeddings": 262144,
    "dtype": "bfloat16",
}
# ai21labs/Jamba-v0.1 (attention at layers 4, 12, 20, 28; Mamba-1 elsewhere)
JAMBA_V0_1: dict[str, object] = {
    "architectures": ["JambaForCausalLM"],
    "model_type": "jamba",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
    "attn_layer_offset": 4,
    "attn_layer_period": 8,
    "mamba_d_conv": 4,
    "mamba_d_state": 16,
    "mamba_expand": 2,
    "max_position_embeddings": 262144,
    "torch_dtype": "bfloat16",
}
# nvidia/Nemotron-H-8B-Base-8K (24 M, 4 *, 24 -)
NEMOTRON_H_8B: dict[str, object] = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
    "hidden_size": 4096,
    "num_hidden_layers": 52,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "ssm_state_size": 128,
    "mamba_num_heads": 128,
    "mamba_head_dim": 64,
    "n_groups": 8,
    "conv_kernel": 4,
    "expand": 2,
    "max_position_embeddings": 8192,
    "torch_dtype": "bfloat16",
}
# tiiuae/Falcon-H1-7B-Instruct (attention and Mamba-2 in every layer)
FALCON_H1_7B: dict[str, object] = {
    "architectures": ["FalconH1ForCausalLM"],
    "model_type": "falcon_h1",
    "hidden_size": 3072,
    "head_dim": 128,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "num_hidden_layers": 44,
    "mamba_d_conv": 4,
    "mamba_d_head": 128,
    "mamba_d_ssm": 3072,
    "mamba_d_state": 256,
    "mamba_expand": 2,
    "mamba_n_groups": 1,
    "mamba_n_heads": 24,
    "max_position_embeddings": 262144,
    "torch_dtype": "bfloat16",
}

#: Every excerpt by checkpoint name.
HF_CONFIGS: dict[str, dict[str, object]] = {
    "meta-llama/Llama-3.1-8B-Instruct": LLAMA_3_1_8B,
    "Qwen/Qwen2.5-7B-Instruct": QWEN2_5_7B,
    "Qwen/Qwen3-8B": QWEN3_8B,
    "mistralai/Mistral-7B-v0.1": MISTRAL_7B,
    "deepseek-ai/DeepSeek-V3": DEEPSEEK_V3,
    "deepseek-ai/DeepSeek-V2-Lite": DEEPSEEK_V2_LITE,
    "moonshotai/Kimi-K2-Instruct": KIMI_K2,
    "google/gemma-2-2b": GEMMA_2_2B,
    "google/gemma-3-27b-it": GEMMA_3_27B,
    "openai/gpt-oss-120b": GPT_OSS_120B,
    "Qwen/Qwen3-Next-80B-A3B-Instruct": QWEN3_NEXT_80B,
    "ai21labs/Jamba-v0.1": JAMBA_V0_1,
    "nvidia/Nemotron-H-8B-Base-8K": NEMOTRON_H_8B,
    "tiiuae/Falcon-H1-7B-Instruct": FALCON_H1_7B,
}
