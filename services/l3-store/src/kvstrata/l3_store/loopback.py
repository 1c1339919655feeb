"""Keep a Ray cluster this process starts on 127.0.0.1, whenever Ray was imported.

Ray decides a new node's address in the process that starts it, from a constant it reads when
it is imported (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`, RAY_NOTES.md): 0 gives 127.0.0.1, else the
machine's own interface address, on which the GCS, raylets and workers then listen. Setting
the variable only works when nothing imported Ray before, which a CLI or benchmark cannot
promise (the package imports run first): measured, a bench cluster listened on `*` and reported
the node at the interface address. `loopback_ray()` sets both the variable (read by the node
processes it spawns) and the constant (read by this process) for the block, and restores them.
Only for clusters started here: a driver joining a real multi-host cluster must not use it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from ray._private import ray_constants

#: The environment variable (and `ray_constants` flag) that keeps nodes on 127.0.0.1 when 0.
LOOPBACK_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@contextmanager
def loopback_ray() -> Iterator[None]:
    """Nodes started in this block, and this driver's node address, on 127.0.0.1."""
    saved_env = os.environ.get(LOOPBACK_SWITCH)
    saved_flag = ray_constants.ENABLE_RAY_CLUSTER
    os.environ[LOOPBACK_SWITCH] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag
        if saved_env is None:
            os.environ.pop(LOOPBACK_SWITCH, None)
        else:
            os.environ[LOOPBACK_SWITCH] = saved_env
