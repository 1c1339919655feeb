"""`kvstrata bench alloc --quick` runs end to end and prints the peer script's keys.

A smoke test of the benchmark's plumbing (workload generation, setup/teardown bookkeeping,
JSON lines); it asserts no time.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import cast

import numpy as np
import pytest

from kvstrata.bench import alloc as bench


def test_quick_run_prints_one_line_per_configuration(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--quick", "--no-peer", "--no-page-io", "--rounds", "3", "--page-sizes", "1,16"]
    assert bench.main(argv) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    batch_decode = lines.pop()
    assert batch_decode["workload"] == "batch_decode" and batch_decode["batch"] == 256
    assert batch_decode["ratio"] == (
        batch_decode["per_request_calls_s"] / batch_decode["batch_call_s"]
    )
    assert [(r["workload"], r["page_size"]) for r in lines] == [
        ("extend", 1),
        ("extend", 16),
        ("decode", 1),
        ("decode", 16),
    ]
    for record in lines:
        assert {"workload", "page_size", "tokens_per_s", "calls_per_s", "ratio"} <= set(record)
        assert record["tokens_per_s"] > 0 and record["peer_tokens_per_s"] is None
        assert set(record["variants"]) == {"numpy", "numpy-unchecked", "numpy-nocompile", "torch"}
        assert "check_cost" in record


def test_workloads_match_the_peer_definition() -> None:
    # First draws of default_rng(0), as alloc_bench.py makes them.
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, 2048, size=64, endpoint=True)
    ext = rng.integers(1, 512, size=64, endpoint=True)
    first = bench.extend_rounds(0, 2)[0]
    assert first.prefix_lens.tolist() == prefix.tolist()
    assert first.extend_lens.tolist() == ext.tolist()
    decode = bench.decode_rounds(0, 1)[0]
    assert (
        decode.tolist() == np.random.default_rng(0).integers(1, 4096, 256, endpoint=True).tolist()
    )


def test_rejects_unknown_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--quick", "--no-peer", "--variants", "nope"]) == 2
    assert "unknown variant" in capsys.readouterr().err


# A stand-in for shared/bench/peer: the same module interface (names the driver calls), with
# an allocator that only counts. Each repeat reports tokens/s = 1000 * (its repeat number), so
# the test can tell which peer repeat was paired with which of ours.
FAKE_PEER = """
import numpy as np
import peer_env

class torch:
    set_num_threads = staticmethod(lambda n: None)

WARMUP_ROUNDS = 2
calls = []

def extend_rounds(seed, rounds):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, 8, 4), rng.integers(1, 8, 4)) for _ in range(rounds)]

def decode_rounds(seed, rounds):
    return [np.arange(1, 5) for _ in range(rounds)]

class Alloc:
    repeats = 0
    def __init__(self, page_size):
        self.page_size = page_size

def make_allocator(a, page_size):
    Alloc.repeats += 1
    return Alloc(page_size)

def one_round(alloc, page_size, workload, lens):
    # (ns, tokens): 1 token per round, so tokens_per_s = 1e9 * rounds / (rounds * ns)
    return 10**6 // Alloc.repeats, 1

def check_free_list(alloc):
    pass
"""


def test_peer_repeats_interleave_with_ours(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "alloc_bench.py").write_text(FAKE_PEER)
    (tmp_path / "peer_env.py").write_text(
        "print('import chatter the driver must skip')\n"
        "def versions():\n    return {'sglang': 'fake'}\n"
    )
    argv = ["--rounds", "3", "--repeats", "3", "--page-sizes", "16", "--workloads", "decode"]
    argv += ["--variants", "numpy", "--no-page-io", "--no-batch-decode"]
    argv += ["--peer-python", sys.executable]
    assert bench.main([*argv, "--peer-dir", str(tmp_path)]) == 0
    (record,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    # make_allocator runs once for the warm-up, then once per repeat: 1000 * (2, 3, 4) tok/s.
    assert record["peer_tokens_per_s_repeats"] == pytest.approx([2000.0, 3000.0, 4000.0], rel=1e-4)
    assert record["peer_tokens_per_s"] == pytest.approx(3000.0, rel=1e-4)
    assert record["peer"] == "sglang-fake PagedTokenToKVPoolAllocator"
    ours = record["tokens_per_s_repeats"]
    expected = [round(o / p, 3) for o, p in zip(ours, [2000.0, 3000.0, 4000.0], strict=True)]
    assert record["paired_ratios"] == pytest.approx(expected, rel=1e-3)
    assert record["paired_ratio"] == pytest.approx(
        sorted(o / p for o, p in zip(ours, [2e3, 3e3, 4e3], strict=True))[1], rel=1e-3
    )
    assert record["ratio"] == pytest.approx(record["tokens_per_s"] / 3000.0, rel=1e-3)
    assert record["round_ratio"] is not None and len(record["round_ratio_quartiles"]) == 2


def test_a_dying_peer_is_reported(tmp_path: Path) -> None:
    (tmp_path / "alloc_bench.py").write_text("raise SystemExit('no sglang here')\n")
    with pytest.raises(bench.PeerError, match="no sglang here"):
        bench.Peer(Path(sys.executable), tmp_path, pool_tokens=1024, threads=1)


def test_run_configuration_alternates_ours_and_the_peer(monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[str] = []

    def fake_repeat(
        variant: bench.Variant, _workload: str, _size: int, rounds: list[object], **__: object
    ) -> bench.Repeat:
        # With WARMUP_ROUNDS at 1, a one-round repeat is the warm-up.
        if len(rounds) == 1:
            log.append("ours-warm")
        else:
            log.append("ours-checked" if variant.checked else "ours-unchecked")
        return bench.Repeat(tokens_per_s=4.0, calls_per_s=1.0, tokens=8, round_ns=[5, 7])

    class FakePeer:
        def warm(self, *_: object, **__: object) -> None:
            log.append("peer-warm")

        def repeat(self, *_: object, **__: object) -> bench.PeerRepeat:
            log.append("peer")
            return bench.PeerRepeat(
                impl="fake", tokens_per_s=2.0, calls_per_s=1.0, round_ns=[10, 21]
            )

    monkeypatch.setattr(bench, "one_repeat", fake_repeat)
    monkeypatch.setattr(bench, "WARMUP_ROUNDS", 1)
    args = bench.parse_args(["--rounds", "2", "--repeats", "3"])
    peer = cast(bench.Peer, FakePeer())
    variants = ["numpy", "numpy-unchecked"]
    record = bench.run_configuration(args, "decode", 16, variants, peer, "unused")
    once = ["ours-checked", "ours-unchecked", "peer"]
    assert log == ["ours-warm", "ours-warm", "peer-warm", *once, *once, *once]
    assert record["paired_ratios"] == [2.0, 2.0, 2.0] and record["ratio"] == 2.0
    # Per round: 10 / 5 and 21 / 7, three times over.
    assert record["round_ratio"] == 2.5 and record["round_ratio_quartiles"] == [2.0, 3.0]
