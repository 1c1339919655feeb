"""What a model's cache looks like, read off a Hugging Face `config.json`: the layer kinds and
the per-rank shapes, before any dtype is chosen.

The family readers (`hf_attention`, `hf_hybrid`) turn a config dict into a `ModelLayout`;
`ModelMemorySpec` then prices it in bytes for a KV dtype and a Mamba SSM dtype. Keeping shapes
and dtypes apart is what lets one layout answer for `bfloat16`, `fp8_e4m3` or any other choice.

`ConfigReader` is the one place a field is looked up, so every missing or mistyped field is the
same clear error: `MissingConfigField` naming the field (with its `text_config.` prefix when the
model nests one) and the architecture.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from kvstrata.build.errors import InvalidModel, MissingConfigField

#: What one layer keeps per request. "full+mamba" is Falcon-H1's parallel hybrid block (an
#: attention and a Mamba-2 mixer side by side); "none" a layer without any cache (Nemotron-H's
#: MLP and MoE layers).
LayerKind = Literal["full", "swa", "mamba", "full+mamba", "none"]

#: Layer kinds that hold full-attention KV / recurrent state.
FULL_KINDS: frozenset[str] = frozenset({"full", "full+mamba"})
MAMBA_KINDS: frozenset[str] = frozenset({"mamba", "full+mamba"})


@dataclass(frozen=True, kw_only=True)
class AttentionShape:
    """K and V of one attention layer on one rank: `num_kv_heads` x (`head_dim` + `v_head_dim`)
    elements per token."""

    num_kv_heads: int
    head_dim: int
    v_head_dim: int

    @property
    def elements_per_token(self) -> int:
        return self.num_kv_heads * (self.head_dim + self.v_head_dim)


@dataclass(frozen=True, kw_only=True)
class LatentShape:
    """The MLA latent of one layer: `kv_lora_rank + qk_rope_head_dim` elements per token,
    replicated on every tensor-parallel rank (it has no head dimension to split)."""

    kv_lora_rank: int
    qk_rope_head_dim: int

    @property
    def elements_per_token(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True, kw_only=True)
class StateShape:
    """The recurrent state of one Mamba / linear-attention layer on one rank: a conv state
    (kept in the model's dtype) and an SSM ("temporal") state (kept in `mamba_ssm_dtype`)."""

    conv: tuple[int, ...]
    ssm: tuple[int, ...]

    @property
    def conv_elements(self) -> int:
        return _product(self.conv)

    @property
    def ssm_elements(self) -> int:
        return _product(self.ssm)


@dataclass(frozen=True, kw_only=True)
class ModelLayout:
    """Layer kinds and per-rank cache shapes of one model, dtype-free.

    `full` prices a full-attention layer, `swa` a sliding-window one (None without any), `state`
    a Mamba layer (None without any). `model_dtype` is the config's `torch_dtype` / `dtype`
    (None when it gives none: then the caller must name a KV dtype, and a model with Mamba
    layers cannot be priced). `context_len`: `max_position_embeddings`, if given.
    """

    architecture: str
    layer_kinds: tuple[LayerKind, ...]
    full: AttentionShape | LatentShape | None
    swa: AttentionShape | None
    sliding_window: int | None
    state: StateShape | None
    model_dtype: str | None
    context_len: int | None

    def __post_init__(self) -> None:
        kinds = set(self.layer_kinds)
        assert (self.full is not None) == bool(kinds & FULL_KINDS), (
            f"{self.architecture}: full-attention shape iff a full layer (reader bug)"
        )
        assert (self.swa is not None) == ("swa" in kinds) == (self.sliding_window is not None), (
            f"{self.architecture}: SWA shape and window iff an swa layer (reader bug)"
        )
        assert (self.state is not None) == bool(kinds & MAMBA_KINDS), (
            f"{self.architecture}: state shape iff a Mamba layer (reader bug)"
        )


class ConfigReader:
    """Typed field access on one (text) config dict; every failure names the field.

    `prefix` is how the fields are reached from the file's top level (`"text_config."` for a
    nested text model), so the message points at the line to fix.
    """

    def __init__(
        self, config: Mapping[str, object], *, architecture: str, prefix: str = ""
    ) -> None:
        self.config = config
        self.architecture = architecture
        self.prefix = prefix

    def has(self, name: str) -> bool:
        return self.config.get(name) is not None

    def _missing(self, name: str) -> MissingConfigField:
        return MissingConfigField(
            f"{self.architecture} config has no {self.prefix}{name!s} (needed to size its cache)"
        )

    def integer(self, name: str, *, minimum: int = 1) -> int:
        value = self.config.get(name)
        if value is None:
            raise self._missing(name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidModel(
                f"{self.architecture} config field {self.prefix}{name} must be an integer, "
                f"got {value!r}"
            )
        if value < minimum:
            raise InvalidModel(
                f"{self.architecture} config field {self.prefix}{name} must be >= {minimum}, "
                f"got {value}"
            )
        return value

    def optional_integer(self, name: str, *, minimum: int = 1) -> int | None:
        return self.integer(name, minimum=minimum) if self.has(name) else None

    def first_integer(self, *names: str) -> int:
        """The first of `names` the config gives (spellings differ between families)."""
        for name in names:
            if self.has(name):
                return self.integer(name)
        raise MissingConfigField(
            f"{self.architecture} config has none of "
            f"{', '.join(self.prefix + n for n in names)} (needed to size its cache)"
        )

    def string(self, name: str) -> str:
        value = self.config.get(name)
        if value is None:
            raise self._missing(name)
        if not isinstance(value, str):
            raise InvalidModel(
                f"{self.architecture} config field {self.prefix}{name} must be a string, "
                f"got {value!r}"
            )
        return value

    def strings(self, name: str, *, length: int) -> list[str]:
        """A list of `length` strings (`layer_types`: one entry per hidden layer)."""
        value = self.config.get(name)
        if value is None:
            raise self._missing(name)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise InvalidModel(
                f"{self.architecture} config field {self.prefix}{name} must be a list of "
                f"strings, got {value!r}"
            )
        items: list[str] = [v for v in value]
        if len(items) != length:
            raise InvalidModel(
                f"{self.architecture} config field {self.prefix}{name} has {len(items)} "
                f"entries, but num_hidden_layers is {length}"
            )
        return items

    def head_dim(self) -> int:
        """`head_dim` where the config gives it, else `hidden_size / num_attention_heads`."""
        if self.has("head_dim"):
            return self.integer("head_dim")
        hidden = self.integer("hidden_size")
        heads = self.integer("num_attention_heads")
        if hidden % heads:
            raise InvalidModel(
                f"{self.architecture} config gives no {self.prefix}head_dim and hidden_size "
                f"{hidden} is not a multiple of num_attention_heads {heads}"
            )
        return hidden // heads

    def kv_heads(self) -> int:
        """`num_key_value_heads`, or `num_attention_heads` for plain MHA configs without it."""
        if self.has("num_key_value_heads"):
            return self.integer("num_key_value_heads")
        return self.integer("num_attention_heads")

    def model_dtype(self) -> str | None:
        for name in ("torch_dtype", "dtype"):
            value = self.config.get(name)
            if isinstance(value, str):
                return value
        return None


def per_rank_kv_heads(num_kv_heads: int, tp_size: int) -> int:
    """KV heads on one rank: SGLang's `ModelConfig.get_num_kv_heads`, max(1, heads // tp).
    Past `tp_size == num_kv_heads` the heads are replicated, not split further."""
    return max(1, num_kv_heads // tp_size)


def split(value: int, tp_size: int, *, what: str, architecture: str) -> int:
    """`value / tp_size`, refusing a remainder (SGLang's `divide` asserts the same)."""
    if value % tp_size:
        raise InvalidModel(f"{architecture}: {what} {value} is not divisible by tp_size {tp_size}")
    return value // tp_size


def _product(shape: tuple[int, ...]) -> int:
    total = 1
    for dim in shape:
        total *= dim
    return total
