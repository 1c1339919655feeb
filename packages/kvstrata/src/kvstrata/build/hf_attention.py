"""Readers of attention-only families: dense MHA / GQA, MLA, and sliding-window hybrids.

Each reader takes the (text) config behind a `ConfigReader` and the tensor-parallel size and
returns the model's `ModelLayout`. The rules, and where they come from:

- **Llama, Qwen2, Qwen3, Mistral (and their MoE variants).** Every layer full attention:
  `num_key_value_heads` (MHA configs without it: `num_attention_heads`) x `head_dim` (or
  `hidden_size / num_attention_heads`) for K and for V. Per rank `max(1, kv_heads // tp)`
  heads: SGLang's `ModelConfig.get_num_kv_heads`, which replicates heads once tp exceeds them.
  A Mistral `sliding_window` is not a hybrid layout: SGLang serves those layers from its
  full-attention pool (only the architectures in its `is_hybrid_swa` list get the SWA pool),
  and so does this reader.
- **DeepSeek-V2 / V3, Kimi-K2 (MLA).** One latent of `kv_lora_rank + qk_rope_head_dim` elements
  per token per layer, replicated on every rank (SGLang's `get_cell_size_per_token`, MLA
  branch). DeepSeek's MTP layers (`num_nextn_predict_layers`) belong to the draft model and
  are not counted, as SGLang counts only `num_hidden_layers` for the target.
- **Gemma-2, Gemma-3, GPT-OSS (SWA hybrids).** The layer kinds come from `layer_types`
  (`"sliding_attention"` / `"full_attention"`) where the config has it; otherwise Gemma-3 reads
  `sliding_window_pattern` (layer i is full iff `(i + 1) % pattern == 0`, transformers'
  Gemma-3 rule) and Gemma-2 / GPT-OSS alternate, sliding first (even layers slide:
  transformers' `is_sliding = not layer_idx % 2`). Sliding and full layers share one head
  geometry.
"""

from __future__ import annotations

from kvstrata.build.errors import InvalidModel, MissingConfigField
from kvstrata.build.hf_layout import (
    AttentionShape,
    ConfigReader,
    LatentShape,
    LayerKind,
    ModelLayout,
    per_rank_kv_heads,
)

#: `layer_types` values and the kind each one names.
LAYER_TYPE_KINDS: dict[str, LayerKind] = {
    "full_attention": "full",
    "sliding_attention": "swa",
}


def attention_shape(
    cfg: ConfigReader, tp_size: int, *, head_dim: int | None = None
) -> AttentionShape:
    """K and V of one dense attention layer on one rank (`head_dim`: the family's own field,
    when it spells it differently; None reads `head_dim` or hidden_size / heads)."""
    head_dim = cfg.head_dim() if head_dim is None else head_dim
    return AttentionShape(
        num_kv_heads=per_rank_kv_heads(cfg.kv_heads(), tp_size),
        head_dim=head_dim,
        v_head_dim=head_dim,
    )


def read_dense(cfg: ConfigReader, tp_size: int) -> ModelLayout:
    """Llama / Qwen2 / Qwen3 / Mistral: every layer full attention."""
    num_layers = cfg.integer("num_hidden_layers")
    return ModelLayout(
        architecture=cfg.architecture,
        layer_kinds=("full",) * num_layers,
        full=attention_shape(cfg, tp_size),
        swa=None,
        sliding_window=None,
        state=None,
        model_dtype=cfg.model_dtype(),
        context_len=cfg.optional_integer("max_position_embeddings"),
    )


def read_mla(cfg: ConfigReader, tp_size: int) -> ModelLayout:
    """DeepSeek-V2 / V3 and Kimi-K2: one MLA latent per token per layer, not split by tp."""
    del tp_size  # the latent is replicated on every rank
    num_layers = cfg.integer("num_hidden_layers")
    return ModelLayout(
        architecture=cfg.architecture,
        layer_kinds=("full",) * num_layers,
        full=LatentShape(
            kv_lora_rank=cfg.integer("kv_lora_rank"),
            qk_rope_head_dim=cfg.integer("qk_rope_head_dim"),
        ),
        swa=None,
        sliding_window=None,
        state=None,
        model_dtype=cfg.model_dtype(),
        context_len=cfg.optional_integer("max_position_embeddings"),
    )


def layer_kinds_from_types(cfg: ConfigReader, num_layers: int) -> tuple[LayerKind, ...]:
    """`layer_types` as kinds; an entry this module does not know is refused by name."""
    kinds: list[LayerKind] = []
    for index, value in enumerate(cfg.strings("layer_types", length=num_layers)):
        kind = LAYER_TYPE_KINDS.get(value)
        if kind is None:
            raise InvalidModel(
                f"{cfg.architecture} config field {cfg.prefix}layer_types[{index}] is "
                f"{value!r}; expected one of {', '.join(sorted(LAYER_TYPE_KINDS))}"
            )
        kinds.append(kind)
    return tuple(kinds)


def _alternating(num_layers: int) -> tuple[LayerKind, ...]:
    return tuple("swa" if i % 2 == 0 else "full" for i in range(num_layers))


def _gemma3_pattern(cfg: ConfigReader, num_layers: int) -> tuple[LayerKind, ...]:
    if not cfg.has("sliding_window_pattern"):
        raise MissingConfigField(
            f"{cfg.architecture} config has neither {cfg.prefix}layer_types nor "
            f"{cfg.prefix}sliding_window_pattern (needed to tell sliding from full layers)"
        )
    pattern = cfg.integer("sliding_window_pattern")
    return tuple("full" if (i + 1) % pattern == 0 else "swa" for i in range(num_layers))


def _read_sliding(cfg: ConfigReader, tp_size: int, *, gemma3: bool) -> ModelLayout:
    num_layers = cfg.integer("num_hidden_layers")
    if cfg.has("layer_types"):
        kinds = layer_kinds_from_types(cfg, num_layers)
    elif gemma3:
        kinds = _gemma3_pattern(cfg, num_layers)
    else:
        kinds = _alternating(num_layers)
    shape = attention_shape(cfg, tp_size)
    has_swa = "swa" in kinds
    return ModelLayout(
        architecture=cfg.architecture,
        layer_kinds=kinds,
        full=shape if "full" in kinds else None,
        swa=shape if has_swa else None,
        sliding_window=cfg.integer("sliding_window") if has_swa else None,
        state=None,
        model_dtype=cfg.model_dtype(),
        context_len=cfg.optional_integer("max_position_embeddings"),
    )


def read_gemma2(cfg: ConfigReader, tp_size: int) -> ModelLayout:
    """Gemma-2: `layer_types`, else alternation (even layers slide)."""
    return _read_sliding(cfg, tp_size, gemma3=False)


def read_gemma3(cfg: ConfigReader, tp_size: int) -> ModelLayout:
    """Gemma-3: `layer_types`, else `sliding_window_pattern` (every pattern-th layer full)."""
    return _read_sliding(cfg, tp_size, gemma3=True)


def read_gpt_oss(cfg: ConfigReader, tp_size: int) -> ModelLayout:
    """GPT-OSS: `layer_types`, else alternation (even layers slide)."""
    return _read_sliding(cfg, tp_size, gemma3=False)
