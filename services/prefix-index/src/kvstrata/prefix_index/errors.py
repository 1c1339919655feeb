"""Caller-visible failures of the prefix index. Each is raised before any state changes."""

from __future__ import annotations


class PrefixIndexError(Exception):
    """Base of every error this package raises on bad input."""


class InvalidParameter(PrefixIndexError, ValueError):
    """A constructor or call argument is out of range (page size, weights, capacity...)."""


class InvalidInstance(PrefixIndexError, ValueError):
    """An instance name is empty or not a string."""


class InvalidEvent(PrefixIndexError, ValueError):
    """A kvstrata event is malformed or does not fit this index (e.g. its page size)."""


class EngineDecodeError(PrefixIndexError, ValueError):
    """An engine's msgpack EventBatch cannot be decoded (not msgpack, wrong envelope)."""


class UnknownFormat(PrefixIndexError, ValueError):
    """An engine event format other than "vllm" or "sglang"."""


class UnknownPolicy(PrefixIndexError, ValueError):
    """A routing policy other than round_robin, least_loaded or cache_aware."""


class NoInstances(PrefixIndexError, LookupError):
    """The router has no instance to send a request to."""


class ShardUnavailable(PrefixIndexError, RuntimeError):
    """A shard actor did not answer (dead node, timeout); the caller may retry or fall back."""


class ShardCallFailed(PrefixIndexError, RuntimeError):
    """A shard method called over a direct channel raised; the message names its error."""


#: ReentrantCall's message, the same on both cores.
REENTERED = (
    "the prefix index was called again from inside one of its own calls (a finalizer, a key's "
    "__hash__ or __eq__, an event's attribute or another callback it ran): refused, and this "
    "call changed nothing"
)


class ReentrantCall(PrefixIndexError, RuntimeError):
    """A call of a `PrefixIndex` made while another call of the same index is running: from
    Python code that call runs (a finalizer the garbage collector calls, a key's `__hash__`, an
    event's attribute, a name's `__str__`, the interning or keying callback) or from a second
    thread. Raised before the refused call changes anything; the running call goes on."""

    def __init__(self, message: str = REENTERED) -> None:
        super().__init__(message)
