"""MambaPool: per request slot, the conv and SSM state of every Mamba layer.

Memory: two stacks, each with its own dtype,

    conv_state  [L, size + 1, conv_dim, conv_kernel - 1]
    ssm_state   [L, size + 1, num_heads, head_dim, state_size]

indexed by state slot (one per running request; slot 0 is the padding slot). A "page" is one
slot (page_size 1). `layer_buffers()`, and so the flat page, interleave the two per layer:

    | conv(0) | ssm(0) | conv(1) | ssm(1) | ... | conv(L-1) | ssm(L-1) |

so layer l is buffers (2l, 2l + 1). Layer ids are local (0 .. L-1); a router maps model layers.
`copy(src, dst)` duplicates states for copy-on-write prefix sharing: a request that forks a
cached prefix gets its own slot holding a copy, and mutating it leaves the cached state alone.
"""

from __future__ import annotations

import torch

from kvstrata.pool.base import DevicePool, check_distinct, check_index_range, check_index_tensor
from kvstrata.pool.dtypes import store_dtype, to_logical, to_store
from kvstrata.pool.errors import BufferMismatch, InvalidArgument, LayerOutOfRange
from kvstrata.pool.page_io import BufferStack, empty_stack
from kvstrata.pool.spec import MambaSpec


class MambaPool(DevicePool):
    """Conv and SSM states of `spec.num_layers` layers for `size` request slots (+ slot 0).

    `dtype` / `store_dtype` are the SSM state's; the conv state's are `conv_dtype` /
    `conv_store_dtype`. Page I/O moves bytes, so it serves both. States are zeroed at
    construction. Every slot argument is validated (integer, in range, not slot 0) before
    anything changes; on CUDA that reads the slots back (one sync per call).
    """

    def __init__(self, spec: MambaSpec, size: int, device: torch.device | str = "cpu") -> None:
        super().__init__(size=size, page_size=1, device=device, dtype=spec.ssm_dtype)
        self._spec = spec
        self.conv_dtype = spec.conv_dtype
        self.conv_store_dtype = store_dtype(spec.conv_dtype)
        layers = spec.num_layers
        self._conv = empty_stack(
            layers, self.num_rows, spec.conv_shape, dtype=self.conv_store_dtype, device=self.device
        )
        self._ssm = empty_stack(
            layers, self.num_rows, spec.ssm_shape, dtype=self.store_dtype, device=self.device
        )
        conv_bytes, ssm_bytes = spec.conv_bytes_per_slot, spec.ssm_bytes_per_slot
        stride = conv_bytes + ssm_bytes
        self._bind_stacks(
            [
                BufferStack(tensor=self._conv, page_offset=0, page_stride=stride),
                BufferStack(tensor=self._ssm, page_offset=conv_bytes, page_stride=stride),
            ]
        )
        self._conv_view = to_logical(self._conv, spec.conv_dtype)
        self._ssm_view = to_logical(self._ssm, spec.ssm_dtype)

    @property
    def spec(self) -> MambaSpec:
        return self._spec

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one state slot, all layers."""
        return self._spec.bytes_per_token

    @property
    def conv_state(self) -> torch.Tensor:
        """`[L, num_rows, conv_dim, conv_kernel - 1]` in conv_dtype (fp8 viewed back). A view:
        `conv_state[l]` is layer l's slot-indexed state; writes through it change the pool."""
        return self._conv_view

    @property
    def ssm_state(self) -> torch.Tensor:
        """`[L, num_rows, num_heads, head_dim, state_size]` in ssm_dtype (a view)."""
        return self._ssm_view

    def _layer(self, layer_id: int) -> int:
        if not 0 <= layer_id < self._spec.num_layers:
            raise LayerOutOfRange(
                f"mamba layer {layer_id} is not in 0..{self._spec.num_layers - 1}"
            )
        return layer_id

    def _slots(self, slots: torch.Tensor, what: str) -> torch.Tensor:
        ids = check_index_tensor(slots, what=what)
        check_index_range(ids, limit=self.num_rows, what=what, allow_zero=False)
        return ids.to(device=self.device, dtype=torch.int64)

    def set_state(
        self,
        layer_id: int,
        slots: torch.Tensor,
        *,
        conv: torch.Tensor | None = None,
        ssm: torch.Tensor | None = None,
    ) -> None:
        """Write layer `layer_id`'s conv and/or SSM state of `slots` (`[n, conv_dim, k-1]`,
        `[n, heads, head_dim, state]`, any float dtype, cast). Mutates those rows only; slots
        should be distinct (duplicate targets have no defined winner)."""
        layer = self._layer(layer_id)
        ids = self._slots(slots, "slots")
        n = ids.numel()
        # Every value checked and cast before the first write: a refused call changes nothing.
        cast = [
            (stack, to_store(self._state_values(x, n, shape, what), dtype))
            for stack, x, shape, what, dtype in (
                (self._conv, conv, self._spec.conv_shape, "conv", self.conv_dtype),
                (self._ssm, ssm, self._spec.ssm_shape, "ssm", self.dtype),
            )
            if x is not None
        ]
        for stack, values in cast:
            stack[layer][ids] = values

    def copy(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Copy every layer's conv and SSM state of `src_slots[i]` into `dst_slots[i]`.

        Mutates the dst slots only. `dst_slots` must be distinct (DuplicateIndex); sources may
        repeat (one cached state forked to several requests). The sources are read before any
        destination is written, so overlapping lists copy the old states. Afterwards the two
        slots are independent: writing one never changes the other.
        """
        src = self._slots(src_slots, "src_slots")
        dst = self._slots(dst_slots, "dst_slots")
        if src.numel() != dst.numel():
            raise InvalidArgument(f"{src.numel()} source slots for {dst.numel()} destination slots")
        check_distinct(dst, what="dst_slots")
        if not dst.numel():
            return
        # Advanced indexing on the right-hand side gathers into a new tensor first.
        self._conv[:, dst] = self._conv[:, src]
        self._ssm[:, dst] = self._ssm[:, src]

    def clear(self, slots: torch.Tensor) -> None:
        """Zero every layer's conv and SSM state of `slots` (a request starting from no
        prefix). Mutates those slots only; repeats are harmless."""
        ids = self._slots(slots, "slots")
        if not ids.numel():
            return
        self._conv[:, ids] = 0
        self._ssm[:, ids] = 0

    def _state_values(
        self, x: torch.Tensor, n: int, shape: tuple[int, ...], what: str
    ) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != (n, *shape):
            got = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise BufferMismatch(f"{what} must be {[n, *shape]}, got {got}")
        if x.device != self.device:
            raise BufferMismatch(f"{what} is on {x.device}, the pool on {self.device}")
        return x
