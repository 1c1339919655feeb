"""`kvstrata replay --model config.json --device-memory SIZE [--engine reference]`: the replayed
system is the one `kvstrata.build` sizes for the model and the budget; the reference engine
runs the model's logits through it; bad configs and budgets exit 2 with one line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstrata.build import MemoryPlan, ModelMemorySpec, SizingParams, plan_memory
from kvstrata.cli.main import main
from kvstrata.cli.replay_command import JSON_KEYS, TIER_JSON_KEYS
from kvstrata.cli.replay_model import REFERENCE_JSON_KEYS
from kvstrata.hybrid_cache import PrefetchPolicy
from kvstrata.replay import WorkloadSpec, generate_workload
from kvstrata.replay import model as model_module
from kvstrata.replay.reference_engine import MAX_REFERENCE_PARAMETERS, reference_parameters
from kvstrata.testkit.hf_configs import LLAMA_3_1_8B
from kvstrata.testkit.tiny_models import TINY_MODELS
from kvstrata.unified_radix_cache.tiers import TierParams, WritePolicy


@pytest.fixture(autouse=True)
def restore_torch_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _config(tmp_path: Path, config: dict[str, object], name: str = "config.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(config), encoding="utf-8")
    return path


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.strip()]


def _plan(kind: str, budget: int, requests: int, **sizing: float) -> MemoryPlan:
    longest = max(r.num_tokens for r in generate_workload(WorkloadSpec())[:requests])
    params = SizingParams(context_len=longest, **sizing)  # type: ignore[arg-type]
    return plan_memory(ModelMemorySpec.from_hf_config(TINY_MODELS[kind]), budget, params)


@pytest.mark.parametrize("kind", ["mha", "mla", "swa", "mamba"])
def test_the_replayed_system_is_the_one_build_sizes_for_the_budget(
    kind: str, tmp_path: Path
) -> None:
    out = tmp_path / "replay.json"
    argv = ["replay", "--no-progress", "--model", str(_config(tmp_path, TINY_MODELS[kind]))]
    argv += ["--device-memory", "16MiB", "--limit", "30", "--verify", "--json", str(out)]
    argv += ["--max-running-requests", "64"]
    assert main(argv) == 0
    record = json.loads(out.read_text(encoding="utf-8"))
    assert tuple(record) == JSON_KEYS
    plan = _plan(kind, 16 << 20, 30, max_running_requests=64)
    assert record["capacity_tokens"] == plan.full_tokens
    assert record["family"] == kind
    assert record["model"] == ModelMemorySpec.from_hf_config(TINY_MODELS[kind]).architecture
    assert (record["device_memory"], record["unbounded"]) == ("16MiB", False)
    assert 0 < record["hit_tokens"] < record["prompt_tokens"]


def test_a_host_tier_and_storage_are_sized_by_the_plan(tmp_path: Path) -> None:
    out = tmp_path / "replay.json"
    argv = ["replay", "--no-progress", "--model", str(_config(tmp_path, TINY_MODELS["mamba"]))]
    argv += ["--device-memory", "4MiB", "--max-running-requests", "8", "--limit", "60"]
    argv += ["--host-ratio", "1.5", "--storage", "memory://?capacity_bytes=50000000"]
    argv += ["--json", str(out), "--verify"]
    assert main(argv) == 0
    record = json.loads(out.read_text(encoding="utf-8"))
    assert sorted(record) == sorted((*JSON_KEYS, *TIER_JSON_KEYS))
    plan = _plan("mamba", 4 << 20, 60, max_running_requests=8, host_ratio=1.5)
    assert plan.host is not None
    assert record["host_tokens"] == plan.host.full_tokens
    assert record["host_state_slots"] == plan.host.mamba_slots
    assert record["capacity_tokens"] == plan.full_tokens


def test_the_reference_engine_logits_match_the_cache_off_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "reference.json"
    argv = ["replay", "--no-progress", "--model", str(_config(tmp_path, TINY_MODELS["mha"]))]
    argv += ["--device-memory", "2MiB", "--engine", "reference", "--limit", "2"]
    argv += ["--max-new-tokens", "2", "--verify", "--json", str(out)]
    assert main(argv) == 0
    record = json.loads(out.read_text(encoding="utf-8"))
    assert tuple(record) == REFERENCE_JSON_KEYS
    assert (record["engine"], record["model"], record["family"]) == ("reference", "llama", "mha")
    assert record["requests"] == 2 and record["output_tokens"] == 4
    assert record["verified"] is True
    # Every prompt token and every decoded token but the last is computed once (no hit, as
    # the two first prompts share nothing), the last decoded token never.
    assert record["hit_tokens"] == 0
    assert record["computed_tokens"] == record["prompt_tokens"] + 2
    assert "bitwise equal" in capsys.readouterr().out


def test_the_reference_engine_refuses_a_model_too_large(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    llama = {**LLAMA_3_1_8B, "vocab_size": 128256}  # the published config's vocabulary
    spec = ModelMemorySpec.from_hf_config(llama)
    assert reference_parameters(llama, spec) > MAX_REFERENCE_PARAMETERS
    argv = ["replay", "--model", str(_config(tmp_path, llama))]
    argv += ["--device-memory", "2GiB", "--engine", "reference"]
    assert main(argv) == 2
    lines = _error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and "too large for the reference engine" in lines[0]
    assert f"{MAX_REFERENCE_PARAMETERS:,}" in lines[0]


def _bad_model_cases(tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    tiny = str(_config(tmp_path, TINY_MODELS["mha"]))
    bad_json = tmp_path / "bad.json"
    bad_json.write_text('{"model_type": "llama",', encoding="utf-8")
    unknown = _config(tmp_path, {**TINY_MODELS["mha"], "model_type": "nope"}, "unknown.json")
    no_heads = {k: v for k, v in TINY_MODELS["mha"].items() if k != "num_attention_heads"}
    missing = _config(tmp_path, no_heads, "missing.json")
    no_vocab = {k: v for k, v in TINY_MODELS["mha"].items() if k != "vocab_size"}
    return {
        "reference without vocab_size": (
            [
                *("--model", str(_config(tmp_path, no_vocab, "novocab.json"))),
                *("--device-memory", "2GiB", "--engine", "reference"),
            ],
            "needs a positive integer vocab_size",
        ),
        "missing file": (
            ["--model", str(tmp_path / "absent.json"), "--device-memory", "2GiB"],
            "cannot read the model config",
        ),
        "bad JSON": (["--model", str(bad_json), "--device-memory", "2GiB"], "is not JSON"),
        "unknown architecture": (
            ["--model", str(unknown), "--device-memory", "2GiB"],
            "unknown architecture",
        ),
        "missing field": (
            ["--model", str(missing), "--device-memory", "2GiB"],
            "num_attention_heads",
        ),
        "budget too small": (["--model", tiny, "--device-memory", "64KiB"], "64"),
        "bad budget": (["--model", tiny, "--device-memory", "lots"], "lots"),
        "no budget": (["--model", tiny], "--model and --device-memory go together"),
        "family with model": (
            ["--model", tiny, "--device-memory", "2GiB", "--family", "swa"],
            "takes no --family",
        ),
        "reference without model": (
            ["--engine", "reference"],
            "--engine reference needs --model",
        ),
        "reference with a trace": (
            ["--model", tiny, "--device-memory", "2GiB", "--engine", "reference", "--trace", tiny],
            "no --trace",
        ),
        "context without model": (["--context-len", "64"], "--context-len needs --model"),
        "instances with model": (
            ["--model", tiny, "--device-memory", "2GiB", "--instances", "2"],
            "takes no --model",
        ),
    }


@pytest.mark.parametrize(
    "case",
    [
        "missing file",
        "bad JSON",
        "unknown architecture",
        "missing field",
        "budget too small",
        "bad budget",
        "no budget",
        "family with model",
        "reference without model",
        "reference with a trace",
        "context without model",
        "instances with model",
        "reference without vocab_size",
    ],
)
def test_bad_model_options_exit_2_with_one_line(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args, message = _bad_model_cases(tmp_path)[case]
    assert main(["replay", "--no-progress", "--limit", "5", *args]) == 2
    captured = capsys.readouterr()
    lines = _error_lines(captured.err)
    assert len(lines) == 1, lines
    assert message in lines[0]
    assert captured.out == ""


def test_the_reference_engine_takes_the_tier_policy_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reference engine's host tier gets --write-policy / --prefetch-policy /
    --prefetch-threshold like the stand-in's (they were dropped for the defaults): a value the
    tier refuses is refused, and a policy it takes reaches `build_tiers` and runs with the
    cache-off check."""
    built: list[TierParams] = []
    real_build_tiers = model_module.build_tiers

    def spy(*args: Any, **kwargs: Any) -> Any:
        built.append(kwargs["params"])
        return real_build_tiers(*args, **kwargs)

    monkeypatch.setattr(model_module, "build_tiers", spy)
    base = ["replay", "--no-progress", "--model", str(_config(tmp_path, TINY_MODELS["mha"]))]
    base += [
        "--device-memory",
        "2MiB",
        "--engine",
        "reference",
        "--limit",
        "2",
        "--host-ratio",
        "2",
    ]
    assert main([*base, "--prefetch-threshold", "0"]) == 2
    assert "prefetch_threshold must be >= 1" in capsys.readouterr().err
    out = tmp_path / "reference.json"
    argv = [*base, "--write-policy", "write_back", "--prefetch-policy", "timeout", "--verify"]
    argv += ["--prefetch-threshold", "7", "--json", str(out)]
    assert main(argv) == 0
    assert json.loads(out.read_text(encoding="utf-8"))["engine"] == "reference"
    assert built, "the tiered run did not build a host tier"
    for params in built:
        assert params.write_policy is WritePolicy.WRITE_BACK
        assert params.prefetch_policy is PrefetchPolicy.TIMEOUT
        assert params.prefetch_threshold == 7
