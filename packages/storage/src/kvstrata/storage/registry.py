"""Storage backends by URL scheme, so a caller names its L3 tier in configuration
(`memory://?capacity_bytes=1GiB`, `file:///var/cache/kv?capacity_bytes=...&fsync=batch`) and later
backends (the Ray-backed shared tier) plug in by registering a scheme, without touching callers.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from importlib import metadata
from types import MappingProxyType
from typing import cast
from urllib.parse import parse_qsl, unquote, urlsplit

from kvstrata.storage.base import Storage
from kvstrata.storage.errors import (
    BackendAlreadyRegistered,
    InvalidParameter,
    InvalidStorageURL,
    UnknownBackend,
)
from kvstrata.storage.file import DEFAULT_IO_THREADS, FSYNC_POLICIES, FileStorage, FsyncPolicy
from kvstrata.storage.memory import MemoryStorage

#: Entry point group of storage backends installed by other distributions: name = URL scheme,
#: value = a `BackendFactory` (e.g. `ray = "kvstrata.l3_store.client:open_ray_storage"`).
ENTRY_POINT_GROUP = "kvstrata.storage_backends"

_SIZE = re.compile(r"^\s*(\d[\d_]*)\s*(|B|KiB|MiB|GiB|TiB)\s*$")
_UNITS = {"": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


@dataclass(frozen=True, kw_only=True)
class StorageURL:
    """A parsed storage URL, as a backend factory receives it. `path` is percent-decoded;
    `params` are the query parameters (each at most once)."""

    url: str
    scheme: str
    host: str
    path: str
    params: Mapping[str, str]

    def check_params(self, allowed: Collection[str]) -> None:
        """Raise InvalidStorageURL naming any parameter not in `allowed` (catches typos)."""
        unknown = sorted(set(self.params) - set(allowed))
        if unknown:
            raise InvalidStorageURL(
                f"{self.url}: unknown parameter(s) {unknown}; {self.scheme}:// takes "
                f"{sorted(allowed)}"
            )

    def size_param(self, name: str, *, default: int | None = None) -> int:
        """A byte size: an integer, optionally with a unit (B, KiB, MiB, GiB, TiB)."""
        raw = self.params.get(name)
        if raw is None:
            if default is None:
                raise InvalidStorageURL(f"{self.url}: parameter {name} is required")
            return default
        match = _SIZE.match(raw)
        if match is None:
            raise InvalidStorageURL(f"{self.url}: {name}={raw!r} is not a byte size (e.g. 64MiB)")
        return int(match.group(1).replace("_", "")) * _UNITS[match.group(2)]

    def int_param(self, name: str, *, default: int, minimum: int = 0) -> int:
        """A plain decimal integer of at least `minimum`."""
        raw = self.params.get(name)
        if raw is None:
            return default
        if not raw.isdecimal() or int(raw) < minimum:
            raise InvalidStorageURL(f"{self.url}: {name}={raw!r}; expected an integer >= {minimum}")
        return int(raw)

    def str_param(self, name: str, *, default: str, choices: Collection[str] | None = None) -> str:
        value = self.params.get(name, default)
        if choices is not None and value not in choices:
            raise InvalidStorageURL(f"{self.url}: {name}={value!r}; choose from {sorted(choices)}")
        return value


def parse_storage_url(url: str) -> StorageURL:
    """Split a storage URL; InvalidStorageURL when it has no scheme or a malformed query."""
    parts = urlsplit(url)
    if not parts.scheme or "://" not in url:
        raise InvalidStorageURL(f"{url!r} is not a storage URL (expected scheme://...)")
    try:
        pairs = parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
    except ValueError as exc:
        raise InvalidStorageURL(f"{url}: malformed query: {exc}") from exc
    params: dict[str, str] = {}
    for name, value in pairs:
        if name in params:
            raise InvalidStorageURL(f"{url}: parameter {name} given twice")
        params[name] = value
    return StorageURL(
        url=url,
        scheme=parts.scheme.lower(),
        host=parts.netloc,
        path=unquote(parts.path),
        params=MappingProxyType(params),
    )


BackendFactory = Callable[[StorageURL], Storage]


class BackendRegistry:
    """Scheme -> factory. Thread-safe. A factory raises InvalidStorageURL (or InvalidParameter)
    for parameters it cannot use."""

    def __init__(self) -> None:
        self._factories: dict[str, BackendFactory] = {}
        self._lock = threading.Lock()

    def register(self, scheme: str, factory: BackendFactory, *, replace: bool = False) -> None:
        """Make `scheme://...` URLs open with `factory`. Raises BackendAlreadyRegistered if the
        scheme is taken and `replace` is False."""
        scheme = scheme.lower()
        if not re.fullmatch(r"[a-z][a-z0-9+.-]*", scheme):
            raise InvalidParameter(f"{scheme!r} is not a URL scheme")
        with self._lock:
            if scheme in self._factories and not replace:
                raise BackendAlreadyRegistered(f"a backend is already registered for {scheme}://")
            self._factories[scheme] = factory

    def schemes(self) -> list[str]:
        with self._lock:
            return sorted(self._factories)

    def open(self, url: str) -> Storage:
        """A new storage for `url`. Raises UnknownBackend, InvalidStorageURL, and whatever the
        backend's constructor raises (e.g. StorageDirectoryError)."""
        parsed = parse_storage_url(url)
        with self._lock:
            factory = self._factories.get(parsed.scheme)
        if factory is None:
            factory = self._from_entry_point(parsed.scheme)
        if factory is None:
            raise UnknownBackend(
                f"{url}: no storage backend for {parsed.scheme}://; "
                f"registered: {', '.join(self.schemes())}"
            )
        return factory(parsed)

    def _from_entry_point(self, scheme: str) -> BackendFactory | None:
        """The factory an installed distribution declares for `scheme` in the entry point group
        ENTRY_POINT_GROUP (loaded, registered, returned), or None. Backends that live above
        this layer (`ray://` in kvstrata-l3-store) plug in this way, never by an import."""
        for entry in metadata.entry_points(group=ENTRY_POINT_GROUP):
            if entry.name.lower() == scheme:
                factory = cast(BackendFactory, entry.load())
                with self._lock:
                    return self._factories.setdefault(scheme, factory)
        return None


def _open_memory(url: StorageURL) -> Storage:
    url.check_params({"capacity_bytes"})
    if url.host or url.path not in ("", "/"):
        raise InvalidStorageURL(f"{url.url}: memory:// takes no host or path")
    return MemoryStorage(capacity_bytes=url.size_param("capacity_bytes"))


def _open_file(url: StorageURL) -> Storage:
    url.check_params({"capacity_bytes", "fsync", "namespace", "io_threads"})
    if url.host not in ("", "localhost"):
        raise InvalidStorageURL(f"{url.url}: file:// takes an absolute path (file:///abs/path)")
    if not url.path.startswith("/"):
        raise InvalidStorageURL(f"{url.url}: the path must be absolute")
    fsync = cast(FsyncPolicy, url.str_param("fsync", default="never", choices=FSYNC_POLICIES))
    return FileStorage(
        url.path,
        capacity_bytes=url.size_param("capacity_bytes"),
        namespace=url.str_param("namespace", default=""),
        fsync=fsync,
        io_threads=url.int_param("io_threads", default=DEFAULT_IO_THREADS, minimum=1),
    )


#: The registry `open_storage` and `register_backend` use unless given another.
DEFAULT_REGISTRY = BackendRegistry()
DEFAULT_REGISTRY.register("memory", _open_memory)
DEFAULT_REGISTRY.register("file", _open_file)


def register_backend(
    scheme: str,
    factory: BackendFactory,
    *,
    replace: bool = False,
    registry: BackendRegistry | None = None,
) -> None:
    """Register `factory` for `scheme://` URLs (in DEFAULT_REGISTRY unless `registry`)."""
    (registry or DEFAULT_REGISTRY).register(scheme, factory, replace=replace)


def open_storage(url: str, *, registry: BackendRegistry | None = None) -> Storage:
    """Open the storage a URL names: `memory://?capacity_bytes=N`,
    `file:///abs/path?capacity_bytes=N&fsync=never|page|batch&namespace=...&io_threads=N`, or
    any scheme registered with `register_backend` or declared by an installed distribution in
    the entry point group `kvstrata.storage_backends` (loaded on first use)."""
    return (registry or DEFAULT_REGISTRY).open(url)
