"""Readers of recurrent hybrids: attention layers beside Mamba / linear-attention layers.

The state shapes (per rank) follow SGLang's `mamba2_cache_params` of each family
(`python/sglang/srt/configs/{qwen3_next,nemotron_h,falcon_h1}.py`, `configs/mamba_utils.py`):

- **Qwen3-Next (gated DeltaNet).** Layer i is full attention iff `(i + 1) %
  full_attention_interval == 0` (or as `layer_types` says: `"linear_attention"` /
  `"full_attention"`). Conv state `(conv_dim / tp, linear_conv_kernel_dim - 1)` with
  `conv_dim = 2 * linear_num_key_heads * linear_key_head_dim + linear_num_value_heads *
  linear_value_head_dim`; SSM state `(linear_num_value_heads / tp, linear_key_head_dim,
  linear_value_head_dim)`. Qwen3.5 configs (`qwen3_5`, nested `text_config`) use the same rules.
- **Mamba-2 (Nemotron-H, Falcon-H1).** `intermediate = heads * head_dim`; groups that tp does
  not divide are extended to tp (SGLang's `extra_groups_for_head_shards`, only for a single
  group); conv state `((intermediate + 2 * groups * ssm_state) / tp, conv_kernel - 1)`; SSM
  state `(heads / tp, head_dim, ssm_state)`. Nemotron-H's layers come from
  `hybrid_override_pattern` (`M` Mamba-2, `*` attention, `-` MLP and `E` MoE without a cache);
  Falcon-H1 runs an attention and a Mamba-2 mixer in every layer (`"full+mamba"`), its
  intermediate size `mamba_d_ssm` (or `mamba_expand * hidden_size`).
- **Jamba (Mamba-1).** Layer i is attention iff `i % attn_layer_period == attn_layer_offset`.
  Its Mamba layers are Mamba-1 (one SSM row per channel, no heads): conv state
  `(intermediate / tp, mamba_d_conv - 1)` and SSM state `(intermediate / tp, mamba_d_state)` with
  `intermediate = mamba_expand * hidden_size` (vLLM's `mamba1_state_shape`; SGLang has no
  Jamba model).
"""

from __future__ import annotations

from kvstrata.build.errors import InvalidModel
from kvstrata.build.hf_attention import attention_shape
from kvstrata.build.hf_layout import ConfigReader, LayerKind, ModelLayout, StateShape, split

#: Qwen3-Next `layer_types` values.
LINEAR_LAYER_TYPES: dict[str, LayerKind] = {
    "linear_attention": "mamba",
    "full_attention": "full",
}
#: Nemotron-H `hybrid_override_pattern` characters.
NEMOTRON_PATTERN_KINDS: dict[str, LayerKind] = {"M": "mamba", "*": "full", "-": "none", "E": "none"}


def mamba2_state(
    cfg: ConfigReader,
    tp_size: int,
    *,
    intermediate: int,
    num_heads: int,
    head_dim: int,
    n_groups: int,
    state_size: int,
    conv_kernel: int,
) -> StateShape:
    """Per-rank conv and SSM state of one Mamba-2 layer (rules in the module docstring)."""
    if n_groups % tp_size:
        if n_groups != 1:
            raise InvalidModel(
                f"{cfg.architecture}: {n_groups} Mamba groups cannot be sharded over tp_size "
                f"{tp_size} (only a single group is replicated to every rank)"
            )
        n_groups = tp_size
    conv_dim = intermediate + 2 * n_groups * state_size
    what = f"{cfg.architecture} Mamba"
    return StateShape(
        conv=(
            split(conv_dim, tp_size, what="conv dim", architecture=what),
            conv_kernel - 1,
        ),
        ssm=(
            split(num_heads, tp_size, what="heads", architecture=what),
            head_dim,
            state_size,
        ),
    )


def read_qwen3_next(cfg: ConfigReader, tp_size: int) -> ModelLayout:
    """Qwen3-Next / Qwen3.5: gated DeltaNet layers, full attention every interval-th layer."""
    num_layers = cfg.integer("num_hidden_layers")
    if cfg.has("layer_types"):
        kinds: tuple[LayerKind, ...] = tuple(
            _kind(cfg, "layer_types", i, value, LINEAR_LAYER_TYPES)
            for i, value in enumerate(cfg.strings("layer_types", length=num_layers))
        )
    else:
        interval = cfg.integer("full_attention_interval")
        kinds = tuple("full" if (i + 1) % interval == 0 else "mamba" for i in range(num_layers))
    key_heads = cfg.integer("linear_num_key_heads")
    value_heads = cfg.integer("linear_num_value_heads")
    key_dim = cfg.integer("linear_key_head_dim")
    value_dim = cfg.integer("linear_value_head_dim")
    kernel = cfg.integer("linear_conv_kernel_dim", minimum=2)
    conv_dim = 2 * key_heads * key_dim + value_heads * value_dim
    what = f"{cfg.architecture} linear attention"
    state = StateShape(
        conv=(split(conv_dim, tp_size, what="conv dim", architecture=what), kernel - 1),
        ssm=(
            split(value_heads, tp_size, what="linear_num_value_heads", architecture=what),
            key_dim,
            value_dim,
        ),
    )
    return _hybrid_layout(cfg, tp_size, kinds, state)


def read_jamba(cfg: ConfigReader, tp_size: int) -> ModelLayout:
    """Jamba: attention every `attn_layer_period` layers from `attn_layer_offset`; Mamba-1."""
    num_layers = cfg.integer("num_hidden_layers")
    period = cfg.integer("attn_layer_period")
    offset = cfg.integer("attn_layer_offset", minimum=0)
    kinds: tuple[LayerKind, ...] = tuple(
        "full" if i % period == offset else "mamba" for i in range(num_layers)
    )
    intermediate = cfg.integer("mamba_expand") * cfg.integer("hidden_size")
    channels = split(
        intermediate, tp_size, what="Mamba intermediate size", architecture=cfg.architecture
    )
    state = StateShape(
        conv=(channels, cfg.integer("mamba_d_conv", minimum=2) - 1),
        ssm=(channels, cfg.integer("mamba_d_state")),
    )
    return _hybrid_layout(cfg, tp_size, kinds, state)


def read_nemotron_h(cfg: ConfigReader, tp_size: int) -> ModelLayout:
    """Nemotron-H: layers by `hybrid_override_pattern`; Mamba-2 state."""
    num_layers = cfg.integer("num_hidden_layers")
    pattern = cfg.string("hybrid_override_pattern")
    if len(pattern) != num_layers:
        raise InvalidModel(
            f"{cfg.architecture} config field {cfg.prefix}hybrid_override_pattern has "
            f"{len(pattern)} characters, but num_hidden_layers is {num_layers}"
        )
    kinds: tuple[LayerKind, ...] = tuple(
        _kind(cfg, "hybrid_override_pattern", i, char, NEMOTRON_PATTERN_KINDS)
        for i, char in enumerate(pattern)
    )
    num_heads = cfg.integer("mamba_num_heads")
    head_dim = cfg.integer("mamba_head_dim")
    state = mamba2_state(
        cfg,
        tp_size,
        intermediate=num_heads * head_dim,
        num_heads=num_heads,
        head_dim=head_dim,
        n_groups=cfg.first_integer("n_groups", "mamba_n_groups"),
        state_size=cfg.integer("ssm_state_size"),
        conv_kernel=cfg.integer("conv_kernel", minimum=2),
    )
    return _hybrid_layout(cfg, tp_size, kinds, state, head_dim_fields=True)


def read_falcon_h1(cfg: ConfigReader, tp_size: int) -> ModelLayout:
    """Falcon-H1: attention and a Mamba-2 mixer side by side in every layer."""
    num_layers = cfg.integer("num_hidden_layers")
    if cfg.has("mamba_d_ssm"):
        intermediate = cfg.integer("mamba_d_ssm")
    else:
        intermediate = cfg.integer("mamba_expand") * cfg.integer("hidden_size")
    num_heads = cfg.integer("mamba_n_heads")
    # "auto" (the HF default) or absent: the heads split the intermediate size evenly.
    if isinstance(cfg.config.get("mamba_d_head"), int):
        head_dim = cfg.integer("mamba_d_head")
    else:
        head_dim = intermediate // num_heads
    if head_dim * num_heads != intermediate:
        raise InvalidModel(
            f"{cfg.architecture}: mamba_n_heads {num_heads} x mamba_d_head {head_dim} != "
            f"Mamba intermediate size {intermediate}"
        )
    state = mamba2_state(
        cfg,
        tp_size,
        intermediate=intermediate,
        num_heads=num_heads,
        head_dim=head_dim,
        n_groups=cfg.integer("mamba_n_groups"),
        state_size=cfg.integer("mamba_d_state"),
        conv_kernel=cfg.integer("mamba_d_conv", minimum=2),
    )
    kinds: tuple[LayerKind, ...] = ("full+mamba",) * num_layers
    return _hybrid_layout(cfg, tp_size, kinds, state)


def _kind(
    cfg: ConfigReader, field: str, index: int, value: str, table: dict[str, LayerKind]
) -> LayerKind:
    kind = table.get(value)
    if kind is None:
        raise InvalidModel(
            f"{cfg.architecture} config field {cfg.prefix}{field}[{index}] is {value!r}; "
            f"expected one of {', '.join(sorted(table))}"
        )
    return kind


def _hybrid_layout(
    cfg: ConfigReader,
    tp_size: int,
    kinds: tuple[LayerKind, ...],
    state: StateShape,
    *,
    head_dim_fields: bool = False,
) -> ModelLayout:
    full = None
    if any(kind in ("full", "full+mamba") for kind in kinds):
        head_dim = None
        if head_dim_fields and not cfg.has("head_dim") and cfg.has("attention_head_dim"):
            head_dim = cfg.integer("attention_head_dim")  # Nemotron-H's spelling
        full = attention_shape(cfg, tp_size, head_dim=head_dim)
    has_state = any(kind in ("mamba", "full+mamba") for kind in kinds)
    return ModelLayout(
        architecture=cfg.architecture,
        layer_kinds=kinds,
        full=full,
        swa=None,
        sliding_window=None,
        state=state if has_state else None,
        model_dtype=cfg.model_dtype(),
        context_len=cfg.optional_integer("max_position_embeddings"),
    )
