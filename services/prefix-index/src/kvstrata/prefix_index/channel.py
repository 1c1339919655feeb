"""A direct data channel to a shard: ZMQ between the clients and the shard's process, set up
through Ray (placement, discovery, death detection and restarts stay Ray's).

    client (router, publisher, bench)                 shard actor process
      ShardChannel: DEALER --- tcp://127.0.0.1:P ---> ChannelServer: ROUTER, one thread
        send(method, args) -> request id                 shard.<method>(*args) under its lock
        recv(request id)  <- [id, b"ok", result]  <---   msgpack reply

Why: a Ray actor call costs ~0.3-1 ms of CPU on a loaded 2-core machine (task submission,
the raylet, serialization, the worker's event loop), which at a few tens of ops a round is the
floor of both the latency and the CPU per op. A request on the channel is one msgpack frame
each way on a TCP socket the client keeps open.

Requests: `[id (8 bytes), method, msgpack(args)]`; replies `[id, b"ok", msgpack(result)]` or
`[id, b"err", msgpack([error type, message])]`. Only the data-plane methods in `METHODS` are
served (registration, which carries a Ray actor handle, stays on Ray). The server handles one
request at a time, in arrival order, so one client's requests reach the shard in the order it
sent them (as Ray orders one caller's actor calls): per-shard sequence numbers stay valid.

Failure: every blocking receive has a timeout (ShardUnavailable after it), and the client
watches its socket's monitor: when the shard's process dies its TCP connection closes and the
waiting receive fails at once with ShardUnavailable instead of waiting out the timeout. A
restarted shard actor listens on a new port: the client drops a failed channel and asks Ray for
the address again (`ClusterIndex` does this on the next call).
"""

from __future__ import annotations

import ipaddress
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import zmq

from kvstrata.prefix_index.errors import InvalidParameter, ShardCallFailed, ShardUnavailable

#: The shard methods a channel serves (the data plane).
METHODS = frozenset(
    {"round", "match_batch", "apply_batches", "load_dump", "renew", "stats", "echo"}
)
_ID = struct.Struct(">Q")
_OK = b"ok"
_ERR = b"err"


def _pack(value: object) -> bytes:
    packed = msgpack.packb(value, use_bin_type=True)
    assert isinstance(packed, bytes), "msgpack.packb without a stream returns bytes"
    return packed


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


class ChannelServer:
    """Serves `METHODS` of `target` on a ROUTER socket bound to a free port of `host`, from one
    thread (started here, stopped by `close`). `address` is what clients connect to."""

    def __init__(self, target: object, *, host: str = "127.0.0.1", poll_ms: int = 100) -> None:
        missing = sorted(m for m in METHODS if not callable(getattr(target, m, None)))
        if missing:
            raise InvalidParameter(f"a channel target needs the methods {missing}")
        self._target = target
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._poll_ms = poll_ms
        self._stop = threading.Event()
        self.served = 0
        self._thread = threading.Thread(target=self._serve, name="shard-channel", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        sock = self._sock
        while not self._stop.is_set():
            if not sock.poll(self._poll_ms):
                continue
            frames = sock.recv_multipart(copy=True)
            if len(frames) != 4:
                continue  # not a client of this protocol: nothing to answer to
            peer, rid, method, body = frames
            # `_dispatch` answers every failure (packing included): the loop never dies.
            sock.send_multipart([peer, rid, *self._dispatch(method, body)])
            self.served += 1

    def _dispatch(self, method: bytes, body: bytes) -> list[bytes]:
        name = method.decode("utf-8", "replace")
        if name not in METHODS:
            return [_ERR, _pack(["InvalidParameter", f"method {name!r} is not served"])]
        try:
            args = _unpack(body)
            if not isinstance(args, list):
                raise InvalidParameter("channel arguments must be a list")
            return [_OK, _pack(getattr(self._target, name)(*args))]
        except Exception as exc:  # noqa: BLE001 (sent to the caller, who raises it)
            return [_ERR, _pack([type(exc).__name__, str(exc)])]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5 * self._poll_ms / 1000 + 1)
        self._sock.close(linger=0)
        self._ctx.term()


class Pending:
    """An answer on its way: `get()` waits for it (Ray ref, channel request or a value)."""

    __slots__ = ("_get",)

    def __init__(self, get: Callable[[], Any]) -> None:
        self._get = get

    def get(self) -> Any:
        return self._get()


class ShardChannel:
    """A client's connection to one shard's `ChannelServer`. `send` queues a request and
    returns its id; `recv(id)` waits for that reply (replies come in request order). Every wait
    is bounded by `timeout_s`; a dead peer (its connection closed) fails the wait at once.
    After any ShardUnavailable the channel is closed: make a new one (the shard may have
    restarted on another port)."""

    def __init__(self, name: str, address: str, *, timeout_s: float) -> None:
        if not timeout_s > 0:
            raise InvalidParameter(f"timeout_s must be > 0, got {timeout_s}")
        self.name = name
        self.address = address
        self.timeout_s = timeout_s
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # A peer that never connects: a send blocks at the high-water mark, bounded like a recv.
        self._sock.setsockopt(zmq.SNDTIMEO, max(1, int(timeout_s * 1000)))
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._sock.connect(address)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._next = 0
        self._replies: dict[int, tuple[bytes, bytes]] = {}
        self.closed = False

    def send(self, method: str, args: Sequence[object]) -> int:
        """Queue `method(*args)` on the shard; InvalidParameter (nothing sent) for a method
        the channel does not serve."""
        if method not in METHODS:
            raise InvalidParameter(f"method {method!r} is not served on a channel")
        if self.closed:
            raise ShardUnavailable(f"shard {self.name}: channel closed")
        rid = self._next
        try:
            self._sock.send_multipart([_ID.pack(rid), method.encode(), _pack(list(args))])
        except zmq.Again as exc:
            self.close()
            raise ShardUnavailable(
                f"shard {self.name}: could not send on {self.address} within {self.timeout_s} s"
            ) from exc
        self._next += 1
        return rid

    def recv(self, rid: int) -> Any:
        """The result of request `rid`. ShardUnavailable on a timeout or a closed connection
        (the channel is then closed); ShardCallFailed when the shard's method raised."""
        while rid not in self._replies:
            if self.closed:
                raise ShardUnavailable(f"shard {self.name}: channel closed")
            events = dict(self._poller.poll(int(self.timeout_s * 1000)))
            if self._monitor in events and self._sock not in events:  # replies first
                self.close()
                raise ShardUnavailable(
                    f"shard {self.name}: its channel {self.address} disconnected (shard died?)"
                )
            if self._sock not in events:
                self.close()
                raise ShardUnavailable(
                    f"shard {self.name}: no answer on {self.address} within {self.timeout_s} s"
                )
            got, status, body = self._sock.recv_multipart()
            self._replies[_ID.unpack(got)[0]] = (status, body)
        status, body = self._replies.pop(rid)
        if status != _OK:
            kind, message = _unpack(body)
            raise ShardCallFailed(f"shard {self.name}: {kind}: {message}")
        return _unpack(body)

    def submit(
        self, method: str, args: Sequence[object], on_failure: Callable[[], object]
    ) -> Pending:
        """`send`; the answer's `get()` is `recv`, calling `on_failure` before a
        ShardUnavailable propagates (the owner drops this channel)."""
        rid = self.send(method, args)

        def answer() -> Any:
            try:
                return self.recv(rid)
            except ShardUnavailable:
                on_failure()
                raise

        return Pending(answer)

    def call(self, method: str, *args: object) -> Any:
        return self.recv(self.send(method, args))

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)
        self._ctx.term()


def is_loopback(address: str) -> bool:
    """Whether a `tcp://host:port` channel address is on the loopback interface."""
    host = address.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    return host == "localhost" or ipaddress.ip_address(host).is_loopback


class ChannelPool:
    """A client's direct channels, one per shard, opened on first use at the address
    `locate(name)` gives (`(address, host IP)`, None when the shard serves no channel), and
    dropped by whoever saw one fail (`drop`: only that channel, never a newer one)."""

    def __init__(
        self,
        locate: Callable[[str], tuple[str, str] | None],
        this_host: Callable[[], str],
        *,
        timeout_s: float,
    ) -> None:
        self._locate = locate
        self._this_host = this_host
        self.timeout_s = timeout_s
        self._open: dict[str, ShardChannel] = {}

    def get(self, name: str) -> ShardChannel | None:
        """Shard `name`'s open channel, or a new one; None when the shard listens on loopback
        on another host (unreachable from here). ShardUnavailable when the shard serves no
        channel (or `locate` raises it)."""
        got = self._open.get(name)
        if got is not None and not got.closed:
            return got
        found = self._locate(name)
        if found is None:
            raise ShardUnavailable(f"shard {name} serves no direct channel")
        address, host = found
        if is_loopback(address) and host != self._this_host():
            return None
        got = self._open[name] = ShardChannel(name, address, timeout_s=self.timeout_s)
        return got

    def drop(self, name: str, channel: ShardChannel) -> None:
        """`channel` failed: forget it if it is still shard `name`'s (the next call reopens)."""
        if self._open.get(name) is channel:
            del self._open[name]

    def close(self) -> None:
        for channel in self._open.values():
            channel.close()
        self._open.clear()
