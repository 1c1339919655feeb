"""`ModelMemorySpec.from_hf_config` against hand computation, on the real configs' relevant fields.

Each config below carries the fields of the published `config.json` that size the cache (not
the whole file). The expected figures are worked out by hand in the comments: bytes per token
of K and V = 2 x kv heads x head_dim x dtype bytes x layers; MLA = (kv_lora_rank +
qk_rope_head_dim) x dtype bytes x layers; states as in `hf_hybrid`'s docstring.
"""

from __future__ import annotations

from typing import cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.build import InvalidModel, MissingConfigField, ModelMemorySpec, UnknownArchitecture
from kvstrata.testkit.hf_configs import (
    DEEPSEEK_V2_LITE,
    DEEPSEEK_V3,
    FALCON_H1_7B,
    GEMMA_2_2B,
    GEMMA_3_27B,
    GPT_OSS_120B,
    HF_CONFIGS,
    JAMBA_V0_1,
    KIMI_K2,
    LLAMA_3_1_8B,
    MISTRAL_7B,
    NEMOTRON_H_8B,
    QWEN2_5_7B,
    QWEN3_8B,
    QWEN3_NEXT_80B,
)

#: Gemma-3's nested text config, typed for the tests that edit it.
GEMMA_3_TEXT = cast("dict[str, object]", GEMMA_3_27B["text_config"])

# (name, config, kwargs, full B/token, swa B/token, window, state B/request)
CASES: list[tuple[str, dict[str, object], dict[str, object], int, int, int | None, int]] = [
    # 2 x 8 x 128 x 2 B x 32 layers
    ("llama-3.1-8b", LLAMA_3_1_8B, {}, 131_072, 0, None, 0),
    # fp8: one byte an element
    ("llama-3.1-8b fp8", LLAMA_3_1_8B, {"kv_dtype": "fp8_e4m3"}, 65_536, 0, None, 0),
    ("llama-3.1-8b e5m2", LLAMA_3_1_8B, {"kv_dtype": "fp8_e5m2"}, 65_536, 0, None, 0),
    # tp 8: one KV head per rank: 2 x 1 x 128 x 2 x 32
    ("llama-3.1-8b tp8", LLAMA_3_1_8B, {"tp_size": 8}, 16_384, 0, None, 0),
    # tp 16 > 8 heads: heads replicated, still one per rank
    ("llama-3.1-8b tp16", LLAMA_3_1_8B, {"tp_size": 16}, 16_384, 0, None, 0),
    ("llama-3.1-8b f32", LLAMA_3_1_8B, {"kv_dtype": "float32"}, 262_144, 0, None, 0),
    # 2 x 4 x (3584 / 28 = 128) x 2 x 28
    ("qwen2.5-7b", QWEN2_5_7B, {}, 57_344, 0, None, 0),
    # 2 x 8 x 128 x 2 x 36
    ("qwen3-8b", QWEN3_8B, {}, 147_456, 0, None, 0),
    ("mistral-7b", MISTRAL_7B, {"kv_dtype": "float16"}, 131_072, 0, None, 0),
    # (512 + 64) x 2 x 61, not split by tp
    ("deepseek-v3", DEEPSEEK_V3, {}, 70_272, 0, None, 0),
    (
        "deepseek-v3 tp8 fp8",
        DEEPSEEK_V3,
        {"tp_size": 8, "kv_dtype": "fp8_e4m3"},
        35_136,
        0,
        None,
        0,
    ),
    # (512 + 64) x 2 x 27
    ("deepseek-v2-lite", DEEPSEEK_V2_LITE, {}, 31_104, 0, None, 0),
    ("kimi-k2", KIMI_K2, {}, 70_272, 0, None, 0),
    # 13 full and 13 sliding layers of 2 x 4 x 256 x 4 B = 8192
    ("gemma-2-2b", GEMMA_2_2B, {}, 106_496, 106_496, 4096, 0),
    # layers 5, 11, ..., 59 full (10), 52 sliding, each 2 x 16 x 128 x 2 = 8192
    ("gemma-3-27b", GEMMA_3_27B, {}, 81_920, 425_984, 1024, 0),
    # 18 + 18 layers of 2 x 8 x 64 x 2 = 2048
    ("gpt-oss-120b", GPT_OSS_120B, {}, 36_864, 36_864, 128, 0),
    # 12 full layers of 2 x 2 x 256 x 2 = 2048; 36 DeltaNet layers of
    # conv (2 x 16 x 128 + 32 x 128 = 8192) x 3 x 2 B = 49_152
    # + ssm 32 x 128 x 128 x 4 B = 2_097_152
    ("qwen3-next-80b", QWEN3_NEXT_80B, {}, 24_576, 0, None, 36 * (49_152 + 2_097_152)),
    # tp 2: one KV head; conv 4096 x 3 x 2 = 24_576; ssm 16 x 128 x 128 x 4 = 1_048_576
    ("qwen3-next-80b tp2", QWEN3_NEXT_80B, {"tp_size": 2}, 12_288, 0, None, 36 * 1_073_152),
    # ssm in bfloat16: 32 x 128 x 128 x 2 = 1_048_576
    (
        "qwen3-next-80b ssm bf16",
        QWEN3_NEXT_80B,
        {"mamba_ssm_dtype": "bfloat16"},
        24_576,
        0,
        None,
        36 * (49_152 + 1_048_576),
    ),
    # 4 attention layers x 2 x 8 x 128 x 2; 28 Mamba-1 layers of
    # conv 8192 x 3 x 2 = 49_152 + ssm 8192 x 16 x 4 = 524_288
    ("jamba-v0.1", JAMBA_V0_1, {}, 16_384, 0, None, 28 * (49_152 + 524_288)),
    # 4 attention layers x 4096; 24 Mamba-2 layers of conv (8192 + 2 x 8 x 128 = 10_240)
    # x 3 x 2 = 61_440 + ssm 128 x 64 x 128 x 4 = 4_194_304
    ("nemotron-h-8b", NEMOTRON_H_8B, {}, 16_384, 0, None, 24 * (61_440 + 4_194_304)),
    # 44 layers x 2 x 2 x 128 x 2 = 1024; 44 Mamba-2 mixers of conv (3072 + 2 x 256 = 3584)
    # x 3 x 2 = 21_504 + ssm 24 x 128 x 256 x 4 = 3_145_728
    ("falcon-h1-7b", FALCON_H1_7B, {}, 45_056, 0, None, 44 * (21_504 + 3_145_728)),
    # tp 2: the single group is replicated to 2: conv (3072 + 2 x 2 x 256) / 2 = 2048, x 3 x 2
    # = 12_288; ssm 12 x 128 x 256 x 4 = 1_572_864; one KV head: 44 x 2 x 128 x 2 = 22_528
    ("falcon-h1-7b tp2", FALCON_H1_7B, {"tp_size": 2}, 22_528, 0, None, 44 * 1_585_152),
]


@pytest.mark.parametrize(
    ("config", "kwargs", "full", "swa", "window", "state"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_figures_match_hand_computation(
    config: dict[str, object],
    kwargs: dict[str, object],
    full: int,
    swa: int,
    window: int | None,
    state: int,
) -> None:
    spec = ModelMemorySpec.from_hf_config(config, **kwargs)  # pyright: ignore[reportArgumentType]
    assert spec.full_kv_bytes_per_token == full
    assert spec.swa_kv_bytes_per_token == swa
    assert spec.sliding_window == window
    assert spec.state_bytes_per_request == state
    assert spec.kv_bytes_per_token == full + swa


def test_layer_kinds_follow_each_family_pattern() -> None:
    gemma2 = ModelMemorySpec.from_hf_config(GEMMA_2_2B)
    assert gemma2.layer_kinds[:4] == ("swa", "full", "swa", "full")
    gemma3 = ModelMemorySpec.from_hf_config(GEMMA_3_27B)
    assert gemma3.full_layer_ids == (5, 11, 17, 23, 29, 35, 41, 47, 53, 59)
    assert len(gemma3.swa_layer_ids) == 52
    oss = ModelMemorySpec.from_hf_config(GPT_OSS_120B)
    assert oss.full_layer_ids == tuple(range(1, 36, 2))
    qwen_next = ModelMemorySpec.from_hf_config(QWEN3_NEXT_80B)
    assert qwen_next.full_layer_ids == tuple(range(3, 48, 4))
    assert qwen_next.layer_kinds[:4] == ("mamba", "mamba", "mamba", "full")
    jamba = ModelMemorySpec.from_hf_config(JAMBA_V0_1)
    assert jamba.full_layer_ids == (4, 12, 20, 28)
    assert len(jamba.mamba_layer_ids) == 28
    nemotron = ModelMemorySpec.from_hf_config(NEMOTRON_H_8B)
    assert nemotron.layer_kinds[:9] == (
        "mamba", "none", "mamba", "none", "mamba", "none", "mamba", "full", "none",
    )  # fmt: skip
    assert (len(nemotron.full_layer_ids), len(nemotron.mamba_layer_ids)) == (4, 24)
    falcon = ModelMemorySpec.from_hf_config(FALCON_H1_7B)
    assert set(falcon.layer_kinds) == {"full+mamba"}
    assert falcon.full_layer_ids == falcon.mamba_layer_ids == tuple(range(44))
    deepseek = ModelMemorySpec.from_hf_config(DEEPSEEK_V3)
    assert deepseek.is_mla and len(deepseek.layer_kinds) == 61


def test_layer_types_take_precedence_over_patterns() -> None:
    # Gemma-3 with both: the explicit list wins.
    text = dict(GEMMA_3_TEXT)
    text["num_hidden_layers"] = 4
    text["layer_types"] = [
        "full_attention",
        "sliding_attention",
        "sliding_attention",
        "full_attention",
    ]
    spec = ModelMemorySpec.from_hf_config({**GEMMA_3_27B, "text_config": text})
    assert spec.layer_kinds == ("full", "swa", "swa", "full")
    # Qwen3-Next with layer_types
    config = {**QWEN3_NEXT_80B, "num_hidden_layers": 4}
    config["layer_types"] = [
        "full_attention",
        "linear_attention",
        "full_attention",
        "linear_attention",
    ]
    assert ModelMemorySpec.from_hf_config(config).layer_kinds == ("full", "mamba", "full", "mamba")


def test_dtypes_and_architecture_lookup() -> None:
    spec = ModelMemorySpec.from_hf_config(FALCON_H1_7B)
    assert (spec.kv_dtype, spec.conv_dtype, spec.mamba_ssm_dtype) == (
        "bfloat16",
        "bfloat16",
        "float32",
    )
    assert ModelMemorySpec.from_hf_config(LLAMA_3_1_8B, kv_dtype="auto").kv_dtype == "bfloat16"
    # No model_type: the architectures class name picks the reader.
    no_type = {k: v for k, v in QWEN3_8B.items() if k != "model_type"}
    assert ModelMemorySpec.from_hf_config(no_type).full_kv_bytes_per_token == 147_456
    # A model dtype is not needed when the KV dtype is named (and there is no Mamba state).
    no_dtype = {k: v for k, v in LLAMA_3_1_8B.items() if k != "torch_dtype"}
    assert ModelMemorySpec.from_hf_config(no_dtype, kv_dtype="fp8_e5m2").kv_dtype == "fp8_e5m2"
    assert ModelMemorySpec.from_hf_config(LLAMA_3_1_8B).context_len == 131072


def _without(config: dict[str, object], field: str) -> dict[str, object]:
    return {k: v for k, v in config.items() if k != field}


@pytest.mark.parametrize(
    ("config", "field"),
    [
        (LLAMA_3_1_8B, "num_hidden_layers"),
        (LLAMA_3_1_8B, "hidden_size"),
        (DEEPSEEK_V3, "kv_lora_rank"),
        (GEMMA_2_2B, "sliding_window"),
        (QWEN3_NEXT_80B, "full_attention_interval"),
        (QWEN3_NEXT_80B, "linear_num_value_heads"),
        (JAMBA_V0_1, "attn_layer_period"),
        (NEMOTRON_H_8B, "hybrid_override_pattern"),
        (NEMOTRON_H_8B, "n_groups"),
        (FALCON_H1_7B, "mamba_n_heads"),
        (LLAMA_3_1_8B, "torch_dtype"),
        (JAMBA_V0_1, "torch_dtype"),
    ],
)
def test_a_missing_field_is_named(config: dict[str, object], field: str) -> None:
    with pytest.raises(MissingConfigField, match=field):
        ModelMemorySpec.from_hf_config(_without(config, field), kv_dtype=None)


@pytest.mark.parametrize(
    ("text_config", "field"),
    [
        (_without(GEMMA_3_TEXT, "head_dim") | {"hidden_size": None}, "hidden_size"),
        (_without(GEMMA_3_TEXT, "sliding_window_pattern"), "sliding_window_pattern"),
    ],
)
def test_a_missing_text_config_field_is_named(text_config: dict[str, object], field: str) -> None:
    config = {**GEMMA_3_27B, "text_config": text_config}
    with pytest.raises(MissingConfigField, match=rf"text_config\.{field}"):
        ModelMemorySpec.from_hf_config(config, kv_dtype=None)


def test_unknown_architecture_lists_the_known_ones() -> None:
    with pytest.raises(UnknownArchitecture, match="known model types: llama"):
        ModelMemorySpec.from_hf_config({"model_type": "bert", "architectures": ["BertModel"]})
    with pytest.raises(UnknownArchitecture, match="neither model_type nor architectures"):
        ModelMemorySpec.from_hf_config({"num_hidden_layers": 2})


@pytest.mark.parametrize(
    ("config", "kwargs", "match"),
    [
        (LLAMA_3_1_8B, {"kv_dtype": "int4"}, "unknown kv_dtype 'int4'"),
        (LLAMA_3_1_8B, {"mamba_ssm_dtype": "fp8_e4m3"}, "unknown mamba_ssm_dtype"),
        (LLAMA_3_1_8B, {"tp_size": 0}, "tp_size must be a positive int"),
        ({**LLAMA_3_1_8B, "torch_dtype": "int8"}, {}, "torch_dtype 'int8'"),
        ({**LLAMA_3_1_8B, "num_hidden_layers": "32"}, {}, "must be an integer"),
        ({**LLAMA_3_1_8B, "num_hidden_layers": 0}, {}, "must be >= 1"),
        (_without(QWEN2_5_7B, "num_key_value_heads") | {"hidden_size": 3585}, {}, "not a multiple"),
        (QWEN3_NEXT_80B, {"tp_size": 3}, "not divisible by tp_size 3"),
        (NEMOTRON_H_8B, {"tp_size": 3}, "cannot be sharded over tp_size 3"),
        ({**NEMOTRON_H_8B, "hybrid_override_pattern": "M*"}, {}, "has 2 characters"),
        (
            {**NEMOTRON_H_8B, "hybrid_override_pattern": "X" * 52},
            {},
            r"hybrid_override_pattern\[0\]",
        ),
        ({**GPT_OSS_120B, "layer_types": ["chunked_attention"] * 36}, {}, r"layer_types\[0\]"),
        ({**GPT_OSS_120B, "layer_types": ["full_attention"] * 3}, {}, "has 3 entries"),
        ({**GPT_OSS_120B, "layer_types": "full"}, {}, "must be a list of strings"),
        ({**FALCON_H1_7B, "mamba_d_head": 100}, {}, "mamba_d_head 100"),
    ],
)
def test_bad_configs_and_arguments_are_refused(
    config: dict[str, object], kwargs: dict[str, object], match: str
) -> None:
    with pytest.raises(InvalidModel, match=match):
        ModelMemorySpec.from_hf_config(config, **kwargs)  # pyright: ignore[reportArgumentType]


def test_config_must_be_a_dict() -> None:
    with pytest.raises(InvalidModel, match="must be a dict"):
        ModelMemorySpec.from_hf_config(["llama"])  # pyright: ignore[reportArgumentType]


def test_a_wrapper_around_a_known_text_model_reads_the_text_model() -> None:
    # A vision-language wrapper (unknown top-level type) around Llama-3.1-8B's text model.
    text = {k: v for k, v in LLAMA_3_1_8B.items() if k not in ("architectures", "torch_dtype")}
    wrapper: dict[str, object] = {
        "model_type": "llava",
        "architectures": ["LlavaForConditionalGeneration"],
        "torch_dtype": "bfloat16",
        "text_config": text,
    }
    spec = ModelMemorySpec.from_hf_config(wrapper)
    assert spec.architecture == "llama"
    assert spec.full_kv_bytes_per_token == 131_072
    # Unknown at both levels: the error names the top level's type.
    with pytest.raises(UnknownArchitecture, match="'llava'"):
        ModelMemorySpec.from_hf_config({**wrapper, "text_config": {"model_type": "mystery"}})


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(sorted(HF_CONFIGS)),
    tp=st.sampled_from([1, 2, 4, 8]),
    ssm=st.sampled_from(["float32", "bfloat16", "float16"]),
)
def test_dtype_and_tp_scale_every_figure(name: str, tp: int, ssm: str) -> None:
    config = HF_CONFIGS[name]
    try:
        wide = ModelMemorySpec.from_hf_config(config, kv_dtype="bfloat16", tp_size=tp)
    except InvalidModel:
        return  # this tp does not divide the model's state (tested above)
    narrow = ModelMemorySpec.from_hf_config(
        config, kv_dtype="fp8_e4m3", tp_size=tp, mamba_ssm_dtype=ssm
    )
    # One byte an element instead of two, every attention layer.
    assert wide.full_kv_bytes_per_token == 2 * narrow.full_kv_bytes_per_token
    assert wide.swa_kv_bytes_per_token == 2 * narrow.swa_kv_bytes_per_token
    assert wide.layer_kinds == narrow.layer_kinds
    # More ranks never cost a rank more; MLA latents are replicated, so they cost the same.
    single = ModelMemorySpec.from_hf_config(config, kv_dtype="bfloat16")
    assert wide.full_kv_bytes_per_token <= single.full_kv_bytes_per_token
    assert wide.state_bytes_per_request <= single.state_bytes_per_request
    if single.is_mla:
        assert wide.full_kv_bytes_per_token == single.full_kv_bytes_per_token
    if ssm == "float32":
        assert narrow.state_bytes_per_request == wide.state_bytes_per_request
    else:
        assert narrow.state_bytes_per_request <= wide.state_bytes_per_request
    kinds = set(wide.layer_kinds)
    assert (wide.state_bytes_per_request > 0) == bool(kinds & {"mamba", "full+mamba"})
    assert (wide.swa_kv_bytes_per_token > 0) == ("swa" in kinds)
