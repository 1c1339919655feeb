"""`Subscriber`: feed a `PrefixIndex` from one engine's ZMQ KV-event stream (vLLM or SGLang).

The engines publish on a PUB socket, frames `[topic, seq (8-byte big-endian), payload]`, and keep
recent batches for replay on a ROUTER socket: a client sends an 8-byte start sequence and gets
`[seq, payload]` messages for every buffered batch from there, then `[-1, b""]`.

    next expected seq e, message seq s:
      s == e        apply, e = s + 1
      s <  e        duplicate: skip
      s >  e        gap: replay from e; apply what comes back in order; if the replay does not
                    start at e (the range is gone) or does not answer, drop the instance's
                    entries and resync from s (its engine-hash map goes too: blocks whose
                    parents were never seen are skipped as orphans until new roots arrive)

The first message sets e (a subscriber that joins late starts from what it sees).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import zmq

from kvstrata.prefix_index.errors import EngineDecodeError, InvalidParameter
from kvstrata.prefix_index.index import PrefixIndex

log = logging.getLogger(__name__)

END_SEQ = -1


@dataclass(kw_only=True)
class SubscriberStats:
    batches: int = 0
    duplicates: int = 0
    gaps: int = 0
    replayed: int = 0
    resyncs: int = 0
    decode_errors: int = 0


class Subscriber:
    """Subscribes to `endpoint` (connects), applies batches to `index` as `instance`.
    `replay_endpoint`: the publisher's ROUTER (None: every gap resyncs). `replay_timeout_ms`:
    how long a replay may stay silent before the range counts as gone."""

    def __init__(
        self,
        index: PrefixIndex,
        *,
        endpoint: str,
        instance: str,
        format: str = "vllm",
        replay_endpoint: str | None = None,
        topic: bytes = b"",
        replay_timeout_ms: int = 2000,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        if format not in ("vllm", "sglang"):
            raise InvalidParameter(f"format must be vllm or sglang, got {format!r}")
        if not instance:
            raise InvalidParameter("instance must be a non-empty name")
        if replay_timeout_ms < 1:
            raise InvalidParameter(f"replay_timeout_ms must be >= 1, got {replay_timeout_ms}")
        self.index = index
        self.instance = instance
        self.format = format
        self.replay_endpoint = replay_endpoint
        self.replay_timeout_ms = replay_timeout_ms
        self.stats = SubscriberStats()
        self.expected: int | None = None
        self._ctx = context if context is not None else zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic)
        self._sub.connect(endpoint)

    def poll(self, timeout_ms: int = 100) -> int:
        """Handle every message that arrives within `timeout_ms` (and those already queued);
        returns how many batches were applied."""
        applied = 0
        if not self._sub.poll(timeout_ms):
            return 0
        while True:
            try:
                frames = self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return applied
            applied += self._on_message(frames)

    def close(self) -> None:
        self._sub.close(linger=0)

    def _on_message(self, frames: list[bytes]) -> int:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.stats.decode_errors += 1
            log.warning("event message with %d frames skipped", len(frames))
            return 0
        seq = int.from_bytes(frames[1], "big", signed=True)
        if self.expected is not None and seq < self.expected:
            self.stats.duplicates += 1
            return 0
        applied = 0
        if self.expected is not None and seq > self.expected:
            self.stats.gaps += 1
            applied += self._recover(seq)
        applied += self._apply(seq, frames[2])
        return applied

    def _apply(self, seq: int, payload: bytes) -> int:
        self.expected = seq + 1
        try:
            self.index.apply_engine_batch(self.instance, payload, self.format)
        except EngineDecodeError as exc:
            self.stats.decode_errors += 1
            log.warning("batch %d of %s not decoded: %s", seq, self.instance, exc)
            return 0
        self.stats.batches += 1
        return 1

    def _recover(self, upto: int) -> int:
        """Replay batches expected..upto-1; on failure drop the instance and resync at upto."""
        start = self.expected
        assert start is not None
        replayed = self._replay(start, upto) if self.replay_endpoint is not None else None
        if replayed is None:
            self.stats.resyncs += 1
            self.index.drop_instance(self.instance)
            return 0
        applied = 0
        for seq, payload in replayed:
            applied += self._apply(seq, payload)
        self.stats.replayed += applied
        return applied

    def _replay(self, start: int, upto: int) -> list[tuple[int, bytes]] | None:
        """Batches start..upto-1 from the replay socket, or None if it cannot give them all."""
        assert self.replay_endpoint is not None
        dealer = self._ctx.socket(zmq.DEALER)
        try:
            dealer.connect(self.replay_endpoint)
            dealer.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
            got: list[tuple[int, bytes]] = []
            while True:
                if not dealer.poll(self.replay_timeout_ms):
                    return None
                frames = dealer.recv_multipart()
                if len(frames) != 3:
                    return None
                seq = int.from_bytes(frames[1], "big", signed=True)
                if seq == END_SEQ:
                    break
                if start <= seq < upto:
                    got.append((seq, frames[2]))
        finally:
            dealer.close(linger=0)
        if [s for s, _ in got] != list(range(start, upto)):
            return None
        return got
