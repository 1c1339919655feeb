"""The compiled page copies (`kvstrata.pool.native`): same bytes as the NumPy / torch paths for
every family, dtype, page size and caller row stride, with and without non-temporal stores;
and the loader (build once into the cache, reuse, the off switch, no compiler)."""

from __future__ import annotations

import shutil
import stat
from pathlib import Path

import pytest
import torch

from kvstrata.pool import native, page_io
from kvstrata.pool.base import DevicePool
from kvstrata.pool.errors import BufferMismatch, DuplicateIndex, IndexOutOfRange, ReservedIndex
from kvstrata.testkit.pools import (
    fill_random_bytes,
    flat_pages,
    make_mha_pool,
    make_page_io_pool,
    page_io_cases,
)

needs_native = pytest.mark.skipif(
    native.native_copies() is None, reason=f"no compiled copies: {native.native_status()}"
)

LAYOUTS = ["mha", "mha-lines", "mha-two-stacks", "mla", "mamba"]
CASES = page_io_cases(LAYOUTS)


def twins(family: str, dtype: torch.dtype, page_size: int) -> tuple[DevicePool, DevicePool]:
    """A pool on the compiled path and one on the fallback, holding the same bytes."""
    fast = make_page_io_pool(family, dtype, page_size)
    with native.disabled():
        slow = make_page_io_pool(family, dtype, page_size)
    fill_random_bytes(fast, seed=3)
    fill_random_bytes(slow, seed=3)
    assert fast.native_page_copies and not slow.native_page_copies
    return fast, slow


@needs_native
@pytest.mark.parametrize("stream", [0, 1, 2], ids=["cached", "sse2", "best"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32], ids=str)
@pytest.mark.parametrize(("family", "page_size"), CASES)
def test_compiled_copies_move_the_same_bytes_as_the_fallback(
    family: str, page_size: int, dtype: torch.dtype, stream: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Plain stores, SSE2 streaming stores, and the best this CPU has (AVX2 here)."""
    monkeypatch.setattr(page_io, "STREAM_MIN_BYTES", 0 if stream else 1 << 62)
    monkeypatch.setattr(page_io, "STREAM_MODE", stream)
    fast, slow = twins(family, dtype, page_size)
    gen = torch.Generator().manual_seed(7)
    ids = torch.randperm(fast.num_pages - 1, generator=gen)[:9] + 1
    ids[-1] = ids[0]  # a read may list a page twice
    a = torch.empty((9, fast.page_size_bytes), dtype=torch.uint8)
    b = torch.empty_like(a)
    fast.read_pages(ids, a)
    slow.read_pages(ids, b)
    assert torch.equal(a, b)
    assert torch.equal(a, flat_pages(fast, ids.tolist()))

    targets = ids[:8]
    src = torch.randint(0, 256, (8, fast.page_size_bytes), generator=gen, dtype=torch.uint8)
    fast.write_pages(targets, src)
    slow.write_pages(targets, src)
    everything = range(fast.num_pages)
    assert torch.equal(flat_pages(fast, everything), flat_pages(slow, everything))
    assert torch.equal(flat_pages(fast, targets.tolist()), src)


@needs_native
@pytest.mark.parametrize("family", ["mha-lines", "mha-two-stacks", "mamba"])
def test_caller_rows_with_a_stride_and_int32_ids(family: str) -> None:
    """Rows of the caller's buffer need not be back to back: bytes beside them stay as they
    were, in both directions."""
    fast, slow = twins(family, torch.bfloat16, 1)
    ids = torch.tensor([5, 2, 9], dtype=torch.int32)
    wide = torch.full((3, fast.page_size_bytes + 64), 0xEE, dtype=torch.uint8)
    rows = wide[:, 32 : 32 + fast.page_size_bytes]
    fast.read_pages(ids, rows)
    assert torch.equal(rows, flat_pages(slow, ids.tolist()))
    assert (wide[:, :32] == 0xEE).all() and (wide[:, -32:] == 0xEE).all()
    rows.random_(0, 256)
    fast.write_pages(ids, rows)
    assert torch.equal(flat_pages(fast, ids.tolist()), rows)
    untouched = [p for p in range(fast.num_pages) if p not in (5, 2, 9)]
    assert torch.equal(flat_pages(fast, untouched), flat_pages(slow, untouched))


@needs_native
def test_errors_leave_the_pool_unchanged_on_the_compiled_path() -> None:
    fast, _ = twins("mha-lines", torch.bfloat16, 4)
    before = flat_pages(fast, range(fast.num_pages))
    src = torch.ones((2, fast.page_size_bytes), dtype=torch.uint8)
    refusals = (
        (torch.tensor([1, fast.num_pages]), IndexOutOfRange),
        (torch.tensor([0, 2]), ReservedIndex),
        (torch.tensor([3, 3]), DuplicateIndex),
    )
    for bad, error in refusals:
        with pytest.raises(error):
            fast.write_pages(bad, src)
    assert torch.equal(flat_pages(fast, range(fast.num_pages)), before)


def test_the_library_is_built_once_into_the_cache(tmp_path: Path) -> None:
    copies, reason = native.load(tmp_path)
    if copies is None:
        pytest.skip(reason)
    built = copies.path
    assert built.parent == tmp_path / "native" and built.exists()
    stamp = built.stat().st_mtime_ns
    again, _ = native.load(tmp_path)
    assert again is not None and again.path == built and built.stat().st_mtime_ns == stamp
    assert [p.name for p in built.parent.iterdir()] == [built.name], "no partial files left"


def test_the_switch_and_a_missing_compiler_keep_the_fallback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for off in ("0", "off", "False"):
        monkeypatch.setenv(native.ENV_SWITCH, off)
        copies, reason = native.load(tmp_path)
        assert copies is None and native.ENV_SWITCH in reason
    monkeypatch.delenv(native.ENV_SWITCH)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    copies, reason = native.load(tmp_path)
    assert copies is None and "no C compiler" in reason
    assert not (tmp_path / "native").exists()


def test_a_failing_build_is_reported_not_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(native.ENV_SWITCH, raising=False)
    fake = tmp_path / "cc"
    fake.write_text("#!/bin/sh\necho 'cannot compile today' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    copies, reason = native.load(tmp_path / "cache")
    assert copies is None and "cannot compile today" in reason
    leftovers = list((tmp_path / "cache" / "native").iterdir())
    assert leftovers == [], "a failed build leaves no partial library"


def test_pools_made_inside_disabled_use_the_fallback() -> None:
    with native.disabled():
        inside = make_mha_pool()
        with native.disabled():
            assert native.native_copies() is None
        assert native.native_copies() is None
    after = make_mha_pool()
    assert not inside.native_page_copies
    assert after.native_page_copies == (native.native_copies() is not None)


@needs_native
def test_a_corrupt_cached_library_is_rebuilt_and_a_shared_folder_refused(tmp_path: Path) -> None:
    # A file at the cache name that was never loaded (rewriting a loaded library in place
    # would pull pages from under this process: the builder only ever renames new files in).
    compiler = native._compiler()  # pyright: ignore[reportPrivateUsage]
    assert compiler is not None
    planted = native.library_path(native.SOURCE, compiler, tmp_path)
    planted.parent.mkdir(parents=True, mode=0o700)
    planted.write_bytes(b"\x7fELF truncated")
    again, reason = native.load(tmp_path)
    assert again is not None, reason
    assert again.path == planted and planted.stat().st_size > 1000
    shared = tmp_path / "shared"
    (shared / "native").mkdir(parents=True)
    (shared / "native").chmod(0o777)
    copies, reason = native.load(shared)
    assert copies is None and "not private" in reason


@needs_native
def test_a_cxx_compiler_or_a_compiler_with_arguments_works(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`extern "C"` keeps the symbols unmangled under a C++ compiler; `$CC` may carry
    arguments (`ccache gcc`)."""
    for cc in ("c++", "g++", "clang++"):
        if shutil.which(cc):
            monkeypatch.setenv("CC", f"{cc} -x c++")
            copies, reason = native.load(tmp_path / cc)
            assert copies is not None, reason
            break
    compiler = shutil.which("cc") or shutil.which("gcc")
    assert compiler is not None
    monkeypatch.setenv("CC", f"{compiler} -O2")
    copies, reason = native.load(tmp_path / "with-args")
    assert copies is not None, reason


@needs_native
def test_a_buffer_inside_the_pool_is_refused_on_every_path() -> None:
    fast, slow = twins("mha-lines", torch.bfloat16, 1)
    for pool in (fast, slow):
        stack = pool.layer_buffers()[0].view(torch.uint8)
        inside = stack.reshape(-1)[: 2 * pool.page_size_bytes].view(2, pool.page_size_bytes)
        before = flat_pages(pool, range(pool.num_pages))
        with pytest.raises(BufferMismatch, match="overlaps"):
            pool.read_pages(torch.tensor([3, 4]), inside)
        with pytest.raises(BufferMismatch, match="overlaps"):
            pool.write_pages(torch.tensor([3, 4]), inside)
        assert torch.equal(flat_pages(pool, range(pool.num_pages)), before)


def test_no_home_and_an_open_parent_folder_fall_back_with_a_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(native.ENV_SWITCH, raising=False)
    monkeypatch.delenv(native.ENV_CACHE, raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)

    def no_home() -> Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    made = native.build(native.SOURCE)
    assert made.library is None and "home directory" in made.reason
    open_parent = tmp_path / "open"
    open_parent.mkdir()
    open_parent.chmod(0o777)  # no sticky bit: "native" below it could be swapped
    made = native.build(native.SOURCE, open_parent)
    assert made.library is None and "sticky" in made.reason
    open_parent.chmod(0o777 | stat.S_ISVTX)  # like /tmp: fine
    made = native.build(native.SOURCE, open_parent)
    if native.native_copies() is not None:  # this machine has a compiler
        assert made.library is not None, made.reason


@needs_native
@pytest.mark.parametrize("n", [2, 31, 513, 900])
def test_the_c_id_checks_accept_distinct_ids_and_refuse_a_repeat(n: int) -> None:
    """Ids are checked in C on the fast path (a hash set on the stack up to 512 ids, on the
    heap past it); a refusal falls back to the Python checks, which raise."""
    pool = make_mha_pool(head_dim=32, size=1024, page_size=1)
    gen = torch.Generator().manual_seed(n)
    ids = torch.randperm(pool.num_pages - 1, generator=gen)[:n] + 1
    src = torch.randint(0, 256, (n, pool.page_size_bytes), generator=gen, dtype=torch.uint8)
    pool.write_pages(ids, src)
    back = torch.empty_like(src)
    pool.read_pages(ids.flip(0), back)
    assert torch.equal(back, src.flip(0))
    repeated = ids.clone()
    repeated[-1] = ids[(n - 1) // 2]
    before = flat_pages(pool, range(pool.num_pages))
    with pytest.raises(DuplicateIndex):
        pool.write_pages(repeated, src)
    with pytest.raises(ReservedIndex):
        pool.read_pages(torch.cat((ids[:-1], torch.tensor([0]))), back)
    pool.read_pages(torch.cat((ids[:-1], torch.tensor([0]))), back, allow_dummy=True)
    assert torch.equal(flat_pages(pool, range(pool.num_pages)), before)
    assert pool.counters.pages_written == n and pool.counters.pages_read == 2 * n


EXTENSION_C = """
#define PY_SSIZE_T_CLEAN
#include <Python.h>
static PyObject *twice(PyObject *self, PyObject *arg) {
    long long v = PyLong_AsLongLong(arg);
    if (v == -1 && PyErr_Occurred()) return NULL;
    return PyLong_FromLongLong(2 * v);
}
static PyMethodDef methods[] = {{"twice", twice, METH_O, NULL}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, "kvs_twice", NULL, -1, methods};
PyMODINIT_FUNC PyInit_kvs_twice(void) { return PyModule_Create(&def); }
"""


def test_an_extension_module_is_built_once_imported_and_refused_cleanly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = tmp_path / "twice.c"
    source.write_text(EXTENSION_C)
    made = native.build_extension(source, "kvs_twice", tmp_path / "cache")
    if made.module is None:
        pytest.skip(made.reason)
    assert made.module.twice(21) == 42
    with pytest.raises(TypeError):
        made.module.twice("21")
    assert made.path is not None and made.path.name.endswith(".so")
    stamp = made.path.stat().st_mtime_ns
    again = native.build_extension(source, "kvs_twice", tmp_path / "cache")
    assert again.path == made.path and made.path.stat().st_mtime_ns == stamp
    # A wrong module name is an import failure, reported and not raised.
    wrong = native.build_extension(source, "kvs_thrice", tmp_path / "other")
    assert wrong.module is None and "kvs_thrice" in wrong.reason
    with native.disabled():
        assert native.native_extension(source, "kvs_twice").module is None
    monkeypatch.setattr(native.sysconfig, "get_paths", lambda: {"include": str(tmp_path)})
    missing = native.build_extension(source, "kvs_twice", tmp_path / "cache")
    assert missing.module is None and "Python.h" in missing.reason
    monkeypatch.undo()
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    off = native.build_extension(source, "kvs_twice", tmp_path / "cache")
    assert off.module is None and native.ENV_SWITCH in off.reason


def test_joined_source_joins_the_parts_in_order_once_per_process(tmp_path: Path) -> None:
    parts = (tmp_path / "a_part.c", tmp_path / "b_part.c")
    parts[0].write_text("int a(void) { return 1; }\n")
    parts[1].write_text("int b(void) { return a() + 1; }\n")
    joined = native.joined_source(parts)
    assert joined.name == "a_part.c" and joined.parent != tmp_path
    assert joined.read_text() == parts[0].read_text() + parts[1].read_text()
    assert native.joined_source(parts) == joined  # written once
    assert native.joined_source(parts[::-1]).read_text().startswith("int b")
