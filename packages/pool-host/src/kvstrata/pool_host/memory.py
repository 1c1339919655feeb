"""Host tensor allocators: where the bytes of a host pool live.

A host pool asks its allocator for one flat region of bytes and carves its layout out of it, so a
pool is always a single allocation: one pinned registration on CUDA, one shared-memory name that
another process (the node's L3 store service) can map.

    allocator                memory                              when
    PlainHostAllocator       torch.empty (pageable)              CPU device pools, tests
    PinnedHostAllocator      torch.empty(pin_memory=True)        CUDA device pools: async D2H/H2D
    SharedHostAllocator      a file in /dev/shm, mmap'd shared   another process maps the pages

Every allocator refuses, before touching memory, a region larger than this host can hold:
Linux overcommits, so an oversized torch.empty would "succeed" and the process would die later
at first touch, far from the cause.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import ClassVar, NamedTuple

import torch

from kvstrata.pool_host.errors import (
    InsufficientHostMemory,
    PinnedMemoryUnavailable,
    SharedMemoryError,
)

#: Where POSIX shared memory lives on Linux (shm_open names map to files here).
DEFAULT_SHM_DIR = Path("/dev/shm")


class HostMemory(NamedTuple):
    """This host's memory, in bytes: physical total and what can be allocated now."""

    total_bytes: int
    available_bytes: int


def host_memory() -> HostMemory:
    """Physical memory (sysconf) and available memory (MemAvailable of /proc/meminfo when the
    kernel reports it: free plus reclaimable cache; else sysconf's free pages)."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = os.sysconf("SC_PHYS_PAGES") * page
    available = _meminfo_available()
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * page
    return HostMemory(total_bytes=total, available_bytes=min(available, total))


def _meminfo_available() -> int | None:
    meminfo = Path("/proc/meminfo")
    if not meminfo.is_file():
        return None  # not Linux
    for line in meminfo.read_text(encoding="ascii").splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None  # kernels before 3.14 do not report it


def check_fits(num_bytes: int, *, what: str) -> None:
    """Raise InsufficientHostMemory when `num_bytes` exceed this host's available memory."""
    mem = host_memory()
    if num_bytes > mem.available_bytes:
        raise InsufficientHostMemory(
            f"{what} needs {num_bytes / 2**30:.2f} GiB of host memory, but this host has "
            f"{mem.available_bytes / 2**30:.2f} GiB available of {mem.total_bytes / 2**30:.2f} GiB "
            "physical; use a smaller ratio or byte budget"
        )


class HostRegion:
    """One flat region of host bytes: `tensor` is 1-D uint8 of `num_bytes`.

    `close()` releases what the allocator holds (pin registration, shared-memory name); tensors
    viewing the region stay valid until they are dropped (the mapping lives with its storage).
    """

    def __init__(
        self,
        *,
        tensor: torch.Tensor,
        kind: str,
        pinned: bool,
        shared_name: str | None = None,
        releaser: Callable[[], object] | None = None,
    ) -> None:
        assert tensor.dtype == torch.uint8 and tensor.dim() == 1, "a region is flat bytes"
        self.tensor = tensor
        self.kind = kind
        self.pinned = pinned
        self.shared_name = shared_name
        self._releaser = releaser

    @property
    def num_bytes(self) -> int:
        return self.tensor.numel()

    def close(self) -> None:
        """Release the allocator's hold (idempotent)."""
        if self._releaser is not None:
            self._releaser()


class HostTensorAllocator(ABC):
    """Allocates the flat byte region a host pool lays its pages out in."""

    kind: ClassVar[str]
    #: Whether regions are page-locked (required for asynchronous copies with CUDA).
    pinned: bool = False

    @abstractmethod
    def allocate(self, num_bytes: int) -> HostRegion:
        """A fresh, uninitialised region of `num_bytes` (> 0). Raises InsufficientHostMemory
        before allocating when the host cannot hold it."""


class PlainHostAllocator(HostTensorAllocator):
    """Pageable memory from torch.empty: the choice for CPU device pools."""

    kind = "plain"

    def allocate(self, num_bytes: int) -> HostRegion:
        assert num_bytes > 0, "a host region holds at least one byte"
        check_fits(num_bytes, what="a plain host region")
        return HostRegion(
            tensor=torch.empty(num_bytes, dtype=torch.uint8), kind=self.kind, pinned=False
        )


class PinnedHostAllocator(HostTensorAllocator):
    """Page-locked memory (cudaHostAlloc through torch): D2H/H2D copies run asynchronously on a
    copy stream and at full PCIe bandwidth. Needs CUDA; refused at construction without it."""

    kind = "pinned"
    pinned = True

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise PinnedMemoryUnavailable(
                "pinned host memory needs CUDA, which is not available; use PlainHostAllocator"
            )

    def allocate(self, num_bytes: int) -> HostRegion:
        assert num_bytes > 0, "a host region holds at least one byte"
        check_fits(num_bytes, what="a pinned host region")
        tensor = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
        return HostRegion(tensor=tensor, kind=self.kind, pinned=True)


def _cudart() -> ModuleType:
    cudart = torch.cuda.cudart()
    assert cudart is not None, "torch.cuda.cudart() is None: CUDA was checked at construction"
    return cudart


def _release_shared(path: str, pinned_ptr: int | None) -> None:
    if pinned_ptr is not None:
        _cudart().cudaHostUnregister(pinned_ptr)
    # Already gone when someone else cleaned the directory up: nothing left to release.
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class SharedHostAllocator(HostTensorAllocator):
    """Shared memory: each region is a file under `directory` (/dev/shm by default) mapped
    MAP_SHARED, so another process on the node maps the same pages by name (`attach_shared`)
    without a copy. With `pin=True` (CUDA only) the mapping is also registered page-locked.

    The file is fully reserved at allocation (posix_fallocate): a full tmpfs fails here with
    InsufficientHostMemory instead of a SIGBUS at first touch. The name is removed when the
    region is closed or garbage-collected; mappings already made elsewhere stay valid.
    """

    kind = "shared"

    def __init__(
        self,
        *,
        directory: str | os.PathLike[str] = DEFAULT_SHM_DIR,
        prefix: str = "kvstrata",
        pin: bool = False,
    ) -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise SharedMemoryError(f"shared-memory directory {self.directory} does not exist")
        if not prefix or "/" in prefix:
            raise SharedMemoryError(f"shared-memory prefix {prefix!r} must be a plain file name")
        if pin and not torch.cuda.is_available():
            raise PinnedMemoryUnavailable("pin=True needs CUDA, which is not available")
        self.prefix = prefix
        self.pinned = pin

    def allocate(self, num_bytes: int) -> HostRegion:
        assert num_bytes > 0, "a host region holds at least one byte"
        check_fits(num_bytes, what="a shared host region")
        stat = os.statvfs(self.directory)
        if num_bytes > stat.f_bavail * stat.f_frsize:
            raise InsufficientHostMemory(
                f"a shared host region needs {num_bytes / 2**30:.2f} GiB but {self.directory} has "
                f"{stat.f_bavail * stat.f_frsize / 2**30:.2f} GiB free"
            )
        name = f"{self.prefix}-{os.getpid()}-{secrets.token_hex(6)}"
        path = self.directory / name
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except OSError as exc:
            raise SharedMemoryError(f"cannot create shared-memory file {path}: {exc}") from exc
        try:
            os.posix_fallocate(fd, 0, num_bytes)
        except OSError as exc:
            os.close(fd)
            os.unlink(path)
            raise InsufficientHostMemory(
                f"cannot reserve {num_bytes} bytes in {self.directory}: {exc}"
            ) from exc
        os.close(fd)
        tensor = torch.from_file(str(path), shared=True, size=num_bytes, dtype=torch.uint8)
        pinned_ptr: int | None = None
        if self.pinned:
            err = _cudart().cudaHostRegister(tensor.data_ptr(), num_bytes, 0)
            if int(err) != 0:
                os.unlink(path)
                raise SharedMemoryError(f"cudaHostRegister of {path} failed with error {err}")
            pinned_ptr = tensor.data_ptr()
        region = HostRegion(
            tensor=tensor, kind=self.kind, pinned=self.pinned, shared_name=name, releaser=None
        )
        region._releaser = weakref.finalize(region, _release_shared, str(path), pinned_ptr)
        return region


def attach_shared(
    name: str, *, directory: str | os.PathLike[str] = DEFAULT_SHM_DIR
) -> torch.Tensor:
    """Map an existing shared region by name (from another process): a 1-D uint8 tensor over
    the same physical pages, no copy. Writes are visible to every process mapping it. The
    mapping stays valid after the owner closes the region (the name is gone, not the pages)."""
    if not name or "/" in name:
        raise SharedMemoryError(f"shared-memory name {name!r} must be a plain file name")
    path = Path(directory) / name
    try:
        num_bytes = path.stat().st_size
    except OSError as exc:
        raise SharedMemoryError(f"no shared region {name!r} in {directory}: {exc}") from exc
    return torch.from_file(str(path), shared=True, size=num_bytes, dtype=torch.uint8)
