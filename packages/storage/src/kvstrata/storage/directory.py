"""Directory-level operations of FileStorage: finding page and temp files, removing orphans,
fsyncing directories, and checking at construction that the directory is writable.

Layout under the root (`ns` = the first 8 bytes of the namespace fingerprint in hex, so pages of
two namespaces never share a path; `ab` = the key's first byte in hex, a 256-way fan-out):

    <root>/ns-<ns>/ab/ab12...ef.page             a complete page: header + payload
    <root>/ns-<ns>/ab/.ab12...ef.<pid>.<n>.tmp   a page being written (never read)
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from kvstrata.storage.errors import InvalidParameter, StorageDirectoryError
from kvstrata.storage.file_format import RWF_NOWAIT

PAGE_SUFFIX = ".page"
NAMESPACE_PREFIX = "ns-"

_log = logging.getLogger(__name__)


class PageFile(NamedTuple):
    """A page file found by a scan."""

    path: str
    size: int
    used_at: float  # max(atime, mtime): LRU order at a rebuild


class TempFile(NamedTuple):
    path: str
    size: int


def namespace_dir(root: str, fingerprint: bytes) -> str:
    return os.path.join(root, NAMESPACE_PREFIX + fingerprint[:8].hex())


def key_of(path: str) -> bytes | None:
    """The key named by a page file's path (None for a name that is not a page's)."""
    name = os.path.basename(path)
    if not name.endswith(PAGE_SUFFIX) or name.startswith("."):
        return None
    try:
        return bytes.fromhex(name[: -len(PAGE_SUFFIX)])
    except ValueError:
        return None


def scan(root: str) -> tuple[list[PageFile], list[TempFile]]:
    """Every page file and temp file under the namespace directories of `root` (files removed
    meanwhile by another process are skipped)."""
    pages: list[PageFile] = []
    temps: list[TempFile] = []
    for subdir in _fan_out_dirs(root):
        try:
            entries = list(os.scandir(subdir))
        except FileNotFoundError:
            continue
        for entry in entries:
            name = entry.name
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            if name.startswith(".") and name.endswith(".tmp"):
                temps.append(TempFile(entry.path, st.st_size))
            elif key_of(entry.path) is not None:
                pages.append(PageFile(entry.path, st.st_size, max(st.st_atime, st.st_mtime)))
    return pages, temps


def legacy_files(root: str) -> Iterator[str]:
    """Page and temp files of the layout before namespace directories (`<root>/ab/...`): they
    are misses for every storage, so the first opener removes them."""
    with os.scandir(root) as top:
        subdirs = [e.path for e in top if len(e.name) == 2 and e.is_dir(follow_symlinks=False)]
    for subdir in subdirs:
        with os.scandir(subdir) as entries:
            for entry in entries:
                if entry.name.endswith((PAGE_SUFFIX, ".tmp")):
                    yield entry.path


def _fan_out_dirs(root: str) -> list[str]:
    out: list[str] = []
    with os.scandir(root) as top:
        spaces = [
            e.path
            for e in top
            if e.name.startswith(NAMESPACE_PREFIX) and e.is_dir(follow_symlinks=False)
        ]
    for space in spaces:
        try:
            with os.scandir(space) as entries:
                out.extend(
                    e.path for e in entries if len(e.name) == 2 and e.is_dir(follow_symlinks=False)
                )
        except FileNotFoundError:
            continue
    return out


def is_orphan(path: str, now: float, write_timeout_s: float) -> bool:
    """A temp file nobody will rename: its writer's pid no longer runs, or its last change
    (ctime: a rename or a write sets it, and it cannot be set back) is older than the write
    timeout, whoever wrote it."""
    try:
        pid = int(os.path.basename(path).split(".")[2])
    except (IndexError, ValueError):
        return False  # not a temp file of ours
    try:
        if now - os.stat(path).st_ctime > write_timeout_s:
            return True
    except FileNotFoundError:
        return False
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, owned by another user
    return False


def fsync_dirs(directories: list[str]) -> None:
    for directory in directories:
        fsync_dir(directory)


def fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError as exc:
        _log.warning("cannot open %s to fsync it: %s", directory, exc)
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        _log.warning("cannot fsync %s: %s", directory, exc)
    finally:
        os.close(fd)


def probe_writable(root: Path) -> bool:
    """Create and remove a file: permission bits lie for root and read-only mounts. Whether a
    read with RWF_NOWAIT works on this file system (tried on the probe file, in the page
    cache as it was just written)."""
    probe = os.path.join(root, f".probe.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError as exc:
        read_only = exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM)
        reason = "read-only" if read_only else "unusable"
        raise StorageDirectoryError(f"FileStorage directory {root} is {reason}: {exc}") from exc
    try:
        return nowait_works(fd)
    finally:
        os.close(fd)
        os.unlink(probe)


def nowait_works(fd: int) -> bool:
    if RWF_NOWAIT is None:
        return False
    try:
        os.write(fd, b"\0")
        os.preadv(fd, [bytearray(1)], 0, RWF_NOWAIT)
    except OSError as exc:  # EAGAIN: supported, the byte just is not cached
        return exc.errno == errno.EAGAIN  # EOPNOTSUPP, EINVAL: not on this file system
    return True


def check_arguments(
    path: object,
    capacity_bytes: object,
    namespace: object,
    fsync: object,
    timeout: object,
    fsync_policies: tuple[str, ...],
) -> Path:
    """The storage's root, once every argument checks out (InvalidParameter otherwise)."""
    if not isinstance(capacity_bytes, int) or isinstance(capacity_bytes, bool):
        raise InvalidParameter(
            f"capacity_bytes must be an int, got {type(capacity_bytes).__name__}"
        )
    if capacity_bytes < 0:
        raise InvalidParameter(f"capacity_bytes must be >= 0, got {capacity_bytes}")
    if fsync not in fsync_policies:
        raise InvalidParameter(f"fsync must be one of {fsync_policies}, got {fsync!r}")
    if not isinstance(namespace, bytes | str):
        raise InvalidParameter(f"namespace must be bytes or str, got {type(namespace).__name__}")
    if not isinstance(timeout, int | float) or isinstance(timeout, bool) or not timeout > 0:
        raise InvalidParameter(f"write_timeout_s must be a number > 0, got {timeout!r}")
    if not isinstance(path, str | os.PathLike):
        raise InvalidParameter(f"path must be a str or path, got {type(path).__name__}")
    root = Path(path)
    if not root.is_absolute():
        raise InvalidParameter(f"FileStorage path must be absolute, got {str(root)!r}")
    return root
