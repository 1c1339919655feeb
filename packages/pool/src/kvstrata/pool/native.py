"""Compiled page copies (`page_copy.c`) for CPU page I/O, built at first use; NumPy otherwise.

Why: at page size 1 a set of pages is thousands of pieces of a few hundred bytes at random
places (one per page and layer buffer), and every NumPy or torch gather copies them one
`memcpy` at a time, each waiting on its own cache misses: 0.5-0.65 of a contiguous copy of the
same bytes on the 2-core benchmark machine, whatever the call. The C loop keeps misses in
flight (software prefetch of the piece 8 positions ahead) and writes large copies with
non-temporal stores (no read of the destination lines first): at page size 1 about 1.0 of
that copy for reads and 0.8 for writes, 1.0-1.7 at page sizes 16 and 64 (medians of
`kvstrata bench pageio`; the pool README has the runs).

How it is built: the system C compiler (`$CC`, which may carry arguments, else `cc`, `gcc` or
`clang`) compiles the source with `-O3` once per machine into a cache folder
(`$KVSTRATA_CACHE_DIR`, else `$XDG_CACHE_HOME/kvstrata`, else `~/.cache/kvstrata`; the
`native` folder in it must be the user's own and closed to others, as must its parent unless
sticky), named by a hash of the source, compiler and machine, written to a temporary name and
renamed, so concurrent first uses agree; a cached file that will not load is rebuilt. Plain C
(`extern "C"` for C++ compilers), no Python headers: the library is loaded with ctypes, whose
calls release the GIL. `KVSTRATA_NATIVE=0` (or off / false / no) turns it off. When there is
no compiler or the build fails, `native_copies()` is None, `native_status()` says why, and
the pools keep their NumPy / torch paths (same bytes, slower at small pages).
`native_library(source)` builds other packages' C the same way (the allocator's decode round).
`native_extension(source, name)` builds a C source written against the Python C API into an
extension module of this interpreter (its headers, `EXT_SUFFIX` and version are part of the
cached name), for hot paths where a ctypes call and its argument conversion (about 1 us) cost
more than the work; without the headers it returns the reason, and callers keep their other path.
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import importlib.machinery
import importlib.util
import os
import platform
import shlex
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import NamedTuple, TypeVar

SOURCE = Path(__file__).with_name("page_copy.c")

#: Environment switch: "0" keeps every pool on its NumPy / torch path.
ENV_SWITCH = "KVSTRATA_NATIVE"
#: Environment override of the cache folder for the compiled library.
ENV_CACHE = "KVSTRATA_CACHE_DIR"

#: A call moving at least this many bytes writes with non-temporal stores: past the caches'
#: size the copy would only evict other data to hold what the caller reads once (a transfer
#: staging buffer, a storage page); below it the destination stays cached for the caller.
STREAM_MIN_BYTES = 1 << 20

#: The `stream` argument of the C copies for such calls: 2 = AVX2 non-temporal stores where the
#: CPU has them (checked at run time), else SSE2 ones; 1 = SSE2 (tests); 0 = plain stores.
#: AVX2 measured about 10 % faster than SSE2 on page-size-1 writes.
STREAM_MODE = 2

_FLAGS = ("-O3", "-shared", "-fPIC", "-std=c11")

_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p
_T = TypeVar("_T")


class NativeCopies:
    """The compiled `kv_copy` (see `page_copy.c` for the exact contract), as a ctypes function
    taking raw addresses and byte counts, positionally:

        copy(stack, num_pages, width, num_buffers, flat, row, offset, stride, ids, n, stream,
             check, allow_zero, scatter) -> 0 | refused

    piece (b, ids[i]) of `stack` -> `flat + i * row + offset + b * stride` (a gather), or the
    other way with `scatter`. With `check` the ids are checked first (range, page 0 unless
    `allow_zero`, repeats for a scatter) and a refusal (non-zero) copies nothing. Callers pass
    live buffers of the right geometry: the C code trusts them."""

    def __init__(self, library: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self.copy = library.kv_copy
        self.copy.argtypes = [_PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _I64, _PTR] + [_I64] * 5
        self.copy.restype = _I64


class NativeBuild(NamedTuple):
    """A compiled C source: the loaded library and its file, or None and why not."""

    library: ctypes.CDLL | None
    path: Path | None
    reason: str


class ExtensionBuild(NamedTuple):
    """A compiled extension module: the module and its file, or None and why not."""

    module: ModuleType | None
    path: Path | None
    reason: str


_lock = threading.Lock()
_builds: dict[Path, NativeBuild] = {}
_extensions: dict[tuple[Path, str], ExtensionBuild] = {}
_copies: NativeCopies | None = None
_disabled = 0


def native_library(source: Path) -> NativeBuild:
    """`source` built (or found in the cache) and loaded, once per process (thread-safe); a
    build with no library inside `disabled()`. Other packages' C sources use this too (the
    allocator's decode round)."""
    with _lock:
        if _disabled:
            return NativeBuild(None, None, "inside native.disabled()")
        found = _builds.get(source)
        if found is None:
            found = _builds[source] = build(source)
        return found


def native_extension(source: Path, name: str) -> ExtensionBuild:
    """`source` (C against the Python C API, defining `PyInit_<name>`) built as an extension
    module of this interpreter, or found in the cache, and imported, once per process
    (thread-safe); no module inside `disabled()`. The module is not put in `sys.modules`: the
    caller holds it."""
    with _lock:
        if _disabled:
            return ExtensionBuild(None, None, "inside native.disabled()")
        found = _extensions.get((source, name))
        if found is None:
            found = _extensions[source, name] = build_extension(source, name)
        return found


_joined: dict[tuple[Path, ...], Path] = {}


def joined_source(parts: tuple[Path, ...]) -> Path:
    """C files compiled as one translation unit (each under the 700-line limit): their text
    joined in order into one file, written once per process into a private temporary folder
    (removed at exit) and named after the first part. `native_extension` / `native_library`
    cache a build by the text they compile, so an edit of any part makes a new build, and the
    same text on the same machine builds once."""
    with _lock:
        path = _joined.get(parts)
        if path is None:
            folder = Path(tempfile.mkdtemp(prefix=f"kvstrata-{parts[0].stem}-"))
            atexit.register(shutil.rmtree, folder, ignore_errors=True)
            path = folder / parts[0].name
            path.write_bytes(b"".join(part.read_bytes() for part in parts))
            _joined[parts] = path
        return path


def native_copies() -> NativeCopies | None:
    """The compiled page copies; None when turned off, unavailable (see `native_status`) or
    inside `disabled()`. A pool asks once, when it is made."""
    global _copies
    made = native_library(SOURCE)
    if made.library is None or made.path is None:
        return None
    with _lock:
        if _copies is None:
            try:
                _copies = NativeCopies(made.library, made.path)
            except AttributeError:  # no such symbol: see native_status
                return None
        return _copies


def native_status() -> str:
    """Either `native: <library path>` or `numpy: <why the compiled copies are not used>`."""
    made = native_library(SOURCE)
    if made.library is None:
        return f"numpy: {made.reason}"
    if native_copies() is None:
        return f"numpy: {made.path} lacks kv_copy (built as C++?)"
    return f"native: {made.path}"


@contextmanager
def disabled() -> Iterator[None]:
    """Pools and allocators made inside this block keep their NumPy / torch paths (tests of
    the fallback, A/B comparisons); those made before or after are unaffected. Nests; not per
    thread."""
    global _disabled
    with _lock:
        _disabled += 1
    try:
        yield
    finally:
        with _lock:
            _disabled -= 1


def load(cache_dir: Path | None = None) -> tuple[NativeCopies | None, str]:
    """Build (or find in `cache_dir`) the page copies, bypassing the process cache; (None,
    reason) when they cannot be. For tests."""
    made = build(SOURCE, cache_dir)
    if made.library is None or made.path is None:
        return None, made.reason
    try:
        return NativeCopies(made.library, made.path), ""
    except AttributeError as exc:  # a library without the expected symbols
        return None, f"{made.path} lacks a symbol: {exc}"


def build(source: Path, cache_dir: Path | None = None) -> NativeBuild:
    """Compile `source` (plain C) into a shared library in the cache folder, unless a build of
    the same source, compiler and machine is there, and load it. A cached file that will not
    load is rebuilt once. Never raises for a missing compiler, a failed build, a cache folder
    others can write to, or a library that will not load: the reason is returned."""
    library, path, reason = _build_and_load(source, cache_dir, (), ".so", _load_library)
    return NativeBuild(library, path, reason)


def _load_library(path: Path) -> ctypes.CDLL:
    return ctypes.CDLL(str(path))


def build_extension(source: Path, name: str, cache_dir: Path | None = None) -> ExtensionBuild:
    """Compile `source` into an extension module `name` of this interpreter in the cache folder
    (unless built already) and import it; like `build`, never raises for a missing compiler or
    Python headers, a failed build or a module that will not import: the reason is returned."""
    include = sysconfig.get_paths().get("include", "")
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    if not include or not os.path.exists(os.path.join(include, "Python.h")):
        return ExtensionBuild(None, None, f"no Python headers (Python.h) in {include!r}")
    if not isinstance(suffix, str) or not suffix:
        return ExtensionBuild(None, None, "this interpreter names no extension suffix")

    def load(path: Path) -> ModuleType:
        loader = importlib.machinery.ExtensionFileLoader(name, str(path))
        spec = importlib.util.spec_from_file_location(name, path, loader=loader)
        if spec is None:
            raise OSError(f"no import spec for {path}")
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
        return module

    extra = ("-I", include, f"-DKVSTRATA_PYTHON={sys.hexversion:#x}")
    module, path, reason = _build_and_load(source, cache_dir, extra, suffix, load)
    return ExtensionBuild(module, path, reason)


def _build_and_load(
    source: Path,
    cache_dir: Path | None,
    extra: tuple[str, ...],
    suffix: str,
    load: Callable[[Path], _T],
) -> tuple[_T | None, Path | None, str]:
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in _OFF:
        return None, None, f"turned off by {ENV_SWITCH}"
    compiler = _compiler()
    if compiler is None:
        return None, None, "no C compiler ($CC, cc, gcc or clang) on PATH"
    try:
        folder = cache_dir if cache_dir is not None else _cache_dir()
        path = library_path(source, [*compiler, *extra], folder, suffix)
        _private_folder(path.parent)
        if path.exists():
            try:
                return load(path), path, ""
            except (OSError, ImportError):
                path.unlink()  # corrupt or truncated: build it again
        _compile(source, [*compiler, *extra], path, suffix)
        return load(path), path, ""
    except (OSError, ImportError, subprocess.SubprocessError, ValueError, RuntimeError) as exc:
        # RuntimeError: Path.home() with neither $HOME nor a passwd entry.
        return None, None, f"could not build or load {source.name}: {exc}"


#: Values of KVSTRATA_NATIVE that turn the compiled paths off.
_OFF = frozenset({"0", "false", "no", "off"})


def _compiler() -> list[str] | None:
    """The compiler command: `$CC` split like a shell would (`ccache gcc` works), else the
    first of cc, gcc, clang on PATH; None when there is none."""
    named = shlex.split(os.environ.get("CC", ""))
    if named:
        found = shutil.which(named[0])
        return [found, *named[1:]] if found else None
    found = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    return [found] if found else None


def _cache_dir() -> Path:
    explicit = os.environ.get(ENV_CACHE)
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    # The XDG spec: a relative value is invalid and ignored.
    return (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache") / "kvstrata"


def _private_folder(folder: Path) -> None:
    """Create `folder` (mode 0700) and refuse one that another user owns or others may write
    to: whatever library sits in it gets loaded into this process."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = folder.stat()
    if info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ValueError(
            f"cache folder {folder} is not private to this user (owner {info.st_uid}, "
            f"mode {stat.S_IMODE(info.st_mode):o}); set {ENV_CACHE} to one that is"
        )
    # Whoever may write to the folder above could rename this one away and put another in its
    # place; a sticky folder (like /tmp) lets only the owner do that.
    above = folder.parent.stat()
    if above.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not above.st_mode & stat.S_ISVTX:
        raise ValueError(
            f"{folder.parent} is writable by others without the sticky bit, so {folder.name} "
            f"could be replaced; set {ENV_CACHE} to a private folder"
        )


def library_path(source: Path, compiler: list[str], folder: Path, suffix: str = ".so") -> Path:
    """Where the library built from `source` (as it reads now) by `compiler` lives."""
    digest = hashlib.sha256()
    for part in (source.read_bytes(), " ".join(compiler).encode(), " ".join(_FLAGS).encode()):
        digest.update(part)
    digest.update(f"{platform.system()}-{platform.machine()}".encode())
    return folder / "native" / f"{source.stem}-{digest.hexdigest()[:20]}{suffix}"


def _compile(source: Path, compiler: list[str], path: Path, suffix: str = ".so") -> None:
    fd, partial = tempfile.mkstemp(dir=path.parent, prefix=".building-", suffix=suffix)
    os.close(fd)
    try:
        result = subprocess.run(
            [*compiler, *_FLAGS, "-o", partial, str(source)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if result.returncode != 0:
            raise OSError(f"{' '.join(compiler)} failed: {result.stderr.strip()[:500]}")
        os.replace(partial, path)  # atomic: a concurrent build ends with one of two equal files
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
