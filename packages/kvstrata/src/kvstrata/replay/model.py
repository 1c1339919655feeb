"""Replays of a real model's memory system: a Hugging Face `config.json` and a device budget in,
the system `kvstrata.build` sizes for them out (`kvstrata replay --model ... --device-memory`).

    config.json ──> load_model_config ──> ModelMemorySpec.from_hf_config
                                               │
    budget, page size, context, host tier ─────┴──> ModelBuild.build ──> MemorySystem
                                                                          (+ TieredSystem)

`ModelBuild` is what `compare.run_configuration` takes instead of a toy family and a token
capacity: every pool is sized by `plan_memory` (SGLang's rules), the host tier by the plan's
host figures. `run_reference` runs `reference_engine.ReferenceModel` over the built system
instead of the stand-in forward: prompts prefilled in chunks and decoded greedily through
`kvstrata.allocation`, optionally again with the cache off to check the logits bitwise.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kvstrata.build import (
    BuildOptions,
    BuiltSystem,
    MemoryPlan,
    ModelMemorySpec,
    SizingParams,
    TieredSystem,
    build_tiers,
    build_with_plan,
)
from kvstrata.replay.errors import KVMismatch, ReplayOptionError
from kvstrata.replay.reference_engine import (
    EngineRun,
    ReferenceEngine,
    ReferenceModel,
    check_reference_model,
)
from kvstrata.replay.request import ReplayRequest
from kvstrata.replay.tier_config import TierConfig, tier_params

__all__ = [
    "ModelBuild",
    "ReferenceRun",
    "load_model_config",
    "run_reference",
]


def load_model_config(path: Path | str) -> dict[str, object]:
    """The parsed `config.json` at `path` (or in the directory `path`). ReplayOptionError for
    a missing or unreadable file, text that is not JSON, or JSON that is not an object."""
    file = Path(path)
    if file.is_dir():
        file = file / "config.json"
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ReplayOptionError(f"cannot read the model config {file}: {reason}") from exc
    try:
        config = json.loads(text)
    except ValueError as exc:
        raise ReplayOptionError(f"the model config {file} is not JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ReplayOptionError(
            f"the model config {file} must hold a JSON object, got {type(config).__name__}"
        )
    return {str(k): v for k, v in config.items()}


@dataclass(frozen=True, kw_only=True)
class ModelBuild:
    """How to build the replayed system from a model: its `spec`, the device `budget`
    ("2GiB", bytes, or a fraction of the free device memory) and the sizing knobs (the host
    tier's are set per configuration by `build`)."""

    spec: ModelMemorySpec
    budget: str | int | float
    sizing: SizingParams

    def build(
        self, *, policy: str, device: str, tiers: TierConfig | None = None
    ) -> tuple[BuiltSystem, TieredSystem | None]:
        """The system of the plan and, when `tiers` asks for a host size or storage
        (`TierConfig.tiered`), its host tier (ratio 2 when only storage is given) sized by the
        plan (checked against the free host memory) under `tier_params(tiers)`. Raises
        ReplayOptionError for out-of-range tier policies, then what `build_with_plan` and
        `build_tiers` raise, before allocating."""
        host_ratio = host_bytes = storage_url = params = None
        if tiers is not None and tiers.tiered:
            params = tier_params(tiers)
            host_ratio, host_bytes, storage_url = (
                tiers.host_ratio,
                tiers.host_bytes,
                tiers.storage_url,
            )
            if storage_url is not None and host_ratio is None and host_bytes is None:
                host_ratio = 2.0
        sizing = replace(self.sizing, host_ratio=host_ratio, host_bytes=host_bytes)
        options = BuildOptions(sizing=sizing, policy=policy, device=device)
        built = build_with_plan(self.spec, self.budget, options)
        host = built.plan.host
        if host is None:
            return built, None
        tiered = build_tiers(
            built.system,
            host_tokens=host.full_tokens,
            storage_url=storage_url,
            params=params,
        )
        return built, tiered


@dataclass(frozen=True, kw_only=True)
class ReferenceRun:
    """What `run_reference` gave: the cache-on run, the cache-off run when verified (None
    otherwise), the plan the system was built by, its family and host tokens (None without a
    host tier), prompt figures, the device tokens evicted and the wall time of the cache-on
    run."""

    run: EngineRun
    baseline: EngineRun | None
    plan: MemoryPlan
    family: str
    host_tokens: int | None
    requests: int
    prompt_tokens: int
    evicted_tokens: int
    wall_seconds: float

    @property
    def output_tokens(self) -> int:
        return sum(len(tokens) for tokens in self.run.outputs.values())


def run_reference(
    config: Mapping[str, object],
    model: ModelBuild,
    requests: Sequence[ReplayRequest],
    *,
    policy: str,
    device: str,
    max_new_tokens: int,
    max_running: int,
    seed: int = 0,
    verify: bool = False,
    tiers: TierConfig | None = None,
) -> ReferenceRun:
    """Prefill every prompt of `requests` and decode `max_new_tokens` greedily with the
    reference model (seeded weights) over the memory system `model` builds (with the host tier
    and storage `tiers` asks for). `verify`: run again, cache off, on a fresh system of the
    same plan and raise KVMismatch unless every logit of every step is bitwise the same.

    Prompts must be token ids below the model's vocabulary (the embedded workload drawn from
    it). Raises ReferenceModelTooLarge / ReplayOptionError (`check_reference_model`) and
    ReplayOptionError for bad counts or token ids before building, then what the builders
    raise, and RequestDoesNotFit when one request alone has no room."""
    check_reference_model(config, model.spec)
    if max_new_tokens < 1:
        raise ReplayOptionError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if max_running < 1:
        raise ReplayOptionError(f"--max-running-requests must be >= 1, got {max_running}")
    prompts = [[int(t) for t in r.token_ids] for r in requests]
    vocab = config.get("text_config", config)
    vocab_size = vocab.get("vocab_size") if isinstance(vocab, Mapping) else None
    if isinstance(vocab_size, int) and any(t >= vocab_size for p in prompts for t in p):
        raise ReplayOptionError(
            f"a prompt holds token ids past the model's vocab_size {vocab_size}"
        )

    def engine_run(cache_prefixes: bool) -> tuple[EngineRun, int, BuiltSystem, int | None]:
        built, tiered = model.build(
            policy=policy, device=device, tiers=tiers if cache_prefixes else None
        )
        system = built.system
        cache = (tiered or system).cache
        try:
            reference = ReferenceModel(config, system, seed=seed)
            engine = ReferenceEngine(
                reference,
                cache,
                chunk=4 * system.page_size,
                max_running=max_running,
                cache_prefixes=cache_prefixes,
            )
            run = engine.run(prompts, max_new_tokens)
        finally:
            if tiered is not None:
                tiered.close()
        (tiered or system).check_integrity()
        host = None if tiered is None else tiered.host_tokens
        return run, cache.evicted_tokens, built, host

    started = time.perf_counter()
    run, evicted, built, host_tokens = engine_run(True)
    wall = time.perf_counter() - started
    baseline = None
    if verify:
        baseline = engine_run(False)[0]
        for rid, steps in baseline.logits.items():
            got = run.logits.get(rid, [])
            if len(got) != len(steps) or not all(
                torch.equal(a, b) for a, b in zip(got, steps, strict=False)
            ):
                raise KVMismatch(
                    f"request {rid}: the reference model's logits differ with the prefix cache "
                    "on and off"
                )
    return ReferenceRun(
        run=run,
        baseline=baseline,
        plan=built.plan,
        family=built.system.family,
        host_tokens=host_tokens,
        requests=len(prompts),
        prompt_tokens=sum(len(p) for p in prompts),
        evicted_tokens=evicted,
        wall_seconds=wall,
    )
