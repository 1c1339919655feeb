"""The page file format of FileStorage, and the reads and writes of one page file.

Page file = a 64-byte msgpack header `[b"KVSP", FORMAT_VERSION, namespace fingerprint (16 bytes),
key id (16 bytes: xxh3_128 of the key), payload length (8 bytes LE), xxh3_64 of the payload
(8 bytes LE)]`, then the payload. Every field has a fixed width, so the header has one length and
its fields sit at fixed offsets: a reader compares the constant prefix (magic, version,
namespace) and the key id, and slices the two integers out, without running a msgpack decoder
per page (any msgpack reader still decodes it).

The checksum is xxh3_64 (the `xxhash` package): it guards against torn and damaged files, not
against someone who can write the directory (they could write a valid checksum too), so a
cryptographic hash would buy nothing. xxh3 runs at ~10-14 GB/s here against ~2-3.5 GB/s for
zlib.crc32 and ~1.2 GB/s for sha256, which matters because the checksum pass is the one CPU cost
of a read that plain file I/O does not have.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import mmap
import os
import stat
from typing import NamedTuple

import msgpack
import xxhash

MAGIC = b"KVSP"
#: 1: variable-width header with a crc32; 2: fixed-width header with an xxh3_64. A page of any
#: other version is a miss and is removed (its key simply gets written again).
FORMAT_VERSION = 2

_log = logging.getLogger(__name__)


def namespace_fingerprint(namespace: bytes | str) -> bytes:
    """16 bytes naming the layout a page was written for (model, dtype, page size, ...)."""
    data = namespace.encode("utf-8") if isinstance(namespace, str) else bytes(namespace)
    return hashlib.sha256(b"kvstrata.storage.file-namespace\x00" + data).digest()[:16]


def page_checksum(payload: bytes | bytearray | memoryview) -> int:
    """The checksum a page file carries for `payload` (xxh3_64, seed 0). Holds the GIL (the
    xxhash package does not release it), unlike the file system calls around it."""
    return xxhash.xxh3_64_intdigest(payload)


def key_id(key: bytes) -> bytes:
    """The 16 bytes a page file carries to name its key (xxh3_128 of the key)."""
    return xxhash.xxh3_128_digest(key)


def encode_header(fingerprint: bytes, key: bytes, payload_bytes: int, checksum: int) -> bytes:
    """The header of a page file: always HEADER_BYTES long for a 16-byte fingerprint."""
    packed = msgpack.packb(
        [
            MAGIC,
            FORMAT_VERSION,
            fingerprint,
            key_id(key),
            payload_bytes.to_bytes(8, "little"),
            checksum.to_bytes(8, "little"),
        ]
    )
    assert isinstance(packed, bytes), "msgpack.packb returns bytes without a stream"
    return packed


HEADER_BYTES = len(encode_header(bytes(16), b"", 0, 0))
#: msgpack's markers of a 16-byte and an 8-byte bin, in front of the fields of those widths.
BIN16, BIN8 = b"\xc4\x10", b"\xc4\x08"
#: Field offsets: [marker, magic, version, fingerprint, BIN16][key id][BIN8][length][BIN8][sum]
CHECKSUM_AT = HEADER_BYTES - 8
LENGTH_AT = CHECKSUM_AT - len(BIN8) - 8
KEY_ID_AT = LENGTH_AT - len(BIN8) - 16


def _check_layout() -> None:
    head = encode_header(bytes(16), b"", 0, 0)
    assert head[KEY_ID_AT - 2 : KEY_ID_AT] == BIN16, "header layout: key id marker"
    assert head[LENGTH_AT - 2 : LENGTH_AT] == BIN8, "header layout: length marker"
    assert head[CHECKSUM_AT - 2 : CHECKSUM_AT] == BIN8, "header layout: checksum marker"


_check_layout()


class Probe(NamedTuple):
    """An open page file whose header was read. `valid` is False when any header check failed
    (then the other fields are zero). `pending`: the header is not read yet, because it was not
    in the page cache and the read asked not to wait (`valid` is False meanwhile)."""

    fd: int
    valid: bool
    payload_bytes: int
    checksum: int
    pending: bool = False


#: preadv flag: fail with EAGAIN instead of waiting for the disk (Linux >= 4.14); None elsewhere.
RWF_NOWAIT: int | None = getattr(os, "RWF_NOWAIT", None)
#: What a read with RWF_NOWAIT raises when it would wait, or when the file system or kernel
#: does not support the flag: either way, the page takes the blocking path.
WOULD_WAIT = frozenset((errno.EAGAIN, errno.EOPNOTSUPP, errno.EINVAL))
#: The granularity at which the page cache holds file data (a nowait read stops only there).
_MEMORY_PAGE = mmap.PAGESIZE


def pread_nowait(fd: int, size: int) -> bytes | None:
    """`os.pread(fd, size, 0)` if the bytes are in the page cache, else None (never waits)."""
    assert RWF_NOWAIT is not None, "only called where RWF_NOWAIT exists"
    buf = bytearray(size)
    try:
        got = os.preadv(fd, [buf], 0, RWF_NOWAIT)
    except OSError as exc:
        if exc.errno in WOULD_WAIT:
            return None
        raise
    return bytes(buf[:got])


#: Payload bytes read per preadv: the checksum runs over each chunk right after the kernel wrote
#: it into the caller's buffer, while it is still in the L2 cache (half of a 512 KiB one), so
#: a read and its check cost one pass over memory instead of two.
READ_CHUNK = 256 << 10


def read_payload(
    probe: Probe, view: memoryview, spare: bytearray, *, nowait: bool = False
) -> bool | None:
    """Read the payload into `view` and check its length and checksum (hashed chunk by chunk
    as it arrives, `READ_CHUNK`). `spare` takes the byte after the payload in the last
    preadv, so a file longer than its header says costs no extra call; a short file hits end
    of file first. With `nowait` (RWF_NOWAIT), None as soon as a read would wait for the disk
    (`view` then holds part of the payload): the caller reads the page again without the
    flag."""
    done, end = 0, probe.payload_bytes
    flags = RWF_NOWAIT if nowait and RWF_NOWAIT is not None else 0
    state = xxhash.xxh3_64()
    try:
        spare_tried = False  # whether the last read reached for the byte after the payload
        while done < end:
            stop = min(done + READ_CHUNK, end)
            last = stop == end
            n = os.preadv(
                probe.fd, [view[done:stop], spare] if last else [view[done:stop]],
                HEADER_BYTES + done, flags,
            )  # fmt: skip
            if n == 0:
                return False  # shorter than its header says: truncated
            # A blocking read stops short of the spare byte only at end of file. A nowait read
            # also stops where the page cache runs out, which is always a memory-page
            # boundary: stopping anywhere else is end of file too. Only a stop exactly on a
            # boundary is ambiguous and costs the probe below (a file ends on one only when
            # header + payload is a multiple of the page size).
            off_boundary = (HEADER_BYTES + done + n) % _MEMORY_PAGE != 0
            spare_tried = last and (not flags or n > end - done or off_boundary)
            state.update(view[done : min(done + n, end)])
            done += n
        if done > end:
            return False  # longer than its header says
        if not spare_tried and os.preadv(probe.fd, [spare], HEADER_BYTES + end, flags):
            return False  # longer than its header says
    except OSError as exc:
        if flags and exc.errno in WOULD_WAIT:
            return None
        _log.warning("cannot read page payload: %s", exc)
        return False
    return state.intdigest() == probe.checksum


def write_all(fd: int, header: bytes, view: memoryview) -> None:
    """writev until everything is written (a regular file may take a short write)."""
    pending = [v for v in (memoryview(header), view) if v.nbytes]
    while pending:
        n = os.writev(fd, pending)
        if n == 0:
            raise OSError(errno.EIO, "writev wrote nothing")
        while n:
            if n >= pending[0].nbytes:
                n -= pending.pop(0).nbytes
            else:
                pending[0] = pending[0][n:]
                n = 0


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass  # already gone: another process removed it
    except OSError as exc:
        _log.warning("cannot remove %s: %s", path, exc)


def write_temp(
    path: str, temp: str, header: bytes, view: memoryview, *, recycled: bool, fsync: bool
) -> int | None:
    """Write header + payload to the temp file `temp` beside `path`: a fresh file, or, when
    `recycled`, an evicted page's file already renamed there (rewritten from offset 0 and
    cut to length); `fsync`: fsync it. The open fd, or None on an I/O error (then nothing is
    left)."""
    try:
        if recycled:
            fd = os.open(temp, os.O_WRONLY)
        else:
            try:
                fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileNotFoundError:  # the fan-out directory, made on first use
                os.makedirs(os.path.dirname(temp), exist_ok=True)
                fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError as exc:
        _log.warning("cannot create %s: %s", temp, exc)
        if recycled:
            unlink_quietly(temp)
        return None
    try:
        write_all(fd, header, view)
        if recycled:
            size = len(header) + view.nbytes
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)
        if fsync:
            os.fsync(fd)
    except BaseException as exc:
        # Also on MemoryError or KeyboardInterrupt: no descriptor or temp file outlives it.
        os.close(fd)
        unlink_quietly(temp)
        if not isinstance(exc, OSError):
            raise
        _log.warning("cannot write page %s: %s", path, exc)
        return None
    return fd


class PageCodec:
    """Writes headers and opens and checks page files for one namespace fingerprint."""

    def __init__(self, fingerprint: bytes) -> None:
        self.fingerprint = fingerprint
        # The first KEY_ID_AT bytes of every page file of this namespace: compared, not decoded.
        self.header_prefix = encode_header(fingerprint, b"", 0, 0)[:KEY_ID_AT]

    def header(self, key: bytes, payload_bytes: int, checksum: int) -> bytes:
        """encode_header(fingerprint, key, ...), from the precomputed prefix."""
        return b"".join(
            (
                self.header_prefix,
                key_id(key),
                BIN8,
                payload_bytes.to_bytes(8, "little"),
                BIN8,
                checksum.to_bytes(8, "little"),
            )
        )

    def open(self, key: bytes, path: str, *, nowait: bool = False) -> Probe | None:
        """Open a page file and check its header; None when it is missing or unreadable
        (O_NONBLOCK: a FIFO at the path opens at once and its read fails, instead of waiting
        for a writer). The file's length is not checked here: `_read_payload` catches a short
        or long file in the read it does anyway, which saves an fstat per page."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        except OSError as exc:
            _log.warning("cannot open page %s: %s", path, exc)
            return None
        return self.read_header(key, path, fd, nowait=nowait)

    def read_header(self, key: bytes, path: str, fd: int, *, nowait: bool = False) -> Probe | None:
        """Read and check the header of the open page file `fd`; None (and `fd` closed) when it
        cannot be read (also a FIFO, socket or directory: pread fails on them). With `nowait`,
        a header that is not in the page cache is not waited for: the probe comes back
        `pending` (fd open) for a blocking call later."""
        try:
            head = pread_nowait(fd, HEADER_BYTES) if nowait else os.pread(fd, HEADER_BYTES, 0)
        except OSError as exc:
            os.close(fd)
            _log.warning("cannot read page %s: %s", path, exc)
            return None
        if head is None:
            return Probe(fd, False, 0, 0, pending=True)
        # A header of another version or namespace fails the prefix comparison (a version 1
        # header differs from byte 7 on, the version field); a file of another key (a recycled
        # inode read through an old descriptor, a misplaced file) fails the key id.
        if (
            len(head) == HEADER_BYTES
            and head.startswith(self.header_prefix)
            and head[KEY_ID_AT : KEY_ID_AT + 16] == key_id(key)
            and head[LENGTH_AT - 2 : LENGTH_AT] == BIN8
            and head[CHECKSUM_AT - 2 : CHECKSUM_AT] == BIN8
        ):
            payload_bytes = int.from_bytes(head[LENGTH_AT : LENGTH_AT + 8], "little")
            checksum = int.from_bytes(head[CHECKSUM_AT:], "little")
            return Probe(fd, True, payload_bytes, checksum)
        return Probe(fd, False, 0, 0)

    def reads_back(self, key: bytes, path: str, payload_bytes: int | None) -> bool | None:
        """Read the page at `path` afresh and check it whole (header, length, checksum; and
        its payload length when given). None when no regular file can be opened there."""
        probe = self.open(key, path)
        if probe is None:
            return None
        try:
            if not stat.S_ISREG(os.fstat(probe.fd).st_mode):
                return None
            if not probe.valid or payload_bytes not in (None, probe.payload_bytes):
                return False
            scratch = memoryview(bytearray(probe.payload_bytes))
            return bool(read_payload(probe, scratch, bytearray(1)))
        finally:
            os.close(probe.fd)
