"""The direct shard channel (TCP on loopback) without Ray: a `ChannelServer` over an in-process
`IndexShard`, and its failures (a dead server, a silent one, a method that raises, a method not
served), each bounded in time."""

from __future__ import annotations

import contextlib
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from kvstrata.prefix_index.channel import (
    MAGIC,
    MAX_BODY,
    METHODS,
    ChannelPool,
    ChannelServer,
    ShardChannel,
    is_loopback,
    request_frame,
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
        with raw_client(server) as raw:
            raw.sendall(b"".join(request_frame(9, b"drop_instance", b"\x91\xa1a")))
            magic, rid, status, size = struct.unpack("<4sQBI", raw.recv(17, socket.MSG_WAITALL))
            assert (magic, rid, status) == (MAGIC, 9, 1)
            assert b"not served" in raw.recv(size, socket.MSG_WAITALL)
        assert channel.call("echo", 1) == 1
    finally:
        channel.close()
    assert "drop_instance" not in METHODS
    with pytest.raises(InvalidParameter, match="timeout_s"):
        ShardChannel("s", server.address, timeout_s=0)
    with pytest.raises(InvalidParameter, match="methods"):
        ChannelServer(object())
    with pytest.raises(InvalidParameter, match="send_timeout_s"):
        ChannelServer(IndexShard(1), send_timeout_s=0)


def raw_client(server: ChannelServer) -> socket.socket:
    host, _, port = server.address.removeprefix("tcp://").rpartition(":")
    return socket.create_connection((host, int(port)), timeout=5)


# A shard process that takes requests and never answers, until it is killed.
_MUTE_SHARD = """
import socket
listener = socket.create_server(("127.0.0.1", 0))
print(listener.getsockname()[1], flush=True)
conn, _ = listener.accept()
while conn.recv(1 << 16):
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
        if proc.stdout is not None:
            proc.stdout.close()


def test_a_silent_server_times_out() -> None:
    # A listener whose backlog takes the connection and that never answers (a hung shard).
    mute = socket.create_server(("127.0.0.1", 0))
    port = mute.getsockname()[1]
    channel = ShardChannel("s", f"tcp://127.0.0.1:{port}", timeout_s=0.3)
    try:
        start = time.monotonic()
        with pytest.raises(ShardUnavailable, match="no answer"):
            channel.call("echo", 1)
        assert 0.25 < time.monotonic() - start < 5
        assert channel.closed
    finally:
        mute.close()


def test_nobody_listening_fails_at_once() -> None:
    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # a port nobody listens on now: the connect is refused
    start = time.monotonic()
    with pytest.raises(ShardUnavailable, match="cannot connect"):
        ShardChannel("s", f"tcp://127.0.0.1:{port}", timeout_s=30)
    assert time.monotonic() - start < 10


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


def test_frames_split_anywhere_and_large_frames_arrive_whole(
    served: tuple[IndexShard, ChannelServer],
) -> None:
    """TCP is a stream: a request written a few bytes at a time is served once whole, and a
    frame larger than the socket buffers (partial sends both ways) arrives intact."""
    _, server = served
    with raw_client(server) as raw:
        frame = b"".join(request_frame(4, b"echo", b"\x91\xa2hi"))
        for i in range(0, len(frame), 3):
            raw.sendall(frame[i : i + 3])
            time.sleep(0.002)
        magic, rid, status, size = struct.unpack("<4sQBI", raw.recv(17, socket.MSG_WAITALL))
        assert (magic, rid, status) == (MAGIC, 4, 0)
        assert raw.recv(size, socket.MSG_WAITALL) == b"\xa2hi"
    channel = ShardChannel("s", server.address, timeout_s=30)
    try:
        big = bytes(range(256)) * (48 * 1024)  # 12 MiB
        assert channel.call("echo", big) == big
        assert channel.call("echo", 2) == 2
    finally:
        channel.close()


@pytest.mark.parametrize(
    "header",
    [b"JUNK" + bytes(13), struct.pack("<4sQBI", MAGIC, 1, 4, MAX_BODY + 1)],
    ids=["bad-magic", "body-too-large"],
)
def test_a_peer_not_speaking_the_protocol_is_disconnected(
    served: tuple[IndexShard, ChannelServer], header: bytes
) -> None:
    _, server = served
    with raw_client(server) as raw:
        raw.sendall(header + b"echo")
        assert raw.recv(1) == b""  # closed by the server, nothing answered
    channel = ShardChannel("s", server.address, timeout_s=5)
    try:
        assert channel.call("echo", 5) == 5  # the others are still served
    finally:
        channel.close()


def test_a_client_that_reads_nothing_blocks_no_one_and_is_dropped() -> None:
    """Replies a client does not read wait in its connection's buffer (its further requests
    are not read meanwhile); other clients are served; after `send_timeout_s` without the
    client reading, the server drops it."""
    server = ChannelServer(IndexShard(1), send_timeout_s=0.5, poll_ms=20)
    try:
        with raw_client(server) as greedy:
            big = b"\xc6" + struct.pack(">I", 4 << 20) + bytes(4 << 20)  # msgpack bin32
            frame = b"".join(request_frame(0, b"echo", b"\x91" + big))
            greedy.settimeout(0.2)
            for _ in range(16):  # 64 MiB of replies: more than the socket buffers hold
                try:
                    greedy.sendall(frame)
                except TimeoutError:
                    break  # the server stopped reading this client: backpressure
            channel = ShardChannel("s", server.address, timeout_s=5)
            try:
                start = time.monotonic()
                assert channel.call("echo", 1) == 1
                assert time.monotonic() - start < 2
            finally:
                channel.close()
            time.sleep(1.0)  # past send_timeout_s: dropped
            greedy.settimeout(5)
            got = 0
            # What the kernel held, then the end (EOF, or a reset: the server closed with
            # unread requests); a server still holding the connection times this out.
            with contextlib.suppress(ConnectionResetError):
                while chunk := greedy.recv(1 << 20):
                    got += len(chunk)
            assert got < 16 * len(frame)
    finally:
        server.close()


def test_the_server_outlives_a_failed_accept_and_a_connection_that_breaks_its_loop(
    served: tuple[IndexShard, ChannelServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Out of descriptors at accept() (EMFILE) and an unexpected error while serving one
    connection: the one server thread goes on (it died on both, leaving the shard advertising
    a dead address), and new clients are served."""
    import errno

    _, server = served
    listener = server._listener  # pyright: ignore[reportPrivateUsage]
    real_accept = listener.accept
    failures = [OSError(errno.EMFILE, "Too many open files")]

    class Flaky:
        def __getattr__(self, name: str) -> object:
            return getattr(listener, name)

        def accept(self) -> tuple[socket.socket, object]:
            if failures:
                raise failures.pop()
            return real_accept()

    monkeypatch.setattr(server, "_listener", Flaky())
    channel = ShardChannel("s", server.address, timeout_s=5)
    try:
        assert channel.call("echo", 3) == 3
        assert server.accept_errors == 1
    finally:
        channel.close()
    broken = ShardChannel("t", server.address, timeout_s=2)
    monkeypatch.setattr(server, "_dispatch", lambda *_: 1 / 0)  # a bug in the handling
    with pytest.raises(ShardUnavailable):
        broken.call("echo", 4)
    assert server.connection_errors == 1
    monkeypatch.undo()
    again = ShardChannel("u", server.address, timeout_s=5)
    try:
        assert again.call("echo", 5) == 5
    finally:
        again.close()


def test_a_request_over_the_frame_limit_is_refused_before_sending(
    served: tuple[IndexShard, ChannelServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvstrata.prefix_index import channel as channel_module

    _, server = served
    channel = ShardChannel("s", server.address, timeout_s=5)
    try:
        monkeypatch.setattr(channel_module, "MAX_BODY", 64)
        with pytest.raises(InvalidParameter, match="frame limit"):
            channel.send("echo", (b"x" * 100,))
        assert not channel.closed
        monkeypatch.undo()
        assert channel.call("echo", 6) == 6  # nothing was sent: the next id is still served
    finally:
        channel.close()


def test_a_second_get_of_an_answer_returns_it_again_without_waiting(
    served: tuple[IndexShard, ChannelServer],
) -> None:
    """Reading an answer twice (as a Ray ref can be) neither waits the timeout nor closes a
    healthy channel; a failed answer raises the same error again."""
    _, server = served
    channel = ShardChannel("s", server.address, timeout_s=2)
    dropped: list[str] = []
    try:
        answer = channel.submit("echo", (8,), lambda: dropped.append("s"))
        start = time.monotonic()
        assert answer.get() == 8 and answer.get() == 8
        assert time.monotonic() - start < 1.5 and not channel.closed and not dropped
        bad = channel.submit("apply_batches", ([("a", 0, b"not msgpack")],), lambda: None)
        with pytest.raises(ShardCallFailed) as first:
            bad.get()
        with pytest.raises(ShardCallFailed) as second:
            bad.get()
        assert first.value is second.value
        assert channel.call("echo", 9) == 9
    finally:
        channel.close()
