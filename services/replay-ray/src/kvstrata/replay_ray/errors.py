"""Errors of the Ray cluster replay. Each is a `kvstrata.replay.ReplayError`, so the CLI reports
it (exit 2) like any other replay error."""

from __future__ import annotations

from kvstrata.replay.errors import ReplayError


class RayReplayError(ReplayError):
    """Base class of this package's errors."""


class InvalidRayOption(RayReplayError):
    """A bad option (storage URL, L3 size, timeout), refused before Ray is touched."""


class InstanceFailed(RayReplayError):
    """An instance actor (or a service it needs) died or did not answer within the timeout."""


class RayDidNotStart(RayReplayError):
    """The loopback cluster did not come up (an overloaded machine)."""
