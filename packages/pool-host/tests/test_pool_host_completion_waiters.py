"""`LayerCompletion` makes a layer's Event only for its first waiter: waiters that come before,
during and after the marks (and a failure) see exactly what the producer did."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.pool_host import LayerCompletion
from kvstrata.pool_host.errors import LayerIdOutOfRange, LayerLoadFailed, LayerWaitTimeout

LAYERS = list(range(6))


def outcome(completion: LayerCompletion, layer: int) -> str:
    try:
        completion.wait(layer, timeout=10.0)
    except LayerLoadFailed:
        return "failed"
    return "loaded"


@settings(max_examples=30, deadline=None)
@given(
    order=st.permutations(LAYERS),
    fail_after=st.one_of(st.none(), st.integers(0, len(LAYERS) - 1)),
    early=st.lists(st.sampled_from(LAYERS), max_size=8),
)
def test_waiters_before_and_after_the_marks_see_what_the_producer_did(
    order: list[int], fail_after: int | None, early: list[int]
) -> None:
    completion = LayerCompletion(LAYERS)
    results: dict[int, list[str]] = {layer: [] for layer in LAYERS}
    lock = threading.Lock()

    def waiter(layer: int) -> None:
        got = outcome(completion, layer)
        with lock:
            results[layer].append(got)

    threads = [threading.Thread(target=waiter, args=(layer,)) for layer in early]
    for t in threads:
        t.start()
    marked = order if fail_after is None else order[:fail_after]
    for layer in marked:
        completion.mark_loaded(layer)
    if fail_after is not None:
        completion.fail(RuntimeError("copy engine fault"))
    for t in threads:
        t.join(10.0)
        assert not t.is_alive()
    want = {layer: "loaded" if layer in marked else "failed" for layer in LAYERS}
    for layer in early:
        assert set(results[layer]) == {want[layer]}
    for layer in LAYERS:  # late waiters
        assert outcome(completion, layer) == want[layer]
        assert completion.is_loaded(layer) == (layer in marked)
    assert completion.num_loaded == len(marked)


def test_a_waiter_times_out_then_a_later_mark_wakes_the_next() -> None:
    completion = LayerCompletion([0, 1])
    with pytest.raises(LayerWaitTimeout):
        completion.wait(1, timeout=0.01)
    woke = threading.Event()

    def waiter() -> None:
        completion.wait(1, timeout=10.0)
        woke.set()

    thread = threading.Thread(target=waiter)
    thread.start()
    completion.mark_loaded(1)
    thread.join(10.0)
    assert woke.is_set()
    with pytest.raises(LayerIdOutOfRange):
        completion.wait(2, timeout=0.01)
