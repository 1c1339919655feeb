"""`ModelMemorySpec`: the bytes a model's cache takes on one tensor-parallel rank.

    config.json ──> hf_config.read_layout ──> ModelLayout (layer kinds, per-rank shapes)
                                                  │  x KV dtype, SSM dtype, conv dtype
                                                  v
                                           ModelMemorySpec (bytes per token / per request)

The figures (all per rank):

- `full_kv_bytes_per_token`: K and V (or the MLA latent) of every full-attention layer, summed;
- `swa_kv_bytes_per_token`, `sliding_window`: the same for sliding-window layers (0 / None
  without any);
- `state_bytes_per_request`: conv state (model dtype) + SSM state (`mamba_ssm_dtype`) of every
  Mamba / linear-attention layer, summed: SGLang's `mamba_cache_per_req` with its defaults
  (SSM state float32, conv state in the model's dtype);
- `layer_kinds`: per hidden layer `"full"`, `"swa"`, `"mamba"`, `"full+mamba"` (Falcon-H1: both
  in one layer) or `"none"` (Nemotron-H's MLP / MoE layers, which keep nothing).

KV dtypes: `None` / `"auto"` (the config's `torch_dtype`), `"bfloat16"`, `"float16"`,
`"float32"`, `"fp8_e4m3"`, `"fp8_e5m2"` (one byte an element, SGLang's `--kv-cache-dtype`
names). No scale buffers: fp8 KV in SGLang keeps per-tensor scales, not per-token bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from kvstrata.build.errors import InvalidModel, MissingConfigField
from kvstrata.build.hf_config import read_layout
from kvstrata.build.hf_layout import FULL_KINDS, MAMBA_KINDS, LatentShape, LayerKind, ModelLayout

#: Bytes per element of the dtypes a config's `torch_dtype` names.
MODEL_DTYPE_BYTES: Mapping[str, int] = MappingProxyType({"bfloat16": 2, "float16": 2, "float32": 4})
#: Bytes per element of each KV cache dtype (besides "auto": the model's dtype).
KV_DTYPE_BYTES: Mapping[str, int] = MappingProxyType(
    {**MODEL_DTYPE_BYTES, "fp8_e4m3": 1, "fp8_e5m2": 1}
)
#: SSM state dtypes (SGLang's `--mamba-ssm-dtype` choices, float16 besides).
SSM_DTYPE_BYTES: Mapping[str, int] = MappingProxyType(dict(MODEL_DTYPE_BYTES))


@dataclass(frozen=True, kw_only=True)
class ModelMemorySpec:
    """The cache of one model on one tensor-parallel rank, in bytes. Build it with
    `ModelMemorySpec.from_hf_config(config)`; the fields are described in the module
    docstring. `layout` keeps the shapes (heads, head dims, state shapes) the pools need."""

    architecture: str
    layout: ModelLayout
    tp_size: int
    kv_dtype: str
    mamba_ssm_dtype: str
    conv_dtype: str | None
    full_kv_bytes_per_token: int
    swa_kv_bytes_per_token: int
    sliding_window: int | None
    state_bytes_per_request: int
    context_len: int | None

    @classmethod
    def from_hf_config(
        cls,
        config: Mapping[str, object],
        *,
        kv_dtype: str | None = None,
        mamba_ssm_dtype: str = "float32",
        tp_size: int = 1,
    ) -> ModelMemorySpec:
        """Price the cache of the model `config` (a parsed `config.json`, `text_config`
        nesting included) on one of `tp_size` ranks.

        Raises UnknownArchitecture, MissingConfigField (naming the field), InvalidModel (an
        unknown dtype, a field of the wrong type, a tp_size that does not divide the state)."""
        if not isinstance(config, Mapping):
            raise InvalidModel(
                f"config must be a dict (a parsed config.json), got {type(config).__name__}"
            )
        _check_dtypes(kv_dtype, mamba_ssm_dtype)
        layout = read_layout(config, tp_size=tp_size)
        return cls.from_layout(
            layout, kv_dtype=kv_dtype, mamba_ssm_dtype=mamba_ssm_dtype, tp_size=tp_size
        )

    @classmethod
    def from_layout(
        cls,
        layout: ModelLayout,
        *,
        kv_dtype: str | None,
        mamba_ssm_dtype: str,
        tp_size: int,
    ) -> ModelMemorySpec:
        """Price an already-read layout (InvalidModel for an unknown dtype, or a model dtype
        the layout needs and lacks)."""
        _check_dtypes(kv_dtype, mamba_ssm_dtype)
        resolved_kv = _resolve_kv_dtype(layout, kv_dtype)
        kv_bytes = KV_DTYPE_BYTES[resolved_kv]
        kinds = layout.layer_kinds
        num_full = sum(kind in FULL_KINDS for kind in kinds)
        num_swa = sum(kind == "swa" for kind in kinds)
        num_mamba = sum(kind in MAMBA_KINDS for kind in kinds)
        full = 0 if layout.full is None else layout.full.elements_per_token * kv_bytes * num_full
        swa = 0 if layout.swa is None else layout.swa.elements_per_token * kv_bytes * num_swa
        conv_dtype: str | None = None
        state_bytes = 0
        if layout.state is not None:
            conv_dtype = _model_dtype(layout, why="its Mamba conv state is kept in it")
            per_layer = (
                layout.state.conv_elements * MODEL_DTYPE_BYTES[conv_dtype]
                + layout.state.ssm_elements * SSM_DTYPE_BYTES[mamba_ssm_dtype]
            )
            state_bytes = per_layer * num_mamba
        return cls(
            architecture=layout.architecture,
            layout=layout,
            tp_size=tp_size,
            kv_dtype=resolved_kv,
            mamba_ssm_dtype=mamba_ssm_dtype,
            conv_dtype=conv_dtype,
            full_kv_bytes_per_token=full,
            swa_kv_bytes_per_token=swa,
            sliding_window=layout.sliding_window,
            state_bytes_per_request=state_bytes,
            context_len=layout.context_len,
        )

    # --- derived figures ------------------------------------------------------------------------

    @property
    def layer_kinds(self) -> tuple[LayerKind, ...]:
        return self.layout.layer_kinds

    @property
    def full_layer_ids(self) -> tuple[int, ...]:
        """Layers with full-attention KV (Falcon-H1's hybrid layers included)."""
        return tuple(i for i, kind in enumerate(self.layer_kinds) if kind in FULL_KINDS)

    @property
    def swa_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_kinds) if kind == "swa")

    @property
    def mamba_layer_ids(self) -> tuple[int, ...]:
        """Layers with recurrent state (Falcon-H1's hybrid layers included)."""
        return tuple(i for i, kind in enumerate(self.layer_kinds) if kind in MAMBA_KINDS)

    @property
    def is_mla(self) -> bool:
        return isinstance(self.layout.full, LatentShape)

    @property
    def kv_bytes_per_token(self) -> int:
        """Full and sliding-window KV of one token, all layers: SGLang's `cell_size`."""
        return self.full_kv_bytes_per_token + self.swa_kv_bytes_per_token

    @property
    def kv_dtype_bytes(self) -> int:
        return KV_DTYPE_BYTES[self.kv_dtype]


def _check_dtypes(kv_dtype: str | None, mamba_ssm_dtype: str) -> None:
    if kv_dtype is not None and kv_dtype != "auto" and kv_dtype not in KV_DTYPE_BYTES:
        raise InvalidModel(
            f"unknown kv_dtype {kv_dtype!r}; choose from auto, {', '.join(KV_DTYPE_BYTES)}"
        )
    if mamba_ssm_dtype not in SSM_DTYPE_BYTES:
        raise InvalidModel(
            f"unknown mamba_ssm_dtype {mamba_ssm_dtype!r}; choose from {', '.join(SSM_DTYPE_BYTES)}"
        )


def _model_dtype(layout: ModelLayout, *, why: str) -> str:
    dtype = layout.model_dtype
    if dtype is None:
        raise MissingConfigField(
            f"{layout.architecture} config has no torch_dtype (or dtype), and {why}"
        )
    if dtype not in MODEL_DTYPE_BYTES:
        raise InvalidModel(
            f"{layout.architecture} config torch_dtype {dtype!r} is not one of "
            f"{', '.join(MODEL_DTYPE_BYTES)}"
        )
    return dtype


def _resolve_kv_dtype(layout: ModelLayout, kv_dtype: str | None) -> str:
    if kv_dtype is None or kv_dtype == "auto":
        return _model_dtype(layout, why="no kv_dtype was given")
    return kv_dtype
