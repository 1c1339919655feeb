"""A direct data channel to a shard: one TCP connection per client to the shard's process,
set up through Ray (placement, discovery, death detection and restarts stay Ray's).

    client (router, publisher, bench)                 shard actor process
      ShardChannel: socket --- tcp://127.0.0.1:P ---> ChannelServer: one thread, selectors
        send(method, args) -> request id                 shard.<method>(*args) under its lock
        recv(request id)  <- header + result     <---   msgpack reply

Why: a Ray actor call costs ~0.3-1 ms of CPU on a loaded 2-core machine (task submission,
the raylet, serialization, the worker's event loop), which at a few tens of ops a round is the
floor of both the latency and the CPU per op. The channel was ZMQ (DEALER / ROUTER) first; its
I/O threads put four thread hand-offs more into each round trip than a plain socket (measured:
~100 us of caller CPU a call and p50 ~170 us for ZMQ, ~20 us and ~30 us for the socket), so the
channel is a plain TCP socket read and written by the caller's own thread.

Frames: a request is `_REQ` (magic, request id, method name length, body length), the method
name, then `msgpack(args)`; a reply is `_REP` (magic, request id, status, body length), then
`msgpack(result)` (status 0) or `msgpack([error type, message])` (status 1). The client sends the
parts with one `sendmsg` (no join), reads each reply into one buffer of its size, and msgpack
reads the buffer in place. Only the data-plane methods in `METHODS` are served (registration,
which carries a Ray actor handle, stays on Ray). The server serves one request at a time from
one thread, each connection's requests in the order sent (as Ray orders one caller's actor
calls): per-shard sequence numbers stay valid. A peer that sends anything but these frames (bad
magic, a body over `MAX_BODY`) is disconnected.

Failure: every blocking receive and send has a deadline (ShardUnavailable after it); a shard
process that dies has its connection closed by the kernel, and the waiting receive fails at once
with ShardUnavailable instead of waiting out the timeout; a port nobody listens on fails the
connect at once. A restarted shard actor listens on a new port: the client drops a failed
channel and asks Ray for the address again (`ClusterIndex` does this on the next call). The
server never blocks on a client: replies a client does not read wait in that connection's
buffer (its requests are not read meanwhile), and a client that reads nothing for
`send_timeout_s` is disconnected.
"""

from __future__ import annotations

import ipaddress
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgpack

from kvstrata.prefix_index.errors import InvalidParameter, ShardCallFailed, ShardUnavailable

#: The shard methods a channel serves (the data plane).
METHODS = frozenset(
    {"round", "match_batch", "apply_batches", "load_dump", "renew", "stats", "echo"}
)
MAGIC = b"KVX1"
#: The largest frame body a server reads (a bigger announced length closes the connection).
MAX_BODY = 1 << 30
_REQ = struct.Struct("<4sQBI")  # magic, request id, method name length, body length
_REP = struct.Struct("<4sQBI")  # magic, request id, status (0 ok, 1 error), body length
_OK = 0
_ERR = 1


def _pack(value: object) -> bytes:
    packed = msgpack.packb(value, use_bin_type=True)
    assert isinstance(packed, bytes), "msgpack.packb without a stream returns bytes"
    return packed


def _unpack(data: bytes | bytearray | memoryview) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def request_frame(rid: int, method: bytes, body: bytes) -> list[bytes]:
    """A request's parts, as `ShardChannel.send` writes them (tests write them raw)."""
    return [_REQ.pack(MAGIC, rid, len(method), len(body)), method, body]


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    return host.strip("[]"), int(port)


class _Conn:
    """The server's side of one client connection: bytes read and not yet served, replies
    not yet written, and since when the replies have waited."""

    __slots__ = ("inbox", "outbox", "sock", "stalled_since")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.inbox = bytearray()
        self.outbox = bytearray()
        self.stalled_since = 0.0


class ChannelServer:
    """Serves `METHODS` of `target` on a TCP socket bound to a free port of `host`, from one
    thread (started here, stopped by `close`). `address` is what clients connect to."""

    def __init__(
        self,
        target: object,
        *,
        host: str = "127.0.0.1",
        poll_ms: int = 100,
        send_timeout_s: float = 30.0,
    ) -> None:
        missing = sorted(m for m in METHODS if not callable(getattr(target, m, None)))
        if missing:
            raise InvalidParameter(f"a channel target needs the methods {missing}")
        if not send_timeout_s > 0:
            raise InvalidParameter(f"send_timeout_s must be > 0, got {send_timeout_s}")
        self._target = target
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, 0))
        self._listener.listen(64)
        self._listener.setblocking(False)
        port = self._listener.getsockname()[1]
        self.address = (
            f"tcp://[{host}]:{port}" if family == socket.AF_INET6 else (f"tcp://{host}:{port}")
        )
        self._poll_s = poll_ms / 1000
        self._send_timeout_s = send_timeout_s
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._stop = threading.Event()
        self.served = 0
        #: accept() calls that failed (EMFILE, ENOBUFS, ...; retried after a poll tick) and
        #: connections ended by an unexpected error in their handling.
        self.accept_errors = 0
        self.connection_errors = 0
        self._thread = threading.Thread(target=self._serve, name="shard-channel", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        selector = self._selector
        while not self._stop.is_set():
            for key, mask in selector.select(self._poll_s):
                conn: _Conn | None = key.data
                if conn is None:
                    self._accept()
                    continue
                try:
                    if mask & selectors.EVENT_WRITE:
                        self._flush(conn)
                    elif mask & selectors.EVENT_READ:
                        self._read(conn)
                except Exception:  # noqa: BLE001 - one connection's fault ends that connection
                    # The one server thread must outlive any client: the shard keeps
                    # advertising this address, so a dead thread would be a dead data plane.
                    self.connection_errors += 1
                    if conn.sock.fileno() != -1:
                        if conn.sock in selector.get_map():
                            selector.unregister(conn.sock)
                        conn.sock.close()
            self._drop_stalled()

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # out of descriptors or buffers, an aborted connect: wait, try again
            self.accept_errors += 1
            time.sleep(self._poll_s)
            return
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._selector.register(sock, selectors.EVENT_READ, _Conn(sock))

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(1 << 20)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # the client went away
            self._disconnect(conn)
            return
        inbox = conn.inbox
        inbox += data
        view = memoryview(inbox)
        at = 0
        replies: list[bytes] = []
        try:
            while len(inbox) - at >= _REQ.size:
                magic, rid, name_len, body_len = _REQ.unpack_from(inbox, at)
                if magic != MAGIC or body_len > MAX_BODY:
                    # not a client of this protocol: nothing to answer to
                    view.release()
                    self._disconnect(conn)
                    return
                end = at + _REQ.size + name_len + body_len
                if len(inbox) < end:
                    break
                start = at + _REQ.size
                method = bytes(view[start : start + name_len])
                # `_dispatch` answers every failure (packing included): the loop never dies.
                args = view[start + name_len : end]
                try:
                    status, body = self._dispatch(method, args)
                finally:
                    args.release()  # no export may outlive the call: `inbox` is resized
                replies += (_REP.pack(MAGIC, rid, status, len(body)), body)
                self.served += 1
                at = end
        finally:
            view.release()
        del inbox[:at]
        if replies:
            conn.outbox += b"".join(replies)
            self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        """Write what the socket takes now; waits for writability when it takes less."""
        try:
            sent = conn.sock.send(conn.outbox)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._disconnect(conn)
            return
        del conn.outbox[:sent]
        waiting = bool(conn.outbox)
        if waiting and not conn.stalled_since:
            conn.stalled_since = time.monotonic()
        elif not waiting:
            conn.stalled_since = 0.0
        # While replies wait, read no more requests (the client reads too slowly).
        events = selectors.EVENT_WRITE if waiting else selectors.EVENT_READ
        if self._selector.get_key(conn.sock).events != events:
            self._selector.modify(conn.sock, events, conn)

    def _drop_stalled(self) -> None:
        now = time.monotonic()
        for key in list(self._selector.get_map().values()):
            conn: _Conn | None = key.data
            if conn is None or not conn.stalled_since:
                continue
            if now - conn.stalled_since > self._send_timeout_s:
                self._disconnect(conn)

    def _disconnect(self, conn: _Conn) -> None:
        self._selector.unregister(conn.sock)
        conn.sock.close()

    def _dispatch(self, method: bytes, body: memoryview) -> tuple[int, bytes]:
        name = method.decode("utf-8", "replace")
        if name not in METHODS:
            return _ERR, _pack(["InvalidParameter", f"method {name!r} is not served"])
        try:
            args = _unpack(body)
            if not isinstance(args, list):
                raise InvalidParameter("channel arguments must be a list")
            return _OK, _pack(getattr(self._target, name)(*args))
        except Exception as exc:  # noqa: BLE001 (sent to the caller, who raises it)
            return _ERR, _pack([type(exc).__name__, str(exc)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5 * self._poll_s + 1)
        for key in list(self._selector.get_map().values()):
            key.fileobj.close()  # pyright: ignore[reportAttributeAccessIssue]
        self._selector.close()


class Pending:
    """An answer on its way: `get()` waits for it (Ray ref, channel request or a value)."""

    __slots__ = ("_error", "_get", "_value")

    def __init__(self, get: Callable[[], Any]) -> None:
        self._get: Callable[[], Any] | None = get
        self._value: Any = None
        self._error: BaseException | None = None

    def get(self) -> Any:
        """The answer; a second call returns it again (or raises the same error) without
        waiting on the channel a second time."""
        get = self._get
        if get is not None:
            self._get = None
            try:
                self._value = get()
            except BaseException as exc:
                self._error = exc
                raise
        if self._error is not None:
            raise self._error
        return self._value


class ShardChannel:
    """A client's connection to one shard's `ChannelServer`. `send` writes a request and
    returns its id; `recv(id)` waits for that reply (replies come in request order). Every wait
    is bounded by `timeout_s`; a dead peer (its connection closed) fails the wait at once, and
    so does a port nobody listens on (ShardUnavailable from the constructor).
    After any ShardUnavailable the channel is closed: make a new one (the shard may have
    restarted on another port)."""

    def __init__(self, name: str, address: str, *, timeout_s: float) -> None:
        if not timeout_s > 0:
            raise InvalidParameter(f"timeout_s must be > 0, got {timeout_s}")
        self.name = name
        self.address = address
        self.timeout_s = timeout_s
        self._next = 0
        self._replies: dict[int, tuple[int, bytearray]] = {}
        self._header = bytearray(_REP.size)
        self.closed = True  # until connected
        try:
            self._sock = socket.create_connection(_host_port(address), timeout=timeout_s)
        except OSError as exc:  # refused, unreachable, timed out
            raise ShardUnavailable(f"shard {name}: cannot connect to {address}: {exc}") from exc
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.closed = False

    def send(self, method: str, args: Sequence[object]) -> int:
        """Write `method(*args)` to the shard; InvalidParameter (nothing sent) for a method
        the channel does not serve or a request over the frame limit (`MAX_BODY`)."""
        if method not in METHODS:
            raise InvalidParameter(f"method {method!r} is not served on a channel")
        if self.closed:
            raise ShardUnavailable(f"shard {self.name}: channel closed")
        rid = self._next
        body = _pack(list(args))
        if len(body) > MAX_BODY:  # the server would drop the connection: refuse it here
            raise InvalidParameter(
                f"a {method} request of {len(body):,} bytes is over the channel's "
                f"{MAX_BODY:,}-byte frame limit"
            )
        parts = request_frame(rid, method.encode(), body)
        sock = self._sock
        try:
            sock.settimeout(self.timeout_s)
            total = sum(map(len, parts))
            sent = sock.sendmsg(parts)
            if sent < total:  # a large frame: the rest in order
                sock.sendall(b"".join(parts)[sent:])
        except OSError as exc:  # a timeout (a peer that reads nothing), reset, closed
            self.close()
            raise ShardUnavailable(
                f"shard {self.name}: could not send on {self.address} within "
                f"{self.timeout_s} s: {exc}"
            ) from exc
        self._next += 1
        return rid

    def _fill(self, buf: bytearray | memoryview, deadline: float) -> None:
        """Read exactly len(buf) bytes into `buf` by `deadline`."""
        view = memoryview(buf)
        got, want = 0, len(view)
        sock = self._sock
        while got < want:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            sock.settimeout(left)
            n = sock.recv_into(view[got:])
            if n == 0:
                raise ConnectionResetError("connection closed by the peer")
            got += n

    def recv(self, rid: int) -> Any:
        """The result of request `rid`. ShardUnavailable on a timeout or a closed connection
        (the channel is then closed); ShardCallFailed when the shard's method raised."""
        deadline = time.monotonic() + self.timeout_s
        while rid not in self._replies:
            if self.closed:
                raise ShardUnavailable(f"shard {self.name}: channel closed")
            try:
                self._fill(self._header, deadline)
                magic, got, status, size = _REP.unpack(self._header)
                if magic != MAGIC:
                    raise ConnectionResetError(f"not a channel reply (magic {magic!r})")
                body = bytearray(size)
                self._fill(body, deadline)
            except TimeoutError as exc:
                self.close()
                raise ShardUnavailable(
                    f"shard {self.name}: no answer on {self.address} within {self.timeout_s} s"
                ) from exc
            except OSError as exc:
                self.close()
                raise ShardUnavailable(
                    f"shard {self.name}: its channel {self.address} disconnected "
                    f"(shard died?): {exc}"
                ) from exc
            self._replies[got] = (status, body)
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
        self._sock.close()


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
