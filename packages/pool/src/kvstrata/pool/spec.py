"""Frozen specs, one per family, from which pools are built.

A spec says what one token (or, for Mamba, one request slot) of the pool holds; the pool adds
how many there are (`size`), the page size and the device. Every spec validates itself on
construction (InvalidSpec / UnsupportedDtype), so a pool never sees a bad one.

Sizes, for a pool with page size P:

    bytes_per_token          all layers of the pool, one token (Mamba: one state slot)
    page_size_bytes(P)       bytes_per_token * P: one flat page as read_pages / write_pages move it
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvstrata.pool.dtypes import check_dtype, itemsize, store_dtype
from kvstrata.pool.errors import InvalidSpec


def _positive(**fields: int) -> None:
    for name, value in fields.items():
        if not isinstance(value, int) or value <= 0:
            raise InvalidSpec(f"{name} must be a positive int, got {value!r}")


def _check_start_layer(start_layer: int) -> None:
    if not isinstance(start_layer, int) or start_layer < 0:
        raise InvalidSpec(f"start_layer must be a non-negative int, got {start_layer!r}")


def _check_page_size(page_size: int) -> None:
    if not isinstance(page_size, int) or page_size <= 0:
        raise InvalidSpec(f"page_size must be a positive int, got {page_size!r}")


class _AttentionSpec:
    """What the attention specs share (their fields are the dataclass subclasses' own): a range
    of global layers, a stored dtype, and pages of `bytes_per_token`."""

    num_layers: int
    start_layer: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        raise NotImplementedError

    @property
    def store_dtype(self) -> torch.dtype:
        return store_dtype(self.dtype)

    @property
    def layer_ids(self) -> range:
        """Global ids of the layers this spec describes."""
        return range(self.start_layer, self.start_layer + self.num_layers)

    def page_size_bytes(self, page_size: int) -> int:
        _check_page_size(page_size)
        return self.bytes_per_token * page_size


@dataclass(frozen=True, kw_only=True)
class MHASpec(_AttentionSpec):
    """Multi-head (or grouped-query) attention: per layer K `[heads, head_dim]` and V
    `[heads, v_head_dim]` per token. The pool holds global layers
    `start_layer .. start_layer + num_layers - 1` (a pipeline stage holds a range)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int | None = None
    dtype: torch.dtype = torch.bfloat16
    start_layer: int = 0

    def __post_init__(self) -> None:
        _positive(
            num_layers=self.num_layers, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim
        )
        if self.v_head_dim is not None:
            _positive(v_head_dim=self.v_head_dim)
        _check_start_layer(self.start_layer)
        check_dtype(self.dtype)

    @property
    def value_head_dim(self) -> int:
        """v_head_dim, or head_dim when V has the width of K."""
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    @property
    def key_bytes_per_token(self) -> int:
        """Bytes of one token of one layer's K buffer."""
        return self.num_kv_heads * self.head_dim * itemsize(self.dtype)

    @property
    def value_bytes_per_token(self) -> int:
        """Bytes of one token of one layer's V buffer."""
        return self.num_kv_heads * self.value_head_dim * itemsize(self.dtype)

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * (self.key_bytes_per_token + self.value_bytes_per_token)


@dataclass(frozen=True, kw_only=True)
class MLASpec(_AttentionSpec):
    """Multi-head latent attention: per layer one `[1, kv_lora_rank + qk_rope_head_dim]` row
    per token; V is the first `kv_lora_rank` columns of it."""

    num_layers: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    dtype: torch.dtype = torch.bfloat16
    start_layer: int = 0

    def __post_init__(self) -> None:
        _positive(
            num_layers=self.num_layers,
            kv_lora_rank=self.kv_lora_rank,
            qk_rope_head_dim=self.qk_rope_head_dim,
        )
        _check_start_layer(self.start_layer)
        check_dtype(self.dtype)

    @property
    def kv_dim(self) -> int:
        """Width of one latent row: kv_lora_rank + qk_rope_head_dim."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * self.kv_dim * itemsize(self.dtype)


@dataclass(frozen=True, kw_only=True)
class SWASpec:
    """Interleaved full and sliding-window attention. `full` and `swa` describe the two
    sub-pools by their *local* layers (both must have start_layer 0); `full_layer_ids[i]` is
    the global (model) id of the full pool's layer i, likewise `swa_layer_ids`. Layer-id
    sequences are stored as tuples."""

    full: MHASpec
    swa: MHASpec
    full_layer_ids: tuple[int, ...]
    swa_layer_ids: tuple[int, ...]
    sliding_window: int

    def __post_init__(self) -> None:
        # Frozen: normalise the id sequences in place so equal specs compare and hash equal.
        object.__setattr__(self, "full_layer_ids", _layer_tuple(self.full_layer_ids, "full"))
        object.__setattr__(self, "swa_layer_ids", _layer_tuple(self.swa_layer_ids, "swa"))
        _positive(sliding_window=self.sliding_window)
        for name, sub, ids in (
            ("full", self.full, self.full_layer_ids),
            ("swa", self.swa, self.swa_layer_ids),
        ):
            if sub.start_layer != 0:
                raise InvalidSpec(
                    f"{name}.start_layer must be 0: SWA sub-pools use local layer ids, "
                    f"mapped to global ones by {name}_layer_ids"
                )
            if len(ids) != sub.num_layers:
                raise InvalidSpec(
                    f"{len(ids)} {name}_layer_ids for a {name} spec of {sub.num_layers} layers"
                )
        overlap = set(self.full_layer_ids) & set(self.swa_layer_ids)
        if overlap:
            raise InvalidSpec(f"layers {sorted(overlap)} are both full and sliding-window")

    @property
    def layer_ids(self) -> tuple[int, ...]:
        """Every global layer id of the model, ascending."""
        return tuple(sorted((*self.full_layer_ids, *self.swa_layer_ids)))

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token that holds both a full and an SWA slot (all layers)."""
        return self.full.bytes_per_token + self.swa.bytes_per_token

    def page_size_bytes(self, page_size: int) -> int:
        _check_page_size(page_size)
        return self.bytes_per_token * page_size


def _layer_tuple(ids: Sequence[int], name: str) -> tuple[int, ...]:
    out = tuple(ids)
    if any(not isinstance(i, int) or i < 0 for i in out):
        raise InvalidSpec(f"{name}_layer_ids must be non-negative ints, got {out!r}")
    if len(set(out)) != len(out):
        raise InvalidSpec(f"{name}_layer_ids has duplicates: {out!r}")
    return out


@dataclass(frozen=True, kw_only=True)
class MambaSpec:
    """Mamba (SSM) layers: per request slot and layer a conv state `[conv_dim, conv_kernel-1]`
    and an SSM state `[num_heads, head_dim, state_size]`, each with its own dtype. Layers are
    local ids 0..num_layers-1 (a router maps model layers onto them)."""

    num_layers: int
    conv_dim: int
    conv_kernel: int
    num_heads: int
    head_dim: int
    state_size: int
    conv_dtype: torch.dtype = torch.bfloat16
    ssm_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        _positive(
            num_layers=self.num_layers,
            conv_dim=self.conv_dim,
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            state_size=self.state_size,
        )
        if not isinstance(self.conv_kernel, int) or self.conv_kernel < 2:
            raise InvalidSpec(f"conv_kernel must be an int >= 2, got {self.conv_kernel!r}")
        check_dtype(self.conv_dtype, what="conv_dtype")
        check_dtype(self.ssm_dtype, what="ssm_dtype")

    @property
    def conv_shape(self) -> tuple[int, int]:
        """Conv state of one slot of one layer."""
        return (self.conv_dim, self.conv_kernel - 1)

    @property
    def ssm_shape(self) -> tuple[int, int, int]:
        """SSM state of one slot of one layer."""
        return (self.num_heads, self.head_dim, self.state_size)

    @property
    def conv_bytes_per_slot(self) -> int:
        return self.conv_dim * (self.conv_kernel - 1) * itemsize(self.conv_dtype)

    @property
    def ssm_bytes_per_slot(self) -> int:
        return self.num_heads * self.head_dim * self.state_size * itemsize(self.ssm_dtype)

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one state slot, all layers (a Mamba "token" is a request's slot)."""
        return self.num_layers * (self.conv_bytes_per_slot + self.ssm_bytes_per_slot)

    def page_size_bytes(self, page_size: int = 1) -> int:
        _check_page_size(page_size)
        return self.bytes_per_token * page_size
