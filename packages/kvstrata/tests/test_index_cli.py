"""`kvstrata index subscribe`: the CLI indexes the batches of a real publisher on 127.0.0.1
(testkit `kv_events.Publisher`; the subscriber itself is tested in services/prefix-index)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import pytest

from kvstrata.cli.main import main as cli_main
from kvstrata.testkit.kv_events import Publisher, chain


@pytest.fixture
def publisher() -> Iterator[Publisher]:
    pub = Publisher()
    yield pub
    pub.close()


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
