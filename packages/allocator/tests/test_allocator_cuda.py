"""The torch backend on a GPU: same indices as the CPU reference, free list on the device.

Skipped without CUDA (root conftest). The state machines cover the torch backend on CPU; these
tests check what only a GPU can: device placement and the synchronising checks.
"""

from __future__ import annotations

import pytest
import torch

from kvstrata.allocator import DoubleFree, MisalignedIndex
from kvstrata.testkit.allocators import idx, make_mamba, make_paged, make_swa

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_same_indices_as_the_cpu_reference(page_size: int) -> None:
    gpu = make_paged(page_size=page_size, backend="torch", device="cuda")
    cpu = make_paged(page_size=page_size, backend="numpy")
    assert gpu.backend == "torch" and gpu._engine._stack.is_cuda  # the free list stays on GPU
    steps = [
        lambda a, d: a.alloc(2 * page_size),
        lambda a, d: a.alloc_extend(idx([0, 0], d), idx([3, 5], d), None),
        lambda a, d: a.alloc_decode(idx([1, 1], d), None),
    ]
    for step in steps:
        got, want = step(gpu, "cuda"), step(cpu, "cpu")
        assert got is not None and want is not None
        assert got.is_cuda and got.dtype == torch.int64
        assert got.cpu().tolist() == want.tolist()
        gpu.free(got)
        cpu.free(want)
    assert gpu.available_size() == cpu.available_size() == gpu.size
    gpu.check_integrity()


def test_checks_raise_on_the_gpu() -> None:
    a = make_paged(page_size=4, backend="torch", device="cuda")
    held = a.alloc(8)
    assert held is not None
    a.free(held[:4])
    with pytest.raises(DoubleFree):
        a.free(held[:1])
    with pytest.raises(MisalignedIndex):
        a.alloc_decode(idx([7], "cuda"), idx([10], "cuda"))
    a.check_integrity()


def test_swa_and_mamba_on_the_gpu() -> None:
    swa = make_swa(backend="torch", device="cuda")
    full = swa.alloc(8)
    assert full is not None and swa.full_to_swa.is_cuda
    assert swa.translate(full).is_cuda
    swa.free_swa(full[:4])
    swa.check_integrity()
    mamba = make_mamba(backend="torch", device="cuda")
    slots = mamba.alloc(2)
    assert slots is not None
    copy = mamba.fork(slots)
    assert copy is not None and copy.dst.is_cuda
    mamba.check_integrity()
