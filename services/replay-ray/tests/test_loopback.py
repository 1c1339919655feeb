"""A loopback cluster stays on 127.0.0.1 even when Ray was imported before anything set
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER (as under the CLI, whose package imports run first): each
start site runs in a fresh interpreter that imports Ray first, with the variable unset, and the
GCS and raylet must report and listen on 127.0.0.1 only. (Measured before the fix: the node at
the machine's interface address, every socket on `*`.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = """
import json, ray
{start}
def listening():
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in list(f)[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A":
                    address, port = local.split(":")
                    out.add((address, int(port, 16)))
    return out
with start() as gcs:
    node = ray.nodes()[0]
    ports = {{int(gcs.rsplit(":", 1)[1]): "gcs", node["NodeManagerPort"]: "raylet"}}
    bound = {{port: [a for a, p in listening() if p == port] for port in ports}}
    print("PROBE" + json.dumps({{"gcs": gcs, "node": node["NodeManagerAddress"],
                                "bound": {{ports[p]: v for p, v in bound.items()}}}}))
"""

STARTS = {
    "prefix-index localray": """
from contextlib import contextmanager
from kvstrata.prefix_index.localray import loopback_cluster
@contextmanager
def start():
    with loopback_cluster(num_workers=0) as cluster:
        yield cluster.address
""",
    "replay-ray local_ray": """
from kvstrata.replay_ray.driver import local_ray as start
""",
}

#: /proc/net/tcp's 127.0.0.1 (little-endian hex), and the same as an IPv4-mapped IPv6 address
#: (::ffff:127.0.0.1) in /proc/net/tcp6; `*` would read 00000000 or all zeros.
LOOPBACK = {"0100007F", "0000000000000000FFFF00000100007F"}


@pytest.mark.parametrize("site", list(STARTS))
def test_a_cluster_started_after_ray_was_imported_stays_on_loopback(site: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    code = PROBE.format(start=STARTS[site])
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    lines = [x for x in done.stdout.splitlines() if x.startswith("PROBE")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    seen = json.loads(lines[0].removeprefix("PROBE"))
    assert seen["gcs"].startswith("127.0.0.1:"), seen
    assert seen["node"] == "127.0.0.1", seen
    for name, addresses in seen["bound"].items():
        assert addresses and set(addresses) <= LOOPBACK, (name, seen)
