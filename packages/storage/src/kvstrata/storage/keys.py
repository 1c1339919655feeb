"""Chained page keys: the names under which pages of a token prefix are stored.

    seed    = H(domain, hash name, page_size, namespace, extra_key, cache_salt)
    key_0   = H(seed    || tokens of page 0)
    key_i   = H(key_i-1 || tokens of page i)

so a key names its whole prefix: the same tokens after another prefix, or under another
namespace, adapter (`extra_key`) or `cache_salt`, give another key. Tokens are serialised as
little-endian int64 and every seed field is length-prefixed and type-tagged, so no two different
inputs share an encoding and keys are identical across processes and machines (never Python's
`hash()`, which is salted per process).
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Callable
from typing import Literal, Protocol, TypeAlias

import numpy as np
import numpy.typing as npt
import xxhash

from kvstrata.storage.errors import InvalidParameter

HashName: TypeAlias = Literal["sha256", "blake2b", "xxh3"]

#: Key length in bytes per hash.
KEY_BYTES: dict[str, int] = {"sha256": 32, "blake2b": 16, "xxh3": 16}

_DOMAIN = b"kvstrata.storage.page-key.v1"

#: Seeds kept per keyer (one per distinct extra_key / cache_salt pair seen); past it the cache
#: starts over.
SEED_CACHE_ENTRIES = 1024


class _Hasher(Protocol):
    def update(self, data: bytes | memoryview, /) -> None: ...
    def digest(self) -> bytes: ...


def _field(name: str, value: object) -> bytes:
    """Type tag + 8-byte length + data: None, b"" and "" all encode differently. Anything but
    None, str and bytes-like is refused (`bytes(3)` is three zero bytes and `bytes([1, 2])` is
    b"\\x01\\x02": taking them would let an int or a list collide with bytes)."""
    if value is None:
        return b"\x00"
    if isinstance(value, str):
        data = value.encode("utf-8")
        return b"\x02" + struct.pack("<Q", len(data)) + data
    if isinstance(value, bytes | bytearray | memoryview):
        data = bytes(value)
        return b"\x01" + struct.pack("<Q", len(data)) + data
    raise InvalidParameter(
        f"{name} must be bytes, str or None, got {type(value).__name__} {value!r:.40}"
    )


class PageKeyer:
    """Turns token ids into chained page keys, one key per whole page.

    `hash`:
    - "sha256" (default, 32-byte keys): cryptographic, so tenants sharing one L3 tier cannot
      craft a prefix whose key collides with another tenant's pages; hashlib runs it in C
      (with SHA-NI where the CPU has it).
    - "blake2b" (16-byte keys): also cryptographic; faster than sha256 on CPUs without SHA
      extensions, slower on those with them.
    - "xxh3" (16-byte keys): XXH3-128 (the `xxhash` package, seed 0, canonical big-endian
      digest), chained exactly like the others. NOT cryptographic, for single-tenant
      deployments only: accidental collisions are ~2^-128 per pair of prefixes, but anyone who
      can choose token ids can construct collisions on purpose, so tenants sharing a tier could
      read or poison each other's pages.
    """

    def __init__(
        self, *, page_size: int, namespace: bytes | str = b"", hash: HashName = "sha256"
    ) -> None:
        if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
            raise InvalidParameter(f"page_size must be an integer >= 1, got {page_size!r}")
        if hash not in KEY_BYTES:
            raise InvalidParameter(f"hash must be one of {sorted(KEY_BYTES)}, got {hash!r}")
        self._namespace_field = _field("namespace", namespace)  # checked before any state
        self.page_size = page_size
        self.namespace = namespace
        self.hash: HashName = hash
        self.key_bytes = KEY_BYTES[hash]
        self._digest: Callable[[bytes], _Hasher]
        if hash == "blake2b":
            self._digest = functools.partial(hashlib.blake2b, digest_size=16)  # C, no frame
        elif hash == "xxh3":
            self._digest = xxhash.xxh3_128
        else:
            self._digest = hashlib.sha256
        # Encoded (extra_key, cache_salt) fields -> seed; a dict get/set is atomic under the
        # GIL, so threads may share the keyer (at worst two compute the same seed).
        self._seeds: dict[tuple[bytes, bytes], bytes] = {}

    def seed(
        self, *, extra_key: bytes | str | None = None, cache_salt: bytes | str | None = None
    ) -> bytes:
        """The chain's starting value for this namespace, adapter and salt (key_bytes long).
        `extra_key` and `cache_salt` must be bytes, str or None (InvalidParameter otherwise)."""
        return self._seed_of(_field("extra_key", extra_key), _field("cache_salt", cache_salt))

    def _seed_of(self, extra_field: bytes, salt_field: bytes) -> bytes:
        """`seed` from the encoded fields, cached: every request without a parent key (most
        start at the root) would otherwise hash the same seed material again."""
        cached = self._seeds.get((extra_field, salt_field))
        if cached is not None:
            return cached
        material = (
            _DOMAIN
            + _field("hash", self.hash)
            + struct.pack("<Q", self.page_size)
            + self._namespace_field
            + extra_field
            + salt_field
        )
        seed = self._digest(material).digest()
        if len(self._seeds) >= SEED_CACHE_ENTRIES:  # many salts: start over, stay bounded
            self._seeds.clear()
        self._seeds[(extra_field, salt_field)] = seed
        return seed

    def page_keys(
        self,
        token_ids: npt.ArrayLike,
        *,
        extra_key: bytes | str | None = None,
        cache_salt: bytes | str | None = None,
        parent: bytes | None = None,
    ) -> list[bytes]:
        """One key per whole page of `token_ids` (a trailing partial page gets none).

        `parent` is the key of the page just before `token_ids[0]`: the chain continues from it,
        and `extra_key`/`cache_salt` are ignored (the parent already folds them in). Token ids
        may be a list of ints, a numpy array or a CPU torch tensor, 1-D, int64 range. Pure.
        """
        # Checked even when `parent` makes them unused: a bad value is a caller's bug either way.
        extra_field = _field("extra_key", extra_key)
        salt_field = _field("cache_salt", cache_salt)
        if parent is not None and type(parent) is not bytes:
            raise InvalidParameter(f"parent must be bytes, got {type(parent).__name__}")
        tokens = self._tokens(token_ids)
        num_pages = tokens.size // self.page_size
        if parent is not None and len(parent) != self.key_bytes:
            raise InvalidParameter(
                f"parent key has {len(parent)} bytes; {self.hash} keys have {self.key_bytes}"
            )
        if num_pages == 0:
            return []
        if parent is None:
            parent = self._seed_of(extra_field, salt_field)
        return self._chain(tokens[: num_pages * self.page_size].tobytes(), parent)

    def chain(self, tokens: npt.NDArray[np.int64], parent: bytes) -> list[bytes]:
        """`page_keys(tokens, parent=parent)` for a caller that vouches for its input (the
        tiers' path: their keys' token arrays are validated when a request enters): `tokens`
        a 1-D int64 array, `parent` a key of this keyer or its `seed()`. Nothing is checked;
        the same keys."""
        whole = tokens.size // self.page_size * self.page_size
        return self._chain(tokens[:whole].astype("<i8", copy=False).tobytes(), parent)

    def _chain(self, data: bytes, parent: bytes) -> list[bytes]:
        """The keys of the whole pages of `data` (little-endian int64 tokens), from `parent`.

        One hash call per page on `prev + page` (a short bytes concatenation: the same digest
        as hashing `prev` then updating with the page) costs less than a hasher object and an
        update: the per-page call overhead dominates at these sizes."""
        step = self.page_size * 8
        keys: list[bytes] = []
        prev = parent
        if self.hash == "xxh3":
            xxh3_128 = xxhash.xxh3_128_digest  # bytes -> digest in one call
            for offset in range(0, len(data), step):
                prev = xxh3_128(prev + data[offset : offset + step])
                keys.append(prev)
            return keys
        digest = self._digest
        for offset in range(0, len(data), step):
            prev = digest(prev + data[offset : offset + step]).digest()
            keys.append(prev)
        return keys

    def _tokens(self, token_ids: npt.ArrayLike) -> npt.NDArray[np.int64]:
        try:
            arr = np.asarray(token_ids)
        except (TypeError, ValueError, OverflowError, RuntimeError) as exc:
            raise InvalidParameter(f"token ids must be an integer sequence: {exc}") from exc
        if arr.ndim != 1:
            raise InvalidParameter(f"token ids must be 1-D, got shape {arr.shape}")
        if arr.size == 0:
            return np.empty(0, dtype="<i8")
        if arr.dtype.kind not in "iu":
            raise InvalidParameter(f"token ids must be integers, got dtype {arr.dtype}")
        if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and int(arr.max()) >= 2**63:
            raise InvalidParameter("token ids must fit in int64")
        return np.ascontiguousarray(arr, dtype="<i8")
