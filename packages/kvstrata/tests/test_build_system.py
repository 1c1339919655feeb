"""`build_memory_system`: every family wired from a small config and a capacity."""

from __future__ import annotations

import pytest
import torch

from kvstrata.allocator import MambaSlotAllocator, PagedAllocator, SWAAllocator
from kvstrata.build import (
    FAMILIES,
    POLICIES,
    DeviceUnavailable,
    InvalidCapacity,
    InvalidModel,
    MambaModel,
    MemorySystem,
    MHAModel,
    SWAModel,
    UnknownFamily,
    UnknownPolicy,
    build_memory_system,
)
from kvstrata.hybrid_cache import LayerKind
from kvstrata.pool import MambaPool, MHAKVPool, SWAKVPool
from kvstrata.unified_radix_cache import FullComponent, MambaComponent, SWAComponent


def _build(family: str, **overrides: object) -> MemorySystem:
    options: dict[str, object] = {"capacity_tokens": 1000, "page_size": 16, **overrides}
    return build_memory_system(family=family, **options)  # pyright: ignore[reportArgumentType]


def test_mha_system() -> None:
    system = _build("mha")
    assert system.capacity_tokens == 992  # rounded down to whole pages
    assert isinstance(system.kv_allocator, PagedAllocator)
    assert system.kv_allocator.size == 992 and system.kv_allocator.page_size == 16
    assert isinstance(system.kv_pool, MHAKVPool) and system.kv_pool.size == 992
    assert system.kv_pool.dtype == torch.float32
    assert system.mamba_allocator is None and system.mamba_pool is None
    assert system.attention_layer_ids == (0, 1) and system.mamba_layer_ids == ()
    assert system.sliding_window is None and system.swa_allocator is None
    assert [type(c) for c in system.tree.components] == [FullComponent]
    assert system.tree.page_size == 16
    system.check_integrity()


def test_swa_system_sizes_the_window_pool_by_ratio() -> None:
    system = _build("swa", swa_ratio=0.5)
    assert isinstance(system.kv_allocator, SWAAllocator)
    assert system.kv_allocator.full_size == 992
    assert system.kv_allocator.swa_size == 496
    assert isinstance(system.kv_pool, SWAKVPool)
    assert system.sliding_window == SWAModel().sliding_window
    assert [type(c) for c in system.tree.components] == [FullComponent, SWAComponent]
    assert system.layers.route(0).member == "full"
    assert system.layers.route(1).member == "swa"
    system.check_integrity()


def test_swa_pool_reads_the_allocators_live_map() -> None:
    system = _build("swa")
    assert isinstance(system.kv_pool, SWAKVPool) and isinstance(system.kv_allocator, SWAAllocator)
    slots = system.kv_allocator.alloc(16)
    assert slots is not None
    assert torch.equal(system.kv_pool.translate(slots), system.kv_allocator.translate(slots))
    assert bool((system.kv_pool.translate(slots) > 0).all())


def test_mamba_system() -> None:
    system = _build("mamba")
    model = MambaModel()
    assert isinstance(system.kv_allocator, PagedAllocator)
    assert isinstance(system.mamba_allocator, MambaSlotAllocator)
    assert isinstance(system.mamba_pool, MambaPool)
    assert system.mamba_allocator.size == 15  # 992 // 64
    assert system.attention_layer_ids == model.attention_layer_ids
    assert system.mamba_layer_ids == model.mamba_layer_ids
    for layer_id in model.mamba_layer_ids:
        assert system.layers.kind(layer_id) is LayerKind.MAMBA
    assert [type(c) for c in system.tree.components] == [FullComponent, MambaComponent]
    system.check_integrity()


def test_mamba_slots_default_has_a_floor_and_can_be_set() -> None:
    assert _build("mamba", capacity_tokens=64).mamba_allocator.size == 4  # pyright: ignore[reportOptionalMemberAccess]
    assert _build("mamba", mamba_slots=9).mamba_allocator.size == 9  # pyright: ignore[reportOptionalMemberAccess]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("policy", POLICIES)
def test_every_family_builds_with_every_policy(family: str, policy: str) -> None:
    system = _build(family, policy=policy, capacity_tokens=256, page_size=4, enable_events=True)
    assert system.family == family and system.page_size == 4
    system.check_integrity()
    system.reset()
    system.check_integrity()


def test_custom_model_is_used() -> None:
    system = _build("mha", model=MHAModel(num_layers=3, num_kv_heads=2, head_dim=8))
    assert system.attention_layer_ids == (0, 1, 2)
    assert system.kv_pool.get_key_buffer(2).shape[1:] == (2, 8)


@pytest.mark.parametrize(
    ("overrides", "error"),
    [
        ({"family": "mla"}, UnknownFamily),
        ({"policy": "random"}, UnknownPolicy),
        ({"page_size": 0}, InvalidCapacity),
        ({"capacity_tokens": 15}, InvalidCapacity),
        ({"family": "swa", "swa_ratio": 0.0}, InvalidCapacity),
        ({"family": "swa", "swa_ratio": 1.5}, InvalidCapacity),
        ({"family": "swa", "capacity_tokens": 16, "swa_ratio": 0.5}, InvalidCapacity),
        ({"family": "mamba", "mamba_slots": 1}, InvalidCapacity),
        ({"family": "mha", "model": SWAModel()}, InvalidModel),
        ({"family": "mha", "model": MHAModel(num_layers=0)}, InvalidModel),
        ({"family": "swa", "model": SWAModel(swa_layer_ids=())}, InvalidModel),
        ({"family": "swa", "model": SWAModel(swa_layer_ids=(0,))}, InvalidModel),
        ({"family": "mamba", "model": MambaModel(mamba_layer_ids=(3,))}, InvalidModel),
        ({"family": "mamba", "model": MHAModel()}, InvalidModel),
        ({"device": "tpu:x"}, DeviceUnavailable),
    ],
)
def test_bad_builds_are_refused(overrides: dict[str, object], error: type[Exception]) -> None:
    options: dict[str, object] = {"family": "mha", "capacity_tokens": 1000, **overrides}
    with pytest.raises(error):
        build_memory_system(**options)  # pyright: ignore[reportArgumentType]


def test_reset_returns_every_slot() -> None:
    system = _build("mha")
    from kvstrata.unified_radix_cache import RadixKey

    slots = system.kv_allocator.alloc(64)
    assert slots is not None
    system.tree.insert(RadixKey(list(range(64))), slots)
    assert system.kv_allocator.available_size() == 992 - 64
    system.reset()
    assert system.kv_allocator.available_size() == 992
    system.check_integrity()


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA"
)
def test_cuda_without_a_gpu_is_refused() -> None:
    with pytest.raises(DeviceUnavailable):
        build_memory_system(family="mha", capacity_tokens=64, device="cuda")
