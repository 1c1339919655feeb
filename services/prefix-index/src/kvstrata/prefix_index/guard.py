"""`Guard`: one call of a `PrefixIndex` at a time.

Python code can run in the middle of an index call: a finalizer the garbage collector runs at
any allocation, a key's `__hash__` / `__eq__`, an event's attribute, the keyer. A call of the
same index made from there would reach its entries (or the C core's scratch buffers) half
updated, so it raises `ReentrantCall` before it changes anything, and the running call goes on.

On the native core the flag is the core's own (`Core.hold` / `Core.release`), which its public
methods check as well; on the Python core it is `busy` here, which `PrefixIndex.apply`,
`find_matches` and `match_lengths` test and set inline (no `with` on those hot paths).
"""

from __future__ import annotations

from kvstrata.prefix_index.errors import ReentrantCall
from kvstrata.prefix_index.native import Core


class Guard:
    """`with guard:` around a method of the index that makes several calls or runs Python code
    between its changes; raises ReentrantCall on entry when a call of the index runs."""

    __slots__ = ("busy", "core")

    def __init__(self, core: Core | None) -> None:
        self.core = core
        self.busy = False

    def __enter__(self) -> None:
        if self.core is not None:
            self.core.hold()
        elif self.busy:
            raise ReentrantCall
        else:
            self.busy = True

    def __exit__(self, *_: object) -> None:
        if self.core is not None:
            self.core.release()
        else:
            self.busy = False
