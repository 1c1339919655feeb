"""Errors the replay job raises to its caller (the CLI prints them and exits with code 2)."""

from __future__ import annotations

from pathlib import Path


class ReplayError(Exception):
    """Base of every error of `kvstrata.replay`."""


class ReplayOptionError(ReplayError, ValueError):
    """An option of the replay job is out of range (page size, tokens per block, limit, ...)."""


class WorkloadSpecError(ReplayError, ValueError):
    """A workload parameter is out of range (raised by `WorkloadSpec`, before generating)."""


class TraceFormatError(ReplayError, ValueError):
    """A trace line is not a Mooncake request; names the file and the 1-based line number."""

    def __init__(self, path: Path | str, line_number: int, reason: str) -> None:
        super().__init__(f"{path}:{line_number}: {reason}")
        self.path = str(path)
        self.line_number = line_number
        self.reason = reason


class EmptyTrace(ReplayError, ValueError):
    """A trace file holds no request (it is empty or has only blank lines)."""

    def __init__(self, path: Path | str) -> None:
        super().__init__(f"no requests in {path}")
        self.path = str(path)


class CapacityTooSmall(ReplayError, ValueError):
    """The device cache cannot hold the longest request even with everything else evicted.

    Raised by `ReplayEngine.run` before the first request, so no state has changed.
    """

    def __init__(self, *, capacity_tokens: int, needed_tokens: int, request_index: int) -> None:
        super().__init__(
            f"capacity of {capacity_tokens} tokens cannot hold request {request_index}, "
            f"which needs {needed_tokens} tokens (page-rounded); raise --capacity-tokens "
            "(or --device-memory)"
        )
        self.capacity_tokens = capacity_tokens
        self.needed_tokens = needed_tokens
        self.request_index = request_index


class KVMismatch(ReplayError):
    """`verify=True` read back KV or Mamba state that differs from what was written for the hit's
    tokens: a lower layer handed out a slot holding someone else's data. A bug, not bad input."""


class ReferenceModelTooLarge(ReplayError, ValueError):
    """`--engine reference` on a model whose reference weights exceed the limit: the reference
    model computes every token on its own, which only a small config does in reasonable time."""

    def __init__(self, *, architecture: str, parameters: int, limit: int) -> None:
        super().__init__(
            f"{architecture} is too large for the reference engine: {parameters:,} weights, "
            f"the limit is {limit:,} (give a small config: hidden_size, num_hidden_layers, "
            "vocab_size)"
        )
        self.architecture = architecture
        self.parameters = parameters
        self.limit = limit


class RequestDoesNotFit(ReplayError, RuntimeError):
    """The reference engine cannot run a request even alone: the memory system is too small
    for one prompt plus its decoded tokens (raise the device budget)."""
