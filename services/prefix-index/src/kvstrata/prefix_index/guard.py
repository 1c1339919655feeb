"""`Guard`: one call of a Python-core `PrefixIndex` at a time.

Python code can run in the middle of an index call: a finalizer the garbage collector runs at
any allocation, a key's `__hash__` / `__eq__`, an event's attribute, the keyer. A call of the
same index made from there would reach its entries half updated, so it raises `ReentrantCall`
before it changes anything, and the running call goes on. The same refusal meets a call from a
second thread while one runs (the index is not thread-safe; the shard serialises its calls
under a lock). Guarded: every method that changes entries or walks them (`apply*`,
`load_dump`, `drop_instance`, `find_matches`, `match_lengths`, `score`, `holdings`,
`check_integrity`). Not guarded: the plain reads (`stats`, `len`, `instances`,
`evicted_entries`, `native_bytes`, `needs_dump`), which a metrics scrape makes from its own
thread and which see a running call's changes made so far.

The native core is its own guard (`with core:`, `Core.hold` / `Core.release`, checked by its
public methods too). On the Python core the flag is `Guard.busy`, which `PrefixIndex.apply`,
`find_matches` and `match_lengths` test and set inline (no `with` on those hot paths) and the
other methods take with `with guard:`.
"""

from __future__ import annotations

from kvstrata.prefix_index.errors import ReentrantCall


class Guard:
    """`with guard:` around a method of the index: ReentrantCall on entry when a call of the
    index runs (`busy`)."""

    __slots__ = ("busy",)

    def __init__(self) -> None:
        self.busy = False

    def __enter__(self) -> None:
        if self.busy:
            raise ReentrantCall
        self.busy = True

    def __exit__(self, *_: object) -> None:
        self.busy = False
