"""From a Hugging Face `config.json` dict to a `ModelLayout`: one dispatch table from the
config's `model_type` to the family reader.

A multimodal config nests its language model under `text_config` (Gemma-3, Qwen3.5): the text
config is read, with its fields reported as `text_config.<field>`, and the top level's
`torch_dtype` stands in where the text config has none. A config without a known `model_type`
is looked up by its `architectures[0]` class name; neither known is `UnknownArchitecture`,
listing the known model types.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from kvstrata.build.errors import InvalidModel, UnknownArchitecture
from kvstrata.build.hf_attention import (
    read_dense,
    read_gemma2,
    read_gemma3,
    read_gpt_oss,
    read_mla,
)
from kvstrata.build.hf_hybrid import read_falcon_h1, read_jamba, read_nemotron_h, read_qwen3_next
from kvstrata.build.hf_layout import ConfigReader, ModelLayout

#: A family reader: the (text) config and the tensor-parallel size -> the layout.
Reader = Callable[[ConfigReader, int], ModelLayout]

READERS: Mapping[str, Reader] = MappingProxyType(
    {
        "llama": read_dense,
        "mistral": read_dense,
        "mixtral": read_dense,
        "qwen2": read_dense,
        "qwen2_moe": read_dense,
        "qwen3": read_dense,
        "qwen3_moe": read_dense,
        "deepseek_v2": read_mla,
        "deepseek_v3": read_mla,
        "kimi_k2": read_mla,
        "gemma2": read_gemma2,
        "gemma3": read_gemma3,
        "gemma3_text": read_gemma3,
        "gpt_oss": read_gpt_oss,
        "qwen3_next": read_qwen3_next,
        "qwen3_5": read_qwen3_next,
        "qwen3_5_text": read_qwen3_next,
        "qwen3_5_moe": read_qwen3_next,
        "qwen3_5_moe_text": read_qwen3_next,
        "jamba": read_jamba,
        "nemotron_h": read_nemotron_h,
        "falcon_h1": read_falcon_h1,
    }
)

#: `architectures[0]` class names, for configs whose `model_type` is missing or unknown.
ARCHITECTURE_MODEL_TYPES: Mapping[str, str] = MappingProxyType(
    {
        "LlamaForCausalLM": "llama",
        "MistralForCausalLM": "mistral",
        "MixtralForCausalLM": "mixtral",
        "Qwen2ForCausalLM": "qwen2",
        "Qwen2MoeForCausalLM": "qwen2_moe",
        "Qwen3ForCausalLM": "qwen3",
        "Qwen3MoeForCausalLM": "qwen3_moe",
        "DeepseekV2ForCausalLM": "deepseek_v2",
        "DeepseekV3ForCausalLM": "deepseek_v3",
        "KimiK2ForCausalLM": "kimi_k2",
        "Gemma2ForCausalLM": "gemma2",
        "Gemma3ForCausalLM": "gemma3_text",
        "Gemma3ForConditionalGeneration": "gemma3",
        "GptOssForCausalLM": "gpt_oss",
        "Qwen3NextForCausalLM": "qwen3_next",
        "JambaForCausalLM": "jamba",
        "NemotronHForCausalLM": "nemotron_h",
        "FalconH1ForCausalLM": "falcon_h1",
    }
)

#: Model types whose readers handle them, in the order error messages list them.
MODEL_TYPES: tuple[str, ...] = tuple(READERS)


def read_layout(config: Mapping[str, object], *, tp_size: int) -> ModelLayout:
    """The layout of `config` (a parsed `config.json`) on one of `tp_size` ranks.

    Raises UnknownArchitecture, MissingConfigField (naming the field), InvalidModel (a field of
    the wrong type or an inconsistent layout, a tp_size that does not divide the state)."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise InvalidModel(f"tp_size must be a positive int, got {tp_size!r}")
    text = config.get("text_config")
    if isinstance(text, Mapping):
        text_config: Mapping[str, object] = {str(k): v for k, v in text.items()}
        for name in ("torch_dtype", "dtype"):
            if text_config.get(name) is None and config.get(name) is not None:
                text_config = {**text_config, name: config[name]}
        # The text model's own type names the reader (a vision-language wrapper around a
        # known text model is read as that model); else the top level's.
        inner = text_config.get("model_type")
        model_type = inner if isinstance(inner, str) and inner in READERS else _model_type(config)
        cfg = ConfigReader(text_config, architecture=model_type, prefix="text_config.")
    else:
        cfg = ConfigReader(config, architecture=_model_type(config))
    model_type = cfg.architecture
    return READERS[model_type](cfg, tp_size)


def _model_type(config: Mapping[str, object]) -> str:
    model_type = config.get("model_type")
    if isinstance(model_type, str) and model_type in READERS:
        return model_type
    architectures = config.get("architectures")
    if isinstance(architectures, list) and architectures:
        first: object = architectures[0]
        if isinstance(first, str) and first in ARCHITECTURE_MODEL_TYPES:
            return ARCHITECTURE_MODEL_TYPES[first]
    if model_type is None and not architectures:
        raise UnknownArchitecture(
            "config has neither model_type nor architectures; known model types: "
            + ", ".join(MODEL_TYPES)
        )
    raise UnknownArchitecture(
        f"unknown architecture (model_type {model_type!r}, architectures {architectures!r}); "
        f"known model types: {', '.join(MODEL_TYPES)}"
    )
