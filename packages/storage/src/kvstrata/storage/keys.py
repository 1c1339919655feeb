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

import hashlib
import struct
from collections.abc import Callable
from typing import Literal, Protocol, TypeAlias

import numpy as np
import numpy.typing as npt

from kvstrata.storage.errors import InvalidParameter

HashName: TypeAlias = Literal["sha256", "blake2b", "nh128"]

#: Key length in bytes per hash.
KEY_BYTES: dict[str, int] = {"sha256": 32, "blake2b": 16, "nh128": 24}

_DOMAIN = b"kvstrata.storage.page-key.v1"
_U64 = np.dtype("<u8")
_MIX1 = np.uint64(0xFF51AFD7ED558CCD)  # MurmurHash3 fmix64 constants
_MIX2 = np.uint64(0xC4CEB9FE1A85EC53)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_LANE_SALT = (np.uint64(0x243F6A8885A308D3), np.uint64(0x13198A2E03707344))


class _Hasher(Protocol):
    def update(self, data: bytes | memoryview, /) -> None: ...
    def digest(self) -> bytes: ...


def _field(value: bytes | str | None) -> bytes:
    """Type tag + 8-byte length + data: None, b"" and "" all encode differently."""
    if value is None:
        return b"\x00"
    if isinstance(value, str):
        data = value.encode("utf-8")
        return b"\x02" + struct.pack("<Q", len(data)) + data
    return b"\x01" + struct.pack("<Q", len(value)) + bytes(value)


def _fmix64(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """MurmurHash3's 64-bit finaliser: a bijection that spreads every input bit over the word."""
    x = x ^ (x >> np.uint64(33))
    x = x * _MIX1
    x = x ^ (x >> np.uint64(33))
    x = x * _MIX2
    return x ^ (x >> np.uint64(33))


class PageKeyer:
    """Turns token ids into chained page keys, one key per whole page.

    `hash`:
    - "sha256" (default, 32-byte keys): cryptographic, so tenants sharing one L3 tier cannot
      craft a prefix whose key collides with another tenant's pages; hashlib runs it in C
      (with SHA-NI where the CPU has it).
    - "blake2b" (16-byte keys): also cryptographic; faster than sha256 on CPUs without SHA
      extensions, slower on those with them.
    - "nh128" (24-byte keys): NOT cryptographic, for single-tenant deployments only. Each page
      is hashed by NH (the UMAC hash, RFC 4418; tokens 2j and 2j+1 paired, over the low and the
      high 32-bit words of the token ids) with two fixed key sets, vectorised across all pages
      with numpy; pages are chained by a running 64-bit sum per lane of position-bound mixes.
      Accidental collisions are ~2^-64 per prefix pair, but anyone who can choose token ids can
      construct collisions, hence single tenant. Keys carry the page's position in the chain
      (the last 8 bytes) so that `parent` can continue it.
    """

    def __init__(
        self, *, page_size: int, namespace: bytes | str = b"", hash: HashName = "sha256"
    ) -> None:
        if page_size < 1:
            raise InvalidParameter(f"page_size must be >= 1, got {page_size}")
        if hash not in KEY_BYTES:
            raise InvalidParameter(f"hash must be one of {sorted(KEY_BYTES)}, got {hash!r}")
        self.page_size = page_size
        self.namespace = namespace
        self.hash: HashName = hash
        self.key_bytes = KEY_BYTES[hash]
        self._digest: Callable[[bytes], _Hasher]
        if hash == "blake2b":
            self._digest = lambda data: hashlib.blake2b(data, digest_size=16)
        else:
            self._digest = hashlib.sha256
        if hash == "nh128":
            # NH keys: lane x (low, high word) x (even, odd token) x token pair of a page,
            # derived by a XOF so they are identical everywhere.
            half = (page_size + 1) // 2
            raw = hashlib.shake_256(_DOMAIN + b"/nh128/" + struct.pack("<Q", page_size))
            words = np.frombuffer(raw.digest(2 * 2 * 2 * half * 4), dtype="<u4")
            keys = words.astype(np.uint64).reshape(2, 2, 2, half)
            self._nh_lo_keys = keys[:, 0]  # [lane, even/odd, pair]
            self._nh_hi_keys = keys[:, 1]
            # The high-word sum of a page whose token ids all fit in 32 bits (every real
            # vocabulary): a constant, so the common case hashes only the low words.
            self._nh_hi_zero = (keys[:, 1, 0] * keys[:, 1, 1]).sum(axis=1, dtype=np.uint64)

    def seed(
        self, *, extra_key: bytes | str | None = None, cache_salt: bytes | str | None = None
    ) -> bytes:
        """The chain's starting value for this namespace, adapter and salt (key_bytes long)."""
        material = (
            _DOMAIN
            + _field(self.hash)
            + struct.pack("<Q", self.page_size)
            + _field(self.namespace)
            + _field(extra_key)
            + _field(cache_salt)
        )
        if self.hash == "nh128":
            # Lanes from sha256, position -1 (so the first page is position 0).
            return hashlib.sha256(material).digest()[:16] + struct.pack("<q", -1)
        return self._digest(material).digest()

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
        tokens = self._tokens(token_ids)
        num_pages = tokens.size // self.page_size
        if parent is not None and len(parent) != self.key_bytes:
            raise InvalidParameter(
                f"parent key has {len(parent)} bytes; {self.hash} keys have {self.key_bytes}"
            )
        if num_pages == 0:
            return []
        if parent is None:
            parent = self.seed(extra_key=extra_key, cache_salt=cache_salt)
        pages = tokens[: num_pages * self.page_size]
        if self.hash == "nh128":
            return self._nh128_chain(pages.reshape(num_pages, self.page_size), parent)
        data = memoryview(pages.tobytes())
        step = self.page_size * 8
        keys: list[bytes] = []
        prev = parent
        digest = self._digest
        for offset in range(0, len(data), step):
            h = digest(prev)
            h.update(data[offset : offset + step])
            prev = h.digest()
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

    def _nh128_chain(self, pages: npt.NDArray[np.int64], start: bytes) -> list[bytes]:
        """NH per page over the low and the high 32-bit words of its tokens, token 2j paired
        with token 2j+1 (an odd page size is padded with a zero token), both lanes at once;
        then the running sum of position-bound mixes along the chain."""
        num_pages = pages.shape[0]
        words = pages.view("<u8")
        if self.page_size % 2:
            words = np.concatenate([words, np.zeros((num_pages, 1), dtype="<u8")], axis=1)
        even, odd = words[np.newaxis, :, 0::2], words[np.newaxis, :, 1::2]
        mask = np.uint64(0xFFFFFFFF)
        lo_keys = self._nh_lo_keys[:, :, np.newaxis, :]  # [lane, even/odd, 1, pair]
        # (w + k) & mask is NH's addition mod 2^32; the products wrap mod 2^64 as NH's do.
        nh = (((even + lo_keys[:, 0]) & mask) * ((odd + lo_keys[:, 1]) & mask)).sum(
            axis=2, dtype=np.uint64
        )
        if int(pages.min()) >= 0 and int(pages.max()) <= 0xFFFFFFFF:
            nh += self._nh_hi_zero[:, np.newaxis]
        else:
            hi_keys = self._nh_hi_keys[:, :, np.newaxis, :]
            shift = np.uint64(32)
            hi_even = ((even >> shift) + hi_keys[:, 0]) & mask
            hi_odd = ((odd >> shift) + hi_keys[:, 1]) & mask
            nh += (hi_even * hi_odd).sum(axis=2, dtype=np.uint64)
        first = np.frombuffer(start, dtype=_U64)
        position0 = int(np.frombuffer(start[16:], dtype="<i8")[0]) + 1
        positions = np.arange(position0, position0 + num_pages, dtype=np.uint64)
        out = np.empty((num_pages, 3), dtype=_U64)
        for lane in range(2):
            bound = _fmix64(nh[lane] ^ _fmix64(positions * _GOLDEN + _LANE_SALT[lane]))
            out[:, lane] = first[lane] + np.cumsum(bound, dtype=np.uint64)
        out[:, 2] = positions
        blob = out.tobytes()
        kb = self.key_bytes
        return [blob[i * kb : (i + 1) * kb] for i in range(num_pages)]
