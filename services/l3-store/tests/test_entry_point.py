"""`open_storage` finds backends of installed distributions through the entry point group, and
this distribution declares `ray://` there (opening it needs a cluster: test_ray_cluster.py)."""

from __future__ import annotations

from importlib import metadata

import pytest

from kvstrata.l3_store.client import open_ray_storage
from kvstrata.storage import MemoryStorage
from kvstrata.storage.errors import UnknownBackend
from kvstrata.storage.registry import ENTRY_POINT_GROUP, BackendRegistry


def test_this_distribution_declares_ray() -> None:
    entries = {e.name: e for e in metadata.entry_points(group=ENTRY_POINT_GROUP)}
    assert entries["ray"].load() is open_ray_storage
    assert entries["ray"].dist is not None and entries["ray"].dist.name == "kvstrata-l3-store"


def test_unregistered_scheme_is_loaded_from_its_entry_point(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = metadata.EntryPoint(
        name="fakemem", value="kvstrata.storage.registry:_open_memory", group=ENTRY_POINT_GROUP
    )
    real = metadata.entry_points

    def entry_points(**kw: str) -> object:
        if kw.get("group") == ENTRY_POINT_GROUP:
            return metadata.EntryPoints([fake])
        return real(**kw)

    monkeypatch.setattr(metadata, "entry_points", entry_points)
    registry = BackendRegistry()
    storage = registry.open("fakemem://?capacity_bytes=1KiB")
    assert isinstance(storage, MemoryStorage) and storage.capacity_bytes == 1024
    assert registry.schemes() == ["fakemem"], "registered on first use"
    with pytest.raises(UnknownBackend):
        registry.open("nosuch://")
