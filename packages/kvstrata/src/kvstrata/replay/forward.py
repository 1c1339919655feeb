"""The replay's stand-in for a model forward: real pool writes of values that say what they are.

An engine's forward fills the KV of the tokens it computes (and advances Mamba states). The
replay writes values derived from the tokens instead, so that a later hit can be checked:

    K of token i, every attention layer       token id of i
    V of token i, attention layer l           i * num_layers + l
    Mamba layer l, state after p tokens       conv: the last conv_kernel - 1 token ids before p
                                              (0 where the prompt is shorter), plus l;
                                              SSM: p, plus l

An MLA layer keeps one latent row per token: the token id fills its `kv_lora_rank` part (the
"K" above) and the V value its rotary part.

All of these are small integers, exact in float32 (token ids below 2**24), so `verify_hit` can
compare with `torch.equal`. A cached prefix holds exactly what its tokens wrote, wherever the
tree put it: a slot handed out for the wrong tokens reads back other values.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch

from kvstrata.build import MemorySystem
from kvstrata.pool import MLAKVPool
from kvstrata.replay.errors import KVMismatch, ReplayOptionError

_EXACT_DTYPES = (torch.float32, torch.float64)


class StandInForward:
    """Writes and checks the KV and Mamba state of `system` (see the module docstring).

    Holds no state besides the layer layout it looks up once; every method mutates only the
    pool rows it names.
    """

    def __init__(self, system: MemorySystem) -> None:
        self.system = system
        layers = system.layers
        self._attention_layers = system.attention_layer_ids
        self._mamba_layers = system.mamba_layer_ids
        self._num_layers = len(layers.layer_ids)
        # [heads, dim] of K and V per attention layer, looked up once: writes run per request.
        # An MLA layer's "K" is the latent and its "V" the rotary key (`MLAKVPool.set_kv`).
        pool = system.kv_pool
        self._latent_rank = pool.spec.kv_lora_rank if isinstance(pool, MLAKVPool) else None
        self._kv_shapes = {
            layer_id: (
                tuple(layers.get_key_buffer(layer_id).shape[1:]),
                tuple(layers.get_value_buffer(layer_id).shape[1:]),
            )
            for layer_id in self._attention_layers
        }
        if isinstance(pool, MLAKVPool):
            rank, rope = pool.spec.kv_lora_rank, pool.spec.qk_rope_head_dim
            self._kv_shapes = {layer_id: ((1, rank), (1, rope)) for layer_id in self._kv_shapes}
        self._mamba_locals = {
            layer_id: layers.route(layer_id).local_layer_id for layer_id in self._mamba_layers
        }

    def check_exact(self) -> None:
        """Raise ReplayOptionError unless every buffer holds the written values exactly
        (float32 or float64): what `verify_hit` needs."""
        layers = self.system.layers
        for layer_id in self._attention_layers:
            dtype = layers.get_key_buffer(layer_id).dtype
            if dtype not in _EXACT_DTYPES:
                raise ReplayOptionError(
                    f"verify needs float32 or float64 KV to read token ids back exactly; layer "
                    f"{layer_id} is {dtype}"
                )
        pool = self.system.mamba_pool
        if pool is not None and (
            pool.spec.conv_dtype not in _EXACT_DTYPES or pool.spec.ssm_dtype not in _EXACT_DTYPES
        ):
            raise ReplayOptionError("verify needs float32 or float64 Mamba state")

    def write_kv(self, tokens: npt.NDArray[np.int64], start: int, loc: torch.Tensor) -> None:
        """Write K and V of `tokens[start:start + len(loc)]` at full slots `loc` in every
        attention layer (SWA layers translate the slots). Mutates those rows only."""
        new = int(loc.numel())
        if new == 0:
            return
        layers = self.system.layers
        device = self.system.device
        # astype copies: the prompt array is read-only, and torch wants writable memory.
        ids = torch.from_numpy(tokens[start : start + new].astype(np.float32)).to(device)
        positions = torch.arange(start, start + new, device=device, dtype=torch.float32)
        for layer_id in self._attention_layers:
            k_shape, v_shape = self._kv_shapes[layer_id]
            k = ids.view(new, 1, 1).expand(new, *k_shape)
            v = (positions * self._num_layers + layer_id).view(new, 1, 1).expand(new, *v_shape)
            layers.set_kv(layer_id, loc, k, v)

    def write_state(self, tokens: npt.NDArray[np.int64], position: int, slot: torch.Tensor) -> None:
        """Write every Mamba layer's state after `tokens[:position]` into state `slot`."""
        pool = self.system.mamba_pool
        assert pool is not None, "a Mamba state slot without a Mamba pool"
        conv, ssm = self._state(tokens, position)
        for layer_id, local in self._mamba_locals.items():
            pool.set_state(local, slot, conv=conv + layer_id, ssm=ssm + layer_id)

    def verify_hit(
        self,
        tokens: npt.NDArray[np.int64],
        hit: int,
        slots: torch.Tensor,
        state_slot: torch.Tensor | None,
        *,
        request_index: int,
    ) -> None:
        """Check that full slots `slots` hold the KV of `tokens[:hit]` (for a sliding-window
        layer only the last window, the part that must be live) and that `state_slot` holds
        the Mamba state after `hit` tokens. Raises KVMismatch; mutates nothing."""
        if not hit:
            return
        layers = self.system.layers
        device = self.system.device
        ids = torch.from_numpy(tokens[:hit].astype(np.float32)).to(device)
        positions = torch.arange(hit, device=device, dtype=torch.float32)
        for layer_id in self._attention_layers:
            first = self._live_from(layer_id, hit)
            loc = layers.layer_loc(layer_id, slots[first:])
            k = layers.get_key_buffer(layer_id)[loc].float()
            if self._latent_rank is not None:
                k, v = k[..., : self._latent_rank], k[..., self._latent_rank :]
            else:
                v = layers.get_value_buffer(layer_id)[loc].float()
            want_v = positions[first:] * self._num_layers + layer_id
            if not (
                torch.equal(k, ids[first:].view(-1, 1, 1).expand_as(k))
                and torch.equal(v, want_v.view(-1, 1, 1).expand_as(v))
            ):
                raise KVMismatch(
                    f"request {request_index}: layer {layer_id} holds other KV than tokens "
                    f"{first}..{hit - 1} of this prompt"
                )
        if state_slot is None:
            return
        conv, ssm = self._state(tokens, hit)
        for layer_id in self._mamba_layers:
            state = layers.mamba_state(layer_id)
            if not (
                torch.equal(state.conv[state_slot].float(), conv + layer_id)
                and torch.equal(state.ssm[state_slot].float(), ssm + layer_id)
            ):
                raise KVMismatch(
                    f"request {request_index}: Mamba layer {layer_id} state copied for the hit "
                    f"is not the state after {hit} tokens of this prompt"
                )

    def _state(
        self, tokens: npt.NDArray[np.int64], position: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Conv `[1, conv_dim, k-1]` and SSM `[1, heads, dim, state]` after `position` tokens
        (layer offset 0)."""
        pool = self.system.mamba_pool
        assert pool is not None, "Mamba state without a Mamba pool"
        spec = pool.spec
        width = spec.conv_kernel - 1
        window = np.zeros(width, dtype=np.float32)
        tail = tokens[max(0, position - width) : position]
        if tail.size:
            window[width - tail.size :] = tail
        device = self.system.device
        conv = torch.from_numpy(window).to(device).view(1, 1, width).expand(1, spec.conv_dim, width)
        ssm = torch.full((1, *spec.ssm_shape), float(position), device=device)
        return conv, ssm

    def _live_from(self, layer_id: int, hit: int) -> int:
        """First hit position whose KV must be live in `layer_id`: 0 for full attention; the
        start of the last window for a sliding-window layer (older SWA slots may be gone)."""
        window = self.system.sliding_window
        if window is None or self.system.layers.route(layer_id).member != "swa":
            return 0
        return max(0, hit - window)
