"""The direct shard channel (ZMQ on loopback) without Ray: a `ChannelServer` over an in-process
`IndexShard`, and its failures (a dead server, a silent one, a method that raises, a method not
served), each bounded in time."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import zmq

from kvstrata.prefix_index.channel import (
    METHODS,
    ChannelPool,
    ChannelServer,
    ShardChannel,
    is_loopback,
)
from kvstrata.prefix_index.cluster import IndexShard
from kvstrata.prefix_index.errors import InvalidParameter, ShardCallFailed, ShardUnavailable
from kvstrata.unified_radix_cache import BlockRemoved, BlockStored, encode_events

KEYS = tuple(bytes([i]) * 32 for i in range(1, 6))


@pytest.fixture
def served() -> Iterator[tuple[IndexShard, ChannelServer]]:
    shard = IndexShard(1)
    server = ChannelServer(shard)
    yield shard, server
    server.close()


def stored(keys: tuple[bytes, ...]) -> bytes:
    return encode_events([BlockStored(page_keys=keys, parent_key=None, tokens_per_page=1)])


def test_round_over_the_channel_matches_the_shard_in_process(
    served: tuple[IndexShard, ChannelServer],
) -> None:
    shard, server = served
    assert server.address.startswith("tcp://127.0.0.1:")
    twin = IndexShard(1)  # the same calls in process
    channel = ShardChannel("s", server.address, timeout_s=5)
    try:
        items = [("a", 0, stored(KEYS)), ("b", 0, stored(KEYS[:2]))]
        got = channel.call("round", [list(KEYS)], items)
        want = twin.round([list(KEYS)], items)
        # msgpack turns tuples into lists; the contents are the same.
        assert got == [want[0], want[1], want[2]]
        assert got[2] == [True, True]
        removed = encode_events([BlockRemoved(page_keys=KEYS[3:])])
        got = channel.call("round", [list(KEYS)], [("a", 1, removed)])
        assert got[0] == [{"a": 5, "b": 2}]  # a round looks up before it applies
        assert channel.call("match_batch", [list(KEYS)])[0] == [{"a": 3, "b": 2}]
        # A gap (seq 5 where 2 is next) answers "needs dump" as in process.
        assert channel.call("apply_batches", [("a", 5, stored(KEYS))]) == [False]
        channel.call("load_dump", "a", stored(KEYS[:1]), 6)
        assert channel.call("match_batch", [list(KEYS)])[0] == [{"a": 1, "b": 2}]
        assert shard.stats()["entries"] == channel.call("stats")["entries"] == 2
        assert channel.call("echo", {"x": [1, b"y"]}) == {"x": [1, b"y"]}
    finally:
        channel.close()


def test_pipelined_requests_are_served_in_order(served: tuple[IndexShard, ChannelServer]) -> None:
    shard, server = served
    channel = ShardChannel("s", server.address, timeout_s=5)
    try:
        # 50 numbered batches in flight at once: any reordering would be a gap.
        rids = [
            channel.send("apply_batches", ([("a", seq, stored((KEYS[seq % 5],)))],))
            for seq in range(50)
        ]
        for rid in reversed(rids):  # replies wait for whoever asks, in any order
            assert channel.recv(rid) == [True]
        assert shard.stats()["gaps"] == 0
        assert server.served == 50
    finally:
        channel.close()


def test_a_method_that_raises_is_reported_and_the_channel_stays_usable(
    served: tuple[IndexShard, ChannelServer],
) -> None:
    _, server = served
    channel = ShardChannel("s", server.address, timeout_s=5)
    try:
        with pytest.raises(ShardCallFailed, match="EventDecodeError"):
            channel.call("apply_batches", [("a", 0, b"not msgpack")])
        with pytest.raises(ShardCallFailed, match="TypeError"):
            channel.call("round", "too", "many", "args")
        assert channel.call("echo", 7) == 7
    finally:
        channel.close()


def test_unserved_methods_are_refused_before_sending(
    served: tuple[IndexShard, ChannelServer],
) -> None:
    _, server = served
    channel = ShardChannel("s", server.address, timeout_s=5)
    try:
        with pytest.raises(InvalidParameter, match="drop_instance"):
            channel.send("drop_instance", ("a",))
        # A raw client sending one anyway gets an error reply, and nothing ran.
        ctx = zmq.Context.instance()
        raw = ctx.socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(server.address)
        raw.send_multipart([b"\0" * 8, b"drop_instance", b"\x91\xa1a"])
        assert raw.poll(5000)
        _, status, _ = raw.recv_multipart()
        assert status == b"err"
        raw.close()
        assert channel.call("echo", 1) == 1
    finally:
        channel.close()
    assert "drop_instance" not in METHODS
    with pytest.raises(InvalidParameter, match="timeout_s"):
        ShardChannel("s", server.address, timeout_s=0)
    with pytest.raises(InvalidParameter, match="methods"):
        ChannelServer(object())


# A shard process that takes requests and never answers, until it is killed.
_MUTE_SHARD = """
import sys, time, zmq
sock = zmq.Context.instance().socket(zmq.ROUTER)
port = sock.bind_to_random_port("tcp://127.0.0.1")
print(port, flush=True)
while True:
    if sock.poll(100):
        sock.recv_multipart()
        print("got", flush=True)
"""


def test_a_dead_shard_process_fails_the_waiting_receive_at_once() -> None:
    proc = subprocess.Popen([sys.executable, "-c", _MUTE_SHARD], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        channel = ShardChannel("s", f"tcp://127.0.0.1:{port}", timeout_s=60)
        rid = channel.send("echo", (1,))
        assert proc.stdout.readline().strip() == "got"  # the request is in the shard
        proc.kill()  # the shard's process dies: the kernel closes its connection
        start = time.monotonic()
        with pytest.raises(ShardUnavailable, match="disconnected"):
            channel.recv(rid)
        assert time.monotonic() - start < 10  # at once, not after the 60 s timeout
        assert channel.closed
        with pytest.raises(ShardUnavailable, match="closed"):
            channel.send("echo", (3,))
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_a_silent_server_times_out() -> None:
    # A ROUTER that accepts the connection and never answers (a hung shard).
    ctx = zmq.Context.instance()
    mute = ctx.socket(zmq.ROUTER)
    mute.setsockopt(zmq.LINGER, 0)
    port = mute.bind_to_random_port("tcp://127.0.0.1")
    channel = ShardChannel("s", f"tcp://127.0.0.1:{port}", timeout_s=0.3)
    try:
        start = time.monotonic()
        with pytest.raises(ShardUnavailable, match="no answer"):
            channel.call("echo", 1)
        assert 0.25 < time.monotonic() - start < 5
        assert channel.closed
    finally:
        mute.close()


def test_nobody_listening_times_out() -> None:
    ctx = zmq.Context.instance()
    probe = ctx.socket(zmq.ROUTER)
    port = probe.bind_to_random_port("tcp://127.0.0.1")
    probe.close(linger=0)  # a port nobody listens on now
    channel = ShardChannel("s", f"tcp://127.0.0.1:{port}", timeout_s=0.3)
    with pytest.raises(ShardUnavailable):
        channel.call("stats")


def test_is_loopback() -> None:
    assert is_loopback("tcp://127.0.0.1:5555") and is_loopback("tcp://[::1]:5555")
    assert is_loopback("tcp://localhost:5555") and is_loopback("tcp://127.0.0.2:1")
    assert not is_loopback("tcp://10.0.0.3:5555") and not is_loopback("tcp://[fe80::1]:5")


def test_a_pool_reaches_loopback_shards_only_on_their_own_host(
    served: tuple[IndexShard, ChannelServer],
) -> None:
    """A shard on another host that listens on loopback is unreachable: `get` says None (the
    caller goes through Ray) instead of connecting to its own host's loopback."""
    _, server = served
    hosts = {"here": "10.0.0.1", "there": "10.0.0.2"}
    pool = ChannelPool(lambda n: (server.address, hosts[n]), lambda: "10.0.0.1", timeout_s=5)
    try:
        assert pool.get("there") is None
        here = pool.get("here")
        assert here is not None and pool.get("here") is here  # kept open
        assert here.call("echo", 7) == 7
    finally:
        pool.close()
    assert here.closed


def test_a_pool_drops_only_the_channel_that_failed(
    served: tuple[IndexShard, ChannelServer],
) -> None:
    """A late failure of an old channel must not drop (and leak) the newer one."""
    _, server = served
    pool = ChannelPool(lambda n: (server.address, "h"), lambda: "h", timeout_s=5)
    try:
        old = pool.get("s")
        assert old is not None
        old.close()  # failed: the next get opens a new one
        new = pool.get("s")
        assert new is not None and new is not old
        pool.drop("s", old)  # the old one's late failure callback
        assert pool.get("s") is new and not new.closed
        pool.drop("s", new)
        again = pool.get("s")
        assert again is not None and again is not new
        new.close()
    finally:
        pool.close()


def test_a_pool_refuses_a_shard_without_a_channel() -> None:
    pool = ChannelPool(lambda n: None, lambda: "h", timeout_s=5)
    with pytest.raises(ShardUnavailable, match="serves no direct channel"):
        pool.get("s")


def test_a_result_the_channel_cannot_encode_is_an_error_and_the_server_keeps_serving() -> None:
    """Packing a result inside the server's guard: an unencodable answer is a ShardCallFailed
    for that call, and the next call is answered (the serving thread did not die)."""

    class Odd(IndexShard):
        def echo(self, value: object) -> object:
            return object() if value == "odd" else value

    server = ChannelServer(Odd(1))
    channel = ShardChannel("s", server.address, timeout_s=5)
    try:
        with pytest.raises(ShardCallFailed):
            channel.call("echo", "odd")
        assert channel.call("echo", 3) == 3
    finally:
        channel.close()
        server.close()
