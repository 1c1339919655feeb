"""The ZMQ subscriber against a real publisher on 127.0.0.1 that frames and replays as vLLM's
and SGLang's `ZmqEventPublisher` do (PUB `[topic, seq, payload]`; ROUTER replay from a start
sequence, `[seq, payload]` replies ending with seq -1)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kvstrata.prefix_index import PrefixIndex
from kvstrata.prefix_index.subscriber import Subscriber
from kvstrata.testkit.kv_events import PAGE, Publisher, batch, chain


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
