"""The ZMQ subscriber against a real publisher on 127.0.0.1 that frames and replays as vLLM's
and SGLang's `ZmqEventPublisher` do (PUB `[topic, seq, payload]`; ROUTER replay from a start
sequence, `[seq, payload]` replies ending with seq -1)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from kvstrata.cli.main import main as cli_main
from kvstrata.prefix_index import PrefixIndex
from kvstrata.prefix_index.subscriber import Subscriber

PAGE = 16
TOPIC = b"kv@test"


def batch(block: int, parent: int | None, tokens: list[int]) -> bytes:
    # vLLM's newest wire form: map-encoded EventBatch with one map-encoded BlockStored.
    event = {
        "type": "BlockStored",
        "block_hashes": [block],
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": PAGE,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    return msgspec.msgpack.encode({"ts": time.time(), "events": [event]})


def chain(n: int) -> tuple[list[bytes], list[int]]:
    """n batches, each storing one block chained to the previous one."""
    tokens = list(range(n * PAGE))
    out = [
        batch(100 + i, None if i == 0 else 99 + i, tokens[i * PAGE : (i + 1) * PAGE])
        for i in range(n)
    ]
    return out, tokens


class Publisher:
    """PUB + replay ROUTER on loopback; `buffer` holds what replay can still serve."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.router = self.ctx.socket(zmq.ROUTER)
        rport = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.replay_endpoint = f"tcp://127.0.0.1:{rport}"
        self.buffer: dict[int, bytes] = {}
        self.replay_requests: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def send(self, seq: int, payload: bytes, *, live: bool = True, keep: bool = True) -> None:
        if keep:
            self.buffer[seq] = payload
        if live:
            self.pub.send_multipart([TOPIC, seq.to_bytes(8, "big"), payload])

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(20):
                continue
            ident, _, start = self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            self.replay_requests.append(first)
            for seq in sorted(self.buffer):
                if seq >= first:
                    self.router.send_multipart(
                        [ident, b"", seq.to_bytes(8, "big"), self.buffer[seq]]
                    )
            self.router.send_multipart([ident, b"", (-1).to_bytes(8, "big", signed=True), b""])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.pub.close(linger=0)
        self.router.close(linger=0)
        self.ctx.term()


@pytest.fixture
def publisher() -> Iterator[Publisher]:
    pub = Publisher()
    yield pub
    pub.close()


def join(pub: Publisher, sub: Subscriber, first: bytes) -> None:
    """Send batch 0 until the subscriber sees it (PUB drops messages sent before the SUB's
    subscription reaches it); the repeats are duplicates and are skipped."""
    deadline = time.monotonic() + 10
    while sub.stats.batches == 0:
        assert time.monotonic() < deadline, "subscriber never received the first batch"
        pub.send(0, first)
        sub.poll(50)


def pages(index: PrefixIndex, tokens: list[int]) -> int:
    m = index.find_matches(tokens).by_instance.get("engine")
    return 0 if m is None else m.num_pages


def test_in_order_and_duplicates(publisher: Publisher) -> None:
    index = PrefixIndex(PAGE)
    sub = Subscriber(index, endpoint=publisher.endpoint, instance="engine", topic=b"kv")
    batches, tokens = chain(3)
    join(publisher, sub, batches[0])
    publisher.send(1, batches[1])
    publisher.send(2, batches[2])
    publisher.send(2, batches[2])  # a duplicate
    while sub.stats.batches < 3:
        sub.poll(200)
    sub.poll(100)
    assert pages(index, tokens) == 3
    assert sub.stats.duplicates >= 1 and sub.stats.gaps == 0
    sub.close()


def test_gap_is_filled_from_the_replay_socket(publisher: Publisher) -> None:
    index = PrefixIndex(PAGE)
    sub = Subscriber(
        index,
        endpoint=publisher.endpoint,
        instance="engine",
        replay_endpoint=publisher.replay_endpoint,
    )
    batches, tokens = chain(4)
    join(publisher, sub, batches[0])
    publisher.send(1, batches[1], live=False)  # lost on the wire, kept for replay
    publisher.send(2, batches[2], live=False)
    publisher.send(3, batches[3])
    while sub.stats.batches < 4:
        sub.poll(200)
    assert publisher.replay_requests == [1]
    assert sub.stats.gaps == 1 and sub.stats.replayed == 2 and sub.stats.resyncs == 0
    assert pages(index, tokens) == 4
    sub.close()


def test_gone_range_drops_the_instance_and_resyncs(publisher: Publisher) -> None:
    index = PrefixIndex(PAGE)
    sub = Subscriber(
        index,
        endpoint=publisher.endpoint,
        instance="engine",
        replay_endpoint=publisher.replay_endpoint,
    )
    batches, tokens = chain(3)
    join(publisher, sub, batches[0])
    assert pages(index, tokens) == 1
    publisher.send(1, batches[1], live=False, keep=False)  # gone from the replay buffer too
    fresh = batch(500, None, list(range(1000, 1000 + PAGE)))
    publisher.send(2, fresh)
    while sub.stats.resyncs == 0 or sub.stats.batches < 2:
        sub.poll(200)
    assert sub.stats.gaps == 1 and sub.stats.resyncs == 1
    # The old entries went with the drop; the batch after the gap is indexed.
    assert pages(index, tokens) == 0
    assert index.find_matches(list(range(1000, 1000 + PAGE))).by_instance["engine"].num_pages == 1
    # A child of a block the resynced map never saw is an orphan, not a wrong key.
    publisher.send(3, batches[2])
    while sub.stats.batches < 3:
        sub.poll(200)
    assert index.stats().num_entries == 1
    sub.close()


def test_cli_subscribe(publisher: Publisher, capsys: pytest.CaptureFixture[str]) -> None:
    batches, _ = chain(3)
    stop = threading.Event()

    def feed() -> None:
        # One thread owns the PUB socket: batch 0 until the CLI's SUB has surely joined, then
        # batches 1 and 2, then 2 again now and then (a duplicate; a missed 1 is replayed).
        start = time.monotonic()
        while not stop.is_set() and time.monotonic() - start < 2.0:
            publisher.send(0, batches[0])
            time.sleep(0.05)
        publisher.send(1, batches[1])
        while not stop.is_set():
            publisher.send(2, batches[2])
            time.sleep(0.2)

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    try:
        rc = cli_main(
            [
                "index",
                "subscribe",
                "--endpoint",
                publisher.endpoint,
                "--instance",
                "engine",
                "--replay-endpoint",
                publisher.replay_endpoint,
                "--max-batches",
                "3",
                "--duration",
                "20",
            ]
        )
    finally:
        stop.set()
        feeder.join(timeout=2)
    assert rc == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["batches"] == 3 and last["entries"] == 3
