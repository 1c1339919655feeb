"""Cluster replay on Ray (`kvstrata replay --instances N --ray`): `RayCluster`, the
`ClusterBackend` whose instances are Ray actors, and `local_ray`, a loopback cluster.

Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER when it is imported: set to 0 it binds every socket
of a cluster this process starts to 127.0.0.1 (RAY_NOTES.md). It is set here, before any module
of this package imports ray, unless the environment already says otherwise.
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# Under `uv run`, Ray would start every worker with `uv run` too and ship the working tree to
# the cluster; the workers already run in this interpreter's environment.
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
# A loaded machine can take longer than Ray's default 30 s to register a raylet.
os.environ.setdefault("RAY_raylet_start_wait_time_s", "120")
os.environ.setdefault("RAY_agent_register_timeout_ms", "120000")

from kvstrata.replay_ray.driver import RayCluster, local_ray

__all__ = ["RayCluster", "local_ray"]
