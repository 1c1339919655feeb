"""`kvstrata replay --model config.json --device-memory 2GiB [--engine reference]`.

With `--model`, the replayed memory system is built from the model's Hugging Face config and a
device budget through `kvstrata.build` (`ModelMemorySpec.from_hf_config`, `plan_memory`'s
sizing), instead of a toy family and `--capacity-tokens`. The stand-in forward stays the
default; `--engine reference` runs the reference model (`kvstrata.replay.reference_engine`:
seeded random weights, every token computed) on the embedded workload drawn from the model's
vocabulary, when the model is small enough (`MAX_REFERENCE_PARAMETERS`).

Only argparse is imported at module level (`kvstrata --help` builds this parser too).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from kvstrata.cli.errors import print_error
from kvstrata.cli.json_output import write_json
from kvstrata.cli.options import tier_config

if TYPE_CHECKING:
    from rich.table import Table

    from kvstrata.replay import ReplayRequest
    from kvstrata.replay.model import ModelBuild, ReferenceRun

ENGINE_CHOICES: tuple[str, ...] = ("stand-in", "reference")
#: Requests the reference engine replays when no --limit is given: it computes every token.
REFERENCE_DEFAULT_LIMIT = 8

#: Keys of the reference engine's `--json` record, in order.
REFERENCE_JSON_KEYS: tuple[str, ...] = (
    "source",
    "engine",
    "model",
    "family",
    "device_memory",
    "policy",
    "page_size",
    "full_tokens",
    "swa_tokens",
    "mamba_slots",
    "host_tokens",
    "storage",
    "requests",
    "prompt_tokens",
    "max_new_tokens",
    "hit_tokens",
    "hit_rate",
    "computed_tokens",
    "output_tokens",
    "retractions",
    "steps",
    "evicted_tokens",
    "verified",
    "wall_seconds",
)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The `--model` options of `kvstrata replay`."""
    parser.add_argument(
        "--model",
        type=Path,
        metavar="CONFIG",
        help="build the memory system of this Hugging Face config.json (or a directory holding "
        "one) within --device-memory, sized by SGLang's rules (replaces --family and "
        "--capacity-tokens)",
    )
    parser.add_argument(
        "--device-memory",
        metavar="SIZE",
        help="device budget of --model: a size (2GiB, 512MB, bytes) or a fraction of the free "
        "device memory (0.9, 90%%)",
    )
    parser.add_argument(
        "--engine",
        choices=ENGINE_CHOICES,
        default="stand-in",
        help="stand-in: write deterministic KV (default); reference: run the reference model "
        "(seeded weights, needs --model, a small config, the embedded workload; --verify "
        "then compares every logit with a cache-off run)",
    )
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=4,
        help="tokens the reference engine decodes per request (default 4)",
    )
    parser.add_argument(
        "--max-running-requests",
        type=int,
        help="request table rows of --model (default: SGLang's rule; the reference engine "
        "runs at most this many at once, default 8)",
    )
    parser.add_argument(
        "--context-len",
        type=int,
        help="context length the request table of --model holds (default: the longest "
        "request, plus --max-new-tokens with the reference engine)",
    )


def check_model_options(args: argparse.Namespace) -> None:
    """ReplayError for a combination of options `--model` / `--engine` do not take."""
    from kvstrata.replay import ReplayError

    model = args.model is not None
    if model != (args.device_memory is not None):
        raise ReplayError("--model and --device-memory go together")
    if args.engine == "reference" and not model:
        raise ReplayError("--engine reference needs --model and --device-memory")
    if not model:
        for flag in ("max_running_requests", "context_len"):
            if getattr(args, flag) is not None:
                raise ReplayError(f"--{flag.replace('_', '-')} needs --model")
        return
    if args.family is not None or args.capacity_tokens is not None or args.unbounded:
        raise ReplayError(
            "--model sizes the system from --device-memory: it takes no --family, "
            "--capacity-tokens or --unbounded"
        )
    for flag in ("max_running_requests", "context_len"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ReplayError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    if args.engine == "reference":
        if args.trace is not None:
            raise ReplayError("--engine reference runs the embedded workload: no --trace")
        if args.plot is not None or args.metrics_port is not None:
            raise ReplayError("--engine reference takes no --plot or --metrics-port")
        if args.max_new_tokens < 1:
            raise ReplayError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")


def model_build(
    args: argparse.Namespace,
    requests: list[ReplayRequest],
    *,
    extra_tokens: int = 0,
    rows: int | None = None,
) -> ModelBuild:
    """The `ModelBuild` of `--model` / `--device-memory`: the request table holds
    `--context-len`, or the longest request plus `extra_tokens`, in `--max-running-requests`
    rows (else `rows`, else SGLang's rule). ReplayError for an unreadable config, BuildError
    for one `from_hf_config` refuses."""
    from kvstrata.build import ModelMemorySpec, SizingParams
    from kvstrata.replay.model import ModelBuild, load_model_config

    spec = ModelMemorySpec.from_hf_config(load_model_config(args.model))
    longest = max((r.num_tokens for r in requests), default=1) + extra_tokens
    sizing = SizingParams(
        page_size=args.page_size,
        context_len=args.context_len or longest,
        max_running_requests=args.max_running_requests or rows,
    )
    return ModelBuild(spec=spec, budget=_budget(args.device_memory), sizing=sizing)


def _budget(text: str) -> str | int:
    """A plain byte count as an int; anything else as given (`plan_memory` parses it)."""
    return int(text) if text.isdigit() else text


def run_reference_replay(args: argparse.Namespace, out: TextIO) -> int:
    """`kvstrata replay --engine reference`: 0, 2 for bad options or input (one line on
    stderr), 1 when `--verify` finds logits that differ with the cache on and off."""
    import torch
    from rich.console import Console

    from kvstrata.build import BuildError, ModelMemorySpec
    from kvstrata.pool_host.errors import HostPoolError
    from kvstrata.replay import KVMismatch, ReplayError, WorkloadSpec, generate_workload
    from kvstrata.replay.model import load_model_config, run_reference
    from kvstrata.replay.reference_engine import check_reference_model
    from kvstrata.storage.errors import StorageError

    try:
        torch.set_num_threads(args.threads)
        config = load_model_config(args.model)
        dims = check_reference_model(config, ModelMemorySpec.from_hf_config(config))
        limit = REFERENCE_DEFAULT_LIMIT if args.limit is None else args.limit
        workload = WorkloadSpec(seed=args.seed, vocab_size=dims.vocab)
        requests = generate_workload(workload)[:limit]
        running = args.max_running_requests or 8
        build = model_build(args, requests, extra_tokens=args.max_new_tokens, rows=running)
        result = run_reference(
            config,
            build,
            requests,
            policy=args.policy,
            device=args.device,
            max_new_tokens=args.max_new_tokens,
            max_running=running,
            seed=args.seed,
            verify=args.verify,
            tiers=tier_config(args, name="reference", capacity_tokens=None),
        )
    except KVMismatch as exc:
        print_error(str(exc), label="verification failed")
        return 1
    except (ReplayError, BuildError, HostPoolError, StorageError, OSError) as exc:
        print_error(str(exc))
        return 2
    record = _reference_record(args, result, source=f"embedded workload (seed {args.seed})")
    Console(file=out, width=max(80, Console(file=out).width)).print(_reference_table(record))
    return 0 if write_json(args.json, record) else 2


def _reference_record(
    args: argparse.Namespace, result: ReferenceRun, *, source: str
) -> dict[str, object]:
    run, plan = result.run, result.plan
    record: dict[str, object] = {
        "source": source,
        "engine": "reference",
        "model": plan.spec.architecture,
        "family": result.family,
        "device_memory": args.device_memory,
        "policy": args.policy,
        "page_size": plan.page_size,
        "full_tokens": plan.full_tokens,
        "swa_tokens": plan.swa_tokens,
        "mamba_slots": plan.mamba_slots,
        "host_tokens": result.host_tokens,
        "storage": args.storage,
        "requests": result.requests,
        "prompt_tokens": result.prompt_tokens,
        "max_new_tokens": args.max_new_tokens,
        "hit_tokens": run.hit_tokens,
        "hit_rate": round(run.hit_tokens / max(result.prompt_tokens, 1), 6),
        "computed_tokens": run.computed_tokens,
        "output_tokens": result.output_tokens,
        "retractions": run.retractions,
        "steps": run.steps,
        "evicted_tokens": result.evicted_tokens,
        "verified": True if result.baseline is not None else None,
        "wall_seconds": round(result.wall_seconds, 3),
    }
    assert tuple(record) == REFERENCE_JSON_KEYS, "REFERENCE_JSON_KEYS is stale"
    return record


def _reference_table(record: dict[str, object]) -> Table:
    from rich.table import Table

    table = Table(title=f"kvstrata replay --engine reference: {record['source']}")
    table.add_column("", style="bold")
    table.add_column("value", justify="right")
    prompt = max(int(str(record["prompt_tokens"])), 1)
    hits = int(str(record["hit_tokens"]))
    rows = [
        ("model / family", f"{record['model']} / {record['family']}"),
        ("device memory", f"{record['device_memory']}"),
        ("device pools", _pools(record)),
        (
            "host tier",
            "-" if record["host_tokens"] is None else f"{record['host_tokens']:,} tokens",
        ),
        ("storage", f"{record['storage'] or '-'}"),
        ("requests", f"{record['requests']:,}"),
        ("prompt tokens", f"{prompt:,}"),
        ("hit tokens", f"{hits:,} ({hits / prompt:.2%})"),
        ("tokens computed", f"{record['computed_tokens']:,}"),
        ("tokens decoded", f"{record['output_tokens']:,}"),
        ("retractions", f"{record['retractions']:,}"),
        ("evicted tokens", f"{record['evicted_tokens']:,}"),
        (
            "logits vs cache off",
            "bitwise equal" if record["verified"] else "not checked (--verify)",
        ),
        ("wall time", f"{record['wall_seconds']} s"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table


def _pools(record: dict[str, object]) -> str:
    parts = [f"{record['full_tokens']:,} tokens"]
    if record["swa_tokens"]:
        parts.append(f"{record['swa_tokens']:,} SWA tokens")
    if record["mamba_slots"]:
        parts.append(f"{record['mamba_slots']:,} state slots")
    return " + ".join(parts)
