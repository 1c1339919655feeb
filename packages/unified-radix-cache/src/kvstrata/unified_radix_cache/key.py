"""`RadixKey`: the token ids of a prefix and the namespace they live in.

The tree compares keys as raw int64 bytes: a node's key is the bytes of its token run, a child
is found by one dict lookup on the bytes of its first page, and a whole node is compared in one
`bytes.startswith` (a memcmp) instead of token by token. `RadixKey.token_bytes()` produces those
bytes once per key and caches them.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import NamedTuple, TypeAlias

import numpy as np
import numpy.typing as npt
import torch

from kvstrata.unified_radix_cache.errors import InvalidKey

#: What a key accepts as token ids. `array('q')` and int64 numpy arrays convert without a copy
#: of Python ints; a list pays one pass through `array`.
TokenIds: TypeAlias = Sequence[int] | array | npt.NDArray[np.integer] | torch.Tensor

TOKEN_BYTES = 8  # every token is stored as one native int64


class Namespace(NamedTuple):
    """Adapter id and cache salt: keys in different namespaces never share a node."""

    extra_key: str | None
    cache_salt: str | None


class RadixKey:
    """Token ids of a prefix plus its namespace (`extra_key`, e.g. a LoRA adapter id, and
    `cache_salt`, e.g. a tenant secret). Immutable by contract: the tree caches the token bytes,
    so do not mutate `token_ids` after building the key.
    """

    __slots__ = ("cache_salt", "cached_bytes", "extra_key", "namespace", "token_ids")

    def __init__(
        self, token_ids: TokenIds, extra_key: str | None = None, cache_salt: str | None = None
    ) -> None:
        self.token_ids = token_ids
        self.extra_key = extra_key
        self.cache_salt = cache_salt
        #: None for the default namespace (no adapter, no salt), else the pair.
        self.namespace: Namespace | None = (
            None if extra_key is None and cache_salt is None else Namespace(extra_key, cache_salt)
        )
        #: `token_bytes()` once computed (None before): lets the tree skip a call per lookup.
        #: An int64 `array` (what a trace replay builds) converts now: one copy, no checks.
        self.cached_bytes: bytes | None = (
            token_ids.tobytes() if type(token_ids) is array and token_ids.typecode == "q" else None
        )

    def __len__(self) -> int:
        data = self.cached_bytes
        if data is not None:  # the engine's key: its bytes are known (a few calls per request)
            return len(data) >> 3
        ids = self.token_ids
        if isinstance(ids, torch.Tensor):
            return int(ids.numel())
        return len(ids)

    def token_bytes(self) -> bytes:
        """The token ids as native int64 bytes (computed once, then cached).

        Raises `InvalidKey` for ids that are not a 1-D integer sequence.
        """
        data = self.cached_bytes
        if data is None:
            data = self.cached_bytes = _to_bytes(self.token_ids)
        return data

    def tokens(self) -> npt.NDArray[np.int64]:
        """The token ids as a read-only int64 numpy view of `token_bytes()`."""
        return np.frombuffer(self.token_bytes(), dtype=np.int64)

    def __getitem__(self, index: slice) -> RadixKey:
        """`key[a:b]`: the same namespace over a slice of the token ids."""
        if not isinstance(index, slice):
            raise TypeError("RadixKey supports slicing only; use key.tokens()[i] for one id")
        tokens = self.tokens()
        sliced = RadixKey(tokens[index], self.extra_key, self.cache_salt)
        start, stop, step = index.indices(len(tokens))
        data = self.cached_bytes
        if step == 1 and data is not None:
            # A contiguous slice: its bytes are a slice of ours (no conversion when walked).
            sliced.cached_bytes = data[start * TOKEN_BYTES : max(stop, start) * TOKEN_BYTES]
        return sliced

    def __repr__(self) -> str:
        ids = self.tokens()
        shown = ", ".join(str(int(t)) for t in ids[:8]) + (", ..." if len(ids) > 8 else "")
        ns = f", namespace={tuple(self.namespace)}" if self.namespace is not None else ""
        return f"RadixKey([{shown}] ({len(ids)} tokens){ns})"


def _to_bytes(ids: TokenIds) -> bytes:
    if isinstance(ids, array):
        if ids.typecode == "q":
            return ids.tobytes()
        return np.asarray(ids, dtype=np.int64).tobytes()
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1 or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise InvalidKey(
                f"token ids must be a 1-D integer tensor, got {ids.dtype} {tuple(ids.shape)}"
            )
        return ids.detach().to(device="cpu", dtype=torch.int64).contiguous().numpy().tobytes()
    if isinstance(ids, np.ndarray):
        arr: npt.NDArray[np.generic] = ids
    else:
        try:
            return array("q", ids).tobytes()
        except (TypeError, OverflowError):
            arr = np.asarray(ids)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise InvalidKey(f"token ids must be a 1-D integer sequence, got {arr.dtype} {arr.shape}")
    return np.ascontiguousarray(arr, dtype=np.int64).tobytes()
