"""Whether a CPU tensor's memory is the inside of an immutable Python `bytes` object.

torch has no read-only tensors: `torch.frombuffer(bytes(16))` only warns, and hands back a tensor
whose data pointer is the `bytes` object's own storage. Writing into it would change an object
Python treats as immutable (and may share: equal constants, interned values). `batch_get`
refuses such a tensor before writing anything (`InvalidBuffer`).

A `bytes` object keeps its data at a fixed offset after its header (`ob_refcnt`, `ob_type`,
`ob_size`, `ob_shash`), so for a tensor made over a whole `bytes` object the header sits right
before the tensor's data, and its `ob_type` word is the address of the `bytes` type. The check
reads that word only when it lies in the same memory page as the data (which is mapped, since
the tensor's data is), so it can never fault; a `bytes` object whose data starts exactly on a
page boundary, or a tensor starting inside one, goes undetected (the check is a guard against
a mistake, not a security boundary). No other allocation starts right after a word holding the
address of the `bytes` type.
"""

from __future__ import annotations

import ctypes
import mmap
import sys

#: Offset of a bytes object's data from its start (header size): sizeof(b"") minus the NUL.
_DATA_AT = sys.getsizeof(b"") - 1
#: Offsets of `ob_type` (after `ob_refcnt`) and of `ob_size` (after `ob_type`) in an object.
_TYPE_AT = ctypes.sizeof(ctypes.c_ssize_t)
_SIZE_AT = _TYPE_AT + ctypes.sizeof(ctypes.c_void_p)
_BYTES_TYPE = id(bytes)


def inside_bytes_object(address: int, nbytes: int) -> bool:
    """Whether `address .. address + nbytes` lies inside the data of a `bytes` object."""
    if address == 0 or address % mmap.PAGESIZE < _DATA_AT:
        return False
    start = address - _DATA_AT
    if ctypes.c_void_p.from_address(start + _TYPE_AT).value != _BYTES_TYPE:
        return False
    size = ctypes.c_ssize_t.from_address(start + _SIZE_AT).value
    return 0 <= nbytes <= size
