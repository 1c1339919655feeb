"""open_storage URLs and the backend registry."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstrata.storage import (
    FileStorage,
    MemoryStorage,
    Storage,
    StorageURL,
    open_storage,
    register_backend,
)
from kvstrata.storage.errors import (
    BackendAlreadyRegistered,
    InvalidParameter,
    InvalidStorageURL,
    StorageDirectoryError,
    UnknownBackend,
)
from kvstrata.storage.registry import DEFAULT_REGISTRY, BackendRegistry


def test_memory_url() -> None:
    storage = open_storage("memory://?capacity_bytes=4096")
    assert isinstance(storage, MemoryStorage)
    assert storage.stats().capacity_bytes == 4096
    assert open_storage("memory://?capacity_bytes=2MiB").stats().capacity_bytes == 2 << 20
    assert open_storage("memory://?capacity_bytes=1_000").stats().capacity_bytes == 1000


def test_file_url(tmp_path: Path) -> None:
    storage = open_storage(f"file://{tmp_path}?capacity_bytes=1GiB&fsync=batch&namespace=m%2Fp")
    assert isinstance(storage, FileStorage)
    assert storage.path == tmp_path
    assert (storage.capacity_bytes, storage.fsync, storage.namespace) == (1 << 30, "batch", "m/p")
    spaced = tmp_path / "with space"
    spaced.mkdir()
    assert isinstance(open_storage(f"file://{spaced}?capacity_bytes=1".replace(" ", "%20")),
                      FileStorage)  # fmt: skip


@pytest.mark.parametrize(
    ("url", "error", "match"),
    [
        ("nosuch://?capacity_bytes=1", UnknownBackend, "nosuch"),
        ("memory", InvalidStorageURL, "scheme"),
        ("memory://", InvalidStorageURL, "capacity_bytes is required"),
        ("memory://?capacity_bytes=lots", InvalidStorageURL, "byte size"),
        ("memory://?capacity_bytes=1&capacity_bytes=2", InvalidStorageURL, "twice"),
        ("memory://?capacity_bytes=1&fsync=page", InvalidStorageURL, "unknown parameter"),
        ("memory://host?capacity_bytes=1", InvalidStorageURL, "no host"),
        ("file://relative/dir?capacity_bytes=1", InvalidStorageURL, "absolute"),
        ("file:///tmp?capacity_bytes=1&fsync=sometimes", InvalidStorageURL, "fsync"),
        ("file:///tmp?capacity=1", InvalidStorageURL, "unknown parameter"),
    ],
)
def test_bad_urls_are_clear_errors(url: str, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        open_storage(url)


def test_missing_directory_surfaces_the_backend_error(tmp_path: Path) -> None:
    with pytest.raises(StorageDirectoryError):
        open_storage(f"file://{tmp_path}/missing?capacity_bytes=1")


def test_a_new_backend_plugs_in_by_scheme() -> None:
    registry = BackendRegistry()
    opened: list[StorageURL] = []

    def factory(url: StorageURL) -> Storage:
        url.check_params({"capacity_bytes", "actor"})
        opened.append(url)
        return MemoryStorage(capacity_bytes=url.size_param("capacity_bytes"))

    register_backend("ray", factory, registry=registry)
    storage = open_storage("ray://l3-store/node?capacity_bytes=1KiB&actor=a", registry=registry)
    assert isinstance(storage, MemoryStorage) and storage.capacity_bytes == 1024
    assert (opened[0].host, opened[0].path, dict(opened[0].params)) == (
        "l3-store",
        "/node",
        {"capacity_bytes": "1KiB", "actor": "a"},
    )
    with pytest.raises(BackendAlreadyRegistered):
        register_backend("ray", factory, registry=registry)
    register_backend("ray", factory, registry=registry, replace=True)
    assert registry.schemes() == ["ray"]
    assert "ray" not in DEFAULT_REGISTRY.schemes()  # a private registry stays private
    with pytest.raises(InvalidParameter):
        registry.register("not a scheme", factory)
