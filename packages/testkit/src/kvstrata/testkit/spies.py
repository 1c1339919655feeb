"""Spies for tests of threaded code. `record_calls(monkeypatch, obj, name)` replaces
`obj.name`, for one test, by a wrapper that notes each call (the method's name, the calling
thread's name and the arguments) in a list and then runs the original, returning what it
returns. `Gate().wrap(fn)` holds every caller of `fn` until the test opens the gate.
`ResultSpy(inner, methods)` stands in for an object and keeps what those methods returned."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import pytest


@dataclass(frozen=True)
class Call:
    """One call a spy saw: `method` (the attribute spied on), `thread` (the calling thread's
    name), its positional and keyword arguments."""

    method: str
    thread: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


def record_calls(
    monkeypatch: pytest.MonkeyPatch, obj: object, name: str, into: list[Call] | None = None
) -> list[Call]:
    """Spy on `obj.name` until the test ends: each call is appended to `into` (a new list
    when None) before the original runs. Returns that list; pass it as `into` to several
    spies to see their calls in one order."""
    calls: list[Call] = [] if into is None else into
    original = getattr(obj, name)

    def spied(*args: Any, **kwargs: Any) -> Any:
        calls.append(Call(name, threading.current_thread().name, args, kwargs))
        return original(*args, **kwargs)

    monkeypatch.setattr(obj, name, spied)
    return calls


class Gate:
    """Blocks a wrapped function until opened: holds a worker inside its current batch.
    `entered` is set at the first call, `calls` counts them; every call waits for `opened`
    (at most `timeout_s`, then fails the test) before the function runs."""

    def __init__(self, timeout_s: float = 10.0) -> None:
        self.entered = threading.Event()
        self.opened = threading.Event()
        self.calls = 0
        self.timeout_s = timeout_s

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def gated(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            self.entered.set()
            assert self.opened.wait(self.timeout_s), "gate never opened"
            return fn(*args, **kwargs)

        return gated


class ResultSpy:
    """Stands in for an object (a compiled path's wrapper): a call of one of the `recorded`
    methods goes to `inner` and its result is kept in `results`, in call order; any other
    attribute is `inner`'s own."""

    def __init__(self, inner: object, recorded: Iterable[str]) -> None:
        self.inner = inner
        self.recorded = frozenset(recorded)
        self.results: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name not in self.recorded:
            return attr

        def recording(*args: Any) -> Any:
            result = attr(*args)
            self.results.append(result)
            return result

        return recording
