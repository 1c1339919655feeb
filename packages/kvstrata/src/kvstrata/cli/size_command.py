"""`kvstrata size`: size the KV / state pools of a Hugging Face model for a device budget.

Prices a model's KV cache and recurrent state from its config.json on one tensor-parallel rank
and sizes every pool within a device budget, following SGLang's rules (Mamba carve-out by
mamba_full_memory_ratio, SWA/full split by swa_full_tokens_ratio, page-aligned pools, a request
table of SGLang's default size): per-pool capacity in tokens and bytes, the request table, the
requests of one context length that run at once, and the host (L2) tier for a ratio or a size,
with the bytes of one L3 page. --json prints the same figures as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

# Only argparse is imported at module level (`kvstrata --help` builds this parser too); the
# handler prices the model with `ModelMemorySpec.from_hf_config` and sizes it with `plan_memory`.
if TYPE_CHECKING:
    from kvstrata.build.sizing import MemoryPlan

NAME = "size"
HELP = "size the KV / state pools of a Hugging Face model for a device budget"

KV_DTYPE_CHOICES: tuple[str, ...] = (
    "auto",
    "bfloat16",
    "float16",
    "float32",
    "fp8_e4m3",
    "fp8_e5m2",
)
SSM_DTYPE_CHOICES: tuple[str, ...] = ("float32", "bfloat16", "float16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `kvstrata size`."""
    parser.add_argument(
        "--model",
        type=Path,
        required=True,
        help="the model's config.json (or the model's directory holding it)",
    )
    parser.add_argument(
        "--device-memory",
        required=True,
        help="device budget per rank: a size (80GiB, 40GB, bytes) or a fraction of the free "
        "device memory (0.9, 90%%)",
    )
    parser.add_argument(
        "--kv-dtype",
        choices=KV_DTYPE_CHOICES,
        default="auto",
        help="KV cache dtype (default: the model's)",
    )
    parser.add_argument(
        "--mamba-ssm-dtype", choices=SSM_DTYPE_CHOICES, default="float32", help="SSM state dtype"
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    parser.add_argument(
        "--context-len", type=int, help="context length (default: max_position_embeddings)"
    )
    parser.add_argument("--page-size", type=int, default=16, help="tokens per page (default 16)")
    parser.add_argument(
        "--max-running-requests", type=int, help="request table rows (default: SGLang's rule)"
    )
    parser.add_argument(
        "--swa-full-tokens-ratio", type=float, default=0.8, help="SWA tokens per full token"
    )
    parser.add_argument(
        "--mamba-full-memory-ratio",
        type=float,
        default=0.9,
        help="Mamba state memory per full-KV memory (default 0.9)",
    )
    host = parser.add_mutually_exclusive_group()
    host.add_argument("--host-ratio", type=float, help="host (L2) tier: ratio of each device pool")
    host.add_argument("--host-bytes", help="host (L2) tier: a size (e.g. 200GiB)")
    parser.add_argument(
        "--l3-bytes", help="L3 (storage) size, e.g. 2TB: prints the tokens it holds"
    )
    parser.add_argument(
        "--device",
        default="cuda",
        help="device whose free memory a fractional budget refers to (default cuda)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Handler of `kvstrata size`: 0 on success, 2 with the reason on stderr otherwise."""
    from kvstrata.build.budget import free_device_memory, is_fraction, parse_size
    from kvstrata.build.errors import BuildError
    from kvstrata.build.model_spec import ModelMemorySpec
    from kvstrata.build.sizing import SizingParams, plan_memory

    stream = sys.stdout if out is None else out
    path = Path(args.model)
    if path.is_dir():
        path = path / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # ValueError: not JSON, or not UTF-8
        print(f"kvstrata size: cannot read {path}: {exc}", file=sys.stderr)
        return 2
    try:
        spec = ModelMemorySpec.from_hf_config(
            config,
            kv_dtype=args.kv_dtype,
            mamba_ssm_dtype=args.mamba_ssm_dtype,
            tp_size=args.tp,
        )
        params = SizingParams(
            page_size=args.page_size,
            context_len=args.context_len,
            swa_full_tokens_ratio=args.swa_full_tokens_ratio,
            mamba_full_memory_ratio=args.mamba_full_memory_ratio,
            max_running_requests=args.max_running_requests,
            host_ratio=args.host_ratio,
            host_bytes=None if args.host_bytes is None else parse_size(args.host_bytes),
        )
        free = None
        if is_fraction(args.device_memory):
            free = free_device_memory(args.device)
        plan = plan_memory(spec, args.device_memory, params, free_device_bytes=free)
        l3_bytes = None if args.l3_bytes is None else parse_size(args.l3_bytes)
    except BuildError as exc:
        print(f"kvstrata size: {exc}", file=sys.stderr)
        return 2
    if args.json:
        record = plan.to_json()
        record["l3"] = None
        if l3_bytes is not None:
            record["l3"] = {"size_bytes": l3_bytes, "tokens": plan.storage_tokens(l3_bytes)}
        print(json.dumps(record), file=stream)
    else:
        _print_table(plan, l3_bytes, stream)
    return 0


def _print_table(plan: MemoryPlan, l3_bytes: int | None, out: TextIO) -> None:
    from rich.console import Console
    from rich.table import Table

    from kvstrata.build.budget import format_bytes

    spec = plan.spec
    table = Table(
        title=(
            f"{spec.architecture}: tp {spec.tp_size}, kv {spec.kv_dtype}, "
            f"budget {format_bytes(plan.budget_bytes)} per rank"
        )
    )
    table.add_column("pool")
    table.add_column("capacity", justify="right")
    table.add_column("bytes", justify="right")
    table.add_column("per unit", justify="right")
    if spec.full_kv_bytes_per_token:
        table.add_row(
            f"full KV ({len(spec.full_layer_ids)} layers)",
            f"{plan.full_tokens:,} tokens",
            format_bytes(plan.full_kv_bytes),
            f"{spec.full_kv_bytes_per_token:,} B/token",
        )
    if spec.swa_kv_bytes_per_token:
        table.add_row(
            f"SWA KV ({len(spec.swa_layer_ids)} layers, window {spec.sliding_window})",
            f"{plan.swa_tokens:,} tokens",
            format_bytes(plan.swa_kv_bytes),
            f"{spec.swa_kv_bytes_per_token:,} B/token",
        )
    if spec.state_bytes_per_request:
        table.add_row(
            f"Mamba state ({len(spec.mamba_layer_ids)} layers, ssm {spec.mamba_ssm_dtype})",
            f"{plan.mamba_slots:,} states",
            format_bytes(plan.mamba_state_bytes),
            f"{spec.state_bytes_per_request:,} B/request",
        )
    table.add_row(
        "request table",
        f"{plan.max_running_requests:,} rows",
        format_bytes(plan.req_table_bytes),
        f"{plan.context_len * 4:,} B/row",
    )
    table.add_row("unused", "", format_bytes(plan.unused_bytes), "")
    if plan.host is not None:
        host = plan.host
        capacity = f"{host.full_tokens:,} tokens"
        if host.swa_tokens:
            capacity += f", {host.swa_tokens:,} SWA"
        if host.mamba_slots:
            capacity += f", {host.mamba_slots:,} states"
        table.add_row(
            f"host L2 (x{host.ratio:.3g})",
            capacity,
            format_bytes(host.size_bytes),
            f"free {format_bytes(host.free_host_bytes)}",
        )
    table.add_row("L3 page", f"{plan.page_size} tokens", format_bytes(plan.page_bytes), "")
    if l3_bytes is not None:
        tokens = plan.storage_tokens(l3_bytes)
        table.add_row("L3 storage", f"{tokens:,} tokens", format_bytes(l3_bytes), "")
    console = Console(file=out, width=120)
    console.print(table)
    console.print(
        f"max concurrent requests at {plan.context_len:,} tokens: "
        f"{plan.max_concurrent_requests():,}"
    )
