"""`kvstrata size`: the calculator's table, its JSON, and its refusals (exit code 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvstrata.build import ModelMemorySpec, SizingParams, plan_memory
from kvstrata.cli.main import main
from kvstrata.testkit.hf_configs import DEEPSEEK_V3, GPT_OSS_120B, LLAMA_3_1_8B, QWEN3_NEXT_80B


def _write(tmp_path: Path, config: dict[str, object]) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


def _size(tmp_path: Path, config: dict[str, object], *options: str) -> int:
    """`kvstrata size --model <config written to tmp_path> *options`: the exit code."""
    return main(["size", "--model", str(_write(tmp_path, config)), *options])


def test_json_matches_the_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    options = ["--device-memory", "80GiB", "--kv-dtype", "fp8_e4m3", "--tp", "8"]
    assert _size(tmp_path, LLAMA_3_1_8B, *options, "--context-len", "32768", "--json") == 0
    record = json.loads(capsys.readouterr().out)
    spec = ModelMemorySpec.from_hf_config(LLAMA_3_1_8B, kv_dtype="fp8_e4m3", tp_size=8)
    plan = plan_memory(spec, "80GiB", SizingParams(context_len=32768))
    assert record == {**plan.to_json(), "l3": None}
    # 2 x 1 KV head x 128 x 1 B x 32 layers
    assert record["full_kv_bytes_per_token"] == 8192
    assert record["full_tokens"] % 16 == 0
    assert record["used_bytes"] <= 80 << 30
    assert record["max_concurrent_requests"] == min(record["full_tokens"] // 32768, 4096)
    assert record["host"] is None


def test_table_shows_every_pool(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    options = ["--device-memory", "40GiB", "--context-len", "32768", "--host-ratio", "0.01"]
    assert _size(tmp_path, QWEN3_NEXT_80B, *options, "--l3-bytes", "1GiB") == 0
    out = capsys.readouterr().out
    # 1 GiB / (16 x 24_576 B a page) = 2730 pages
    assert "L3 storage" in out and "43,680 tokens" in out
    assert "full KV (12 layers)" in out
    assert "Mamba state (36 layers, ssm float32)" in out
    assert "77,266,944 B/request" in out
    assert "request table" in out and "host L2" in out and "L3 page" in out
    assert "max concurrent requests at 32,768 tokens:" in out


def test_swa_table_and_host_bytes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    options = ["--device-memory", "20GiB", "--context-len", "8192"]
    tiers = ["--host-bytes", "100MiB", "--l3-bytes", "1TB", "--json"]
    assert _size(tmp_path, GPT_OSS_120B, *options, *tiers) == 0
    record = json.loads(capsys.readouterr().out)
    # 10**12 B / (16 x 73_728 B a page) = 847_710 pages
    assert record["l3"] == {"size_bytes": 10**12, "tokens": 847_710 * 16}
    assert record["swa_tokens"] > 0 and record["sliding_window"] == 128
    assert record["host"]["size_bytes"] <= 100 << 20
    assert _size(tmp_path, GPT_OSS_120B, *options) == 0
    assert "SWA KV (18 layers, window 128)" in capsys.readouterr().out


def test_fraction_of_free_device_memory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    options = ["--device-memory", "1%", "--device", "cpu", "--context-len", "1024", "--json"]
    assert _size(tmp_path, DEEPSEEK_V3, *options) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["budget_bytes"] > 0 and record["used_bytes"] <= record["budget_bytes"]


@pytest.mark.parametrize(
    ("config", "extra", "message"),
    [
        (LLAMA_3_1_8B, ["--device-memory", "1GiB"], "cannot hold one request of 131072 tokens"),
        ({"model_type": "bert"}, ["--device-memory", "1GiB"], "unknown architecture"),
        (
            {k: v for k, v in LLAMA_3_1_8B.items() if k != "num_key_value_heads"}
            | {"num_attention_heads": None},
            ["--device-memory", "1GiB"],
            "no num_attention_heads",
        ),
        (LLAMA_3_1_8B, ["--device-memory", "lots"], "not a size"),
        (LLAMA_3_1_8B, ["--device-memory", "80GiB", "--tp", "0"], "tp_size"),
        (LLAMA_3_1_8B, ["--device-memory", "80GiB", "--host-bytes", "x"], "not a size"),
        (LLAMA_3_1_8B, ["--device-memory", "80GiB", "--page-size", "0"], "page_size"),
    ],
)
def test_refusals_exit_2_with_the_reason(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    config: dict[str, object],
    extra: list[str],
    message: str,
) -> None:
    assert _size(tmp_path, config, *extra) == 2
    assert message in capsys.readouterr().err
    # The model's directory names the same config.json.
    assert main(["size", "--model", str(tmp_path), *extra]) == 2
    assert message in capsys.readouterr().err


def test_unreadable_config_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    assert main(["size", "--model", str(bad), "--device-memory", "1GiB"]) == 2
    assert "cannot read" in capsys.readouterr().err
    bad.write_bytes(b'{"model_type": "llama\xff"}')  # not UTF-8
    assert main(["size", "--model", str(bad), "--device-memory", "1GiB"]) == 2
    assert "cannot read" in capsys.readouterr().err
    assert main(["size", "--model", str(tmp_path / "empty"), "--device-memory", "1GiB"]) == 2
    missing = tmp_path / "absent.json"
    assert main(["size", "--model", str(missing), "--device-memory", "1GiB"]) == 2
    assert "cannot read" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_fraction_without_the_device_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _size(tmp_path, LLAMA_3_1_8B, "--device-memory", "90%") == 2
    assert "no CUDA device" in capsys.readouterr().err
