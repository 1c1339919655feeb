"""A KV-event publisher on 127.0.0.1 for tests of event subscribers: it frames and replays as
vLLM's and SGLang's `ZmqEventPublisher` do (PUB `[topic, seq, payload]`; ROUTER replay from a
start sequence, `[seq, payload]` replies ending with seq -1), and msgpack batches in vLLM's
newest wire form (`batch`, `chain`). Used by the prefix index's subscriber tests and the
`kvstrata index subscribe` CLI test."""

from __future__ import annotations

import threading
import time

import msgspec
import zmq

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
