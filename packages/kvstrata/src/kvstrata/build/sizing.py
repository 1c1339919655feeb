"""Sizing: a `ModelMemorySpec` and a device budget in, the capacity of every pool out.

`plan_memory(spec, budget, params)` follows SGLang's rules
(`python/sglang/srt/model_executor/model_runner_kv_cache_mixin.py`: `profile_max_num_token`,
`handle_max_mamba_cache`, `set_num_tokens_hybrid_swa`, `init_memory`), with one difference:
the request table is charged to the budget too, so the plan never takes more than the budget.
In order:

1. **Request table.** `max_running_requests` (default: SGLang's
   `min(max(int(tokens / context_len * 512), 2048), 4096)`, with `tokens` the KV tokens the
   whole budget would hold) rows of `context_len` int32 slots, plus the padding row 0.
2. **Mamba carve-out** (models with Mamba / linear-attention layers). With `mamba_cache_size`
   unset, the state pool and the full KV pool share the rest in the ratio
   `mamba_full_memory_ratio` (SGLang's default 0.9): `state = rest * r / (1 + r)`, rounded
   down to whole per-request states; `max_running_requests` is then at most a third of the
   state slots (SGLang's `MAMBA_CACHE_SIZE_MAX_RUNNING_REQUESTS_RATIO = 3`: a running request,
   and room for cached states beside it).
3. **KV tokens.** `tokens = rest // (full_kv_bytes_per_token + swa_kv_bytes_per_token)`
   (SGLang's `cell_size`: all attention layers priced together).
4. **SWA / full split** (models with sliding-window layers). SGLang's memory-based split with
   `swa_full_tokens_ratio` r (default 0.8): `full = tokens * cell / (F + r * S)` and `swa =
   full * r`, where F and S are the full and SWA bytes per token, so the two pools take
   exactly the memory `tokens` full-model tokens would. A model of SWA layers only puts every
   token in the SWA pool.
5. **Pages.** Each pool's token count is rounded down to whole pages.

Then the plan must hold one request of `context_len`: a page-rounded full context, an SWA
window (plus one page: the window straddles page boundaries), one state slot, one table row;
otherwise `BudgetTooSmall` gives every figure. The host tier (`host_ratio`, SGLang's
`hicache_ratio`, or `host_bytes`) mirrors every pool at one ratio, as `build_tiers` does, and
is refused (`HostMemoryExceeded`) past the free host memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kvstrata.build.budget import format_bytes, free_host_memory, resolve_budget
from kvstrata.build.errors import BudgetTooSmall, HostMemoryExceeded, InvalidCapacity, InvalidModel
from kvstrata.build.model_spec import ModelMemorySpec

#: SGLang's request-count rule when none is given: tokens / context_len * 512, in [2048, 4096].
DEFAULT_REQUESTS_PER_CONTEXT = 512
MIN_DEFAULT_REQUESTS = 2048
MAX_DEFAULT_REQUESTS = 4096
#: State slots per running request with a prefix cache (SGLang's ratio, radix cache on).
MAMBA_SLOTS_PER_RUNNING_REQUEST = 3
#: Bytes of one request-table slot (int32).
REQ_TABLE_SLOT_BYTES = 4


@dataclass(frozen=True, kw_only=True)
class SizingParams:
    """Knobs of a plan. `context_len` None: the config's `max_position_embeddings`.
    `max_running_requests` / `mamba_cache_size` None: SGLang's rules (module docstring).
    At most one of `host_ratio` and `host_bytes` (None, None: no host tier)."""

    page_size: int = 16
    context_len: int | None = None
    swa_full_tokens_ratio: float = 0.8
    mamba_full_memory_ratio: float = 0.9
    max_running_requests: int | None = None
    mamba_cache_size: int | None = None
    host_ratio: float | None = None
    host_bytes: int | None = None


@dataclass(frozen=True, kw_only=True)
class HostPlan:
    """The host (L2) mirror: each device pool times one ratio (tokens page-aligned)."""

    ratio: float
    full_tokens: int
    swa_tokens: int
    mamba_slots: int
    size_bytes: int
    free_host_bytes: int


@dataclass(frozen=True, kw_only=True)
class MemoryPlan:
    """Capacities for one model on one rank within `budget_bytes`. Token counts are whole
    pages; `mamba_slots` / `swa_tokens` are 0 for a model without Mamba / SWA layers."""

    spec: ModelMemorySpec
    budget_bytes: int
    page_size: int
    context_len: int
    full_tokens: int
    swa_tokens: int
    mamba_slots: int
    max_running_requests: int
    req_table_bytes: int
    host: HostPlan | None

    @property
    def full_kv_bytes(self) -> int:
        return self.full_tokens * self.spec.full_kv_bytes_per_token

    @property
    def swa_kv_bytes(self) -> int:
        return self.swa_tokens * self.spec.swa_kv_bytes_per_token

    @property
    def mamba_state_bytes(self) -> int:
        return self.mamba_slots * self.spec.state_bytes_per_request

    @property
    def used_bytes(self) -> int:
        """Everything the plan allocates on the device: never more than `budget_bytes`."""
        return (
            self.req_table_bytes + self.full_kv_bytes + self.swa_kv_bytes + self.mamba_state_bytes
        )

    @property
    def unused_bytes(self) -> int:
        return self.budget_bytes - self.used_bytes

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of every full and SWA layer: what one L2/L3 page transfer moves
        (a page's Mamba state, where it ends one, is `spec.state_bytes_per_request` more)."""
        return self.page_size * self.spec.kv_bytes_per_token

    def storage_tokens(self, size_bytes: int) -> int:
        """Tokens an L3 store of `size_bytes` holds in whole pages of `page_bytes` (Mamba
        states stored beside them not counted)."""
        if size_bytes < 0:
            raise InvalidCapacity(f"storage size must be >= 0, got {size_bytes}")
        return size_bytes // self.page_bytes * self.page_size

    def request_needs(self, context_len: int) -> tuple[int, int]:
        """(full tokens, SWA tokens) one request of `context_len` tokens holds at its peak."""
        pages = _pages(context_len, self.page_size)
        full = pages * self.page_size if self.spec.full_kv_bytes_per_token else 0
        swa = 0
        if self.spec.swa_kv_bytes_per_token:
            window = self.spec.sliding_window
            assert window is not None, "an SWA cost without a window (spec bug)"
            swa = min(pages, _pages(window, self.page_size) + 1) * self.page_size
        return full, swa

    def max_concurrent_requests(self, context_len: int | None = None) -> int:
        """Requests of `context_len` (default: the plan's) that run at once, all at full
        length: the least of what each pool, the state slots and the table allow."""
        length = self.context_len if context_len is None else context_len
        if length < 1:
            raise InvalidCapacity(f"context_len must be >= 1, got {length}")
        full, swa = self.request_needs(length)
        limits = [self.max_running_requests]
        if full:
            limits.append(self.full_tokens // full)
        if swa:
            limits.append(self.swa_tokens // swa)
        if self.spec.state_bytes_per_request:
            limits.append(self.mamba_slots)
        return min(limits)

    def to_json(self) -> dict[str, object]:
        """The plan as JSON-ready figures (what `kvstrata size --json` prints)."""
        spec = self.spec
        record: dict[str, object] = {
            "architecture": spec.architecture,
            "tp_size": spec.tp_size,
            "kv_dtype": spec.kv_dtype,
            "mamba_ssm_dtype": spec.mamba_ssm_dtype if spec.state_bytes_per_request else None,
            "layers": {
                "full": len(spec.full_layer_ids),
                "swa": len(spec.swa_layer_ids),
                "mamba": len(spec.mamba_layer_ids),
                "total": len(spec.layer_kinds),
            },
            "full_kv_bytes_per_token": spec.full_kv_bytes_per_token,
            "swa_kv_bytes_per_token": spec.swa_kv_bytes_per_token,
            "sliding_window": spec.sliding_window,
            "state_bytes_per_request": spec.state_bytes_per_request,
            "budget_bytes": self.budget_bytes,
            "page_size": self.page_size,
            "context_len": self.context_len,
            "full_tokens": self.full_tokens,
            "full_kv_bytes": self.full_kv_bytes,
            "swa_tokens": self.swa_tokens,
            "swa_kv_bytes": self.swa_kv_bytes,
            "mamba_slots": self.mamba_slots,
            "mamba_state_bytes": self.mamba_state_bytes,
            "max_running_requests": self.max_running_requests,
            "req_table_bytes": self.req_table_bytes,
            "used_bytes": self.used_bytes,
            "unused_bytes": self.unused_bytes,
            "max_concurrent_requests": self.max_concurrent_requests(),
            "page_bytes": self.page_bytes,
            "host": None,
        }
        if self.host is not None:
            record["host"] = {
                "ratio": self.host.ratio,
                "full_tokens": self.host.full_tokens,
                "swa_tokens": self.host.swa_tokens,
                "mamba_slots": self.host.mamba_slots,
                "size_bytes": self.host.size_bytes,
                "free_host_bytes": self.host.free_host_bytes,
            }
        return record


def plan_memory(
    spec: ModelMemorySpec,
    budget: str | int | float,
    params: SizingParams | None = None,
    *,
    free_device_bytes: int | None = None,
    free_host_bytes: int | None = None,
) -> MemoryPlan:
    """Size every pool of `spec` within `budget` (bytes, a size string such as "40GiB", or a
    fraction of `free_device_bytes`). `free_host_bytes` None: read /proc/meminfo when a host
    tier is asked for. Raises InvalidCapacity (bad knobs or budget), BudgetTooSmall (one
    request of the context does not fit, with the numbers), HostMemoryExceeded."""
    params = SizingParams() if params is None else params
    context_len = _check_params(spec, params)
    budget_bytes = resolve_budget(budget, free_bytes=free_device_bytes)
    page = params.page_size
    cell = spec.kv_bytes_per_token
    if cell == 0:
        raise InvalidModel(f"{spec.architecture} has no attention layer: nothing to size by tokens")

    # 1. The request table, sized from what the whole budget would hold (SGLang's rule).
    requests = params.max_running_requests
    if requests is None:
        provisional, _ = _carve_mamba(spec, params, budget_bytes)
        tokens = provisional // cell
        requests = min(
            max(int(tokens / context_len * DEFAULT_REQUESTS_PER_CONTEXT), MIN_DEFAULT_REQUESTS),
            MAX_DEFAULT_REQUESTS,
        )
    table_bytes = _table_bytes(requests, context_len)
    rest = budget_bytes - table_bytes

    # 2. The Mamba carve-out, then the running requests it can back; table rows the states
    #    cannot back go back to the KV pools.
    mamba_slots = 0
    if spec.state_bytes_per_request and rest > 0:
        rest, mamba_slots = _carve_mamba(spec, params, rest)
        backed = min(requests, mamba_slots // MAMBA_SLOTS_PER_RUNNING_REQUEST)
        if 0 < backed < requests:
            rest += table_bytes - _table_bytes(backed, context_len)
            table_bytes = _table_bytes(backed, context_len)
        requests = backed

    # 3-5. KV tokens, the SWA / full split, whole pages.
    tokens = max(rest, 0) // cell
    full_tokens, swa_tokens = _split_tokens(spec, params, tokens)
    plan = MemoryPlan(
        spec=spec,
        budget_bytes=budget_bytes,
        page_size=page,
        context_len=context_len,
        full_tokens=full_tokens,
        swa_tokens=swa_tokens,
        mamba_slots=mamba_slots,
        max_running_requests=requests,
        req_table_bytes=table_bytes,
        host=None,
    )
    if requests < 1 or rest <= 0 or plan.max_concurrent_requests() < 1:
        raise BudgetTooSmall(_too_small(plan, rest))
    assert plan.used_bytes <= budget_bytes, (
        f"plan takes {plan.used_bytes} of a {budget_bytes}-byte budget (sizing bug)"
    )
    host = _plan_host(plan, params, free_host_bytes)
    return replace(plan, host=host)


def _check_params(spec: ModelMemorySpec, params: SizingParams) -> int:
    if params.page_size < 1:
        raise InvalidCapacity(f"page_size must be >= 1, got {params.page_size}")
    context_len = params.context_len if params.context_len is not None else spec.context_len
    if context_len is None:
        raise InvalidCapacity(
            f"{spec.architecture} config has no max_position_embeddings: give context_len"
        )
    if context_len < 1:
        raise InvalidCapacity(f"context_len must be >= 1, got {context_len}")
    if not 0.0 < params.swa_full_tokens_ratio <= 1.0:
        raise InvalidCapacity(
            f"swa_full_tokens_ratio must be in (0, 1], got {params.swa_full_tokens_ratio}"
        )
    if not params.mamba_full_memory_ratio > 0.0:
        raise InvalidCapacity(
            f"mamba_full_memory_ratio must be > 0, got {params.mamba_full_memory_ratio}"
        )
    for name, value in (
        ("max_running_requests", params.max_running_requests),
        ("mamba_cache_size", params.mamba_cache_size),
    ):
        if value is not None and value < 1:
            raise InvalidCapacity(f"{name} must be >= 1, got {value}")
    if params.host_ratio is not None and params.host_bytes is not None:
        raise InvalidCapacity("give host_ratio or host_bytes, not both")
    if params.host_ratio is not None and not params.host_ratio > 0:
        raise InvalidCapacity(f"host_ratio must be > 0, got {params.host_ratio}")
    if params.host_bytes is not None and params.host_bytes < 1:
        raise InvalidCapacity(f"host_bytes must be >= 1, got {params.host_bytes}")
    return context_len


def _carve_mamba(spec: ModelMemorySpec, params: SizingParams, rest: int) -> tuple[int, int]:
    """(bytes left for KV, state slots) after the Mamba carve-out of `rest` (step 2)."""
    per_request = spec.state_bytes_per_request
    if not per_request:
        return rest, 0
    if params.mamba_cache_size is not None:
        slots = params.mamba_cache_size
    else:
        ratio = params.mamba_full_memory_ratio
        slots = int(rest * ratio / (1 + ratio)) // per_request
    return rest - slots * per_request, slots


def _split_tokens(spec: ModelMemorySpec, params: SizingParams, tokens: int) -> tuple[int, int]:
    """(full tokens, SWA tokens), each whole pages (steps 4 and 5)."""
    page = params.page_size
    full_cost = spec.full_kv_bytes_per_token
    swa_cost = spec.swa_kv_bytes_per_token
    if not swa_cost:
        return _align(tokens, page), 0
    if not full_cost:
        return 0, _align(tokens, page)
    ratio = params.swa_full_tokens_ratio
    memory = tokens * (full_cost + swa_cost)
    full = int(memory / (full_cost + ratio * swa_cost))
    swa = int(full * ratio)
    # Float rounding must never hand out more bytes than `memory`.
    while full * full_cost + swa * swa_cost > memory:
        full -= 1
        swa = int(full * ratio)
    return _align(full, page), _align(swa, page)


def _plan_host(
    plan: MemoryPlan, params: SizingParams, free_host_bytes: int | None
) -> HostPlan | None:
    if params.host_ratio is None and params.host_bytes is None:
        return None
    device_pool_bytes = plan.full_kv_bytes + plan.swa_kv_bytes + plan.mamba_state_bytes
    if params.host_ratio is not None:
        ratio = params.host_ratio
    else:
        assert params.host_bytes is not None, "host_ratio or host_bytes (checked above)"
        ratio = params.host_bytes / device_pool_bytes
    page = plan.page_size
    full = _align(int(plan.full_tokens * ratio), page)
    swa = _align(int(plan.swa_tokens * ratio), page)
    slots = int(plan.mamba_slots * ratio)
    spec = plan.spec
    size = (
        full * spec.full_kv_bytes_per_token
        + swa * spec.swa_kv_bytes_per_token
        + slots * spec.state_bytes_per_request
    )
    if full == 0 and swa == 0:
        raise InvalidCapacity(
            f"a host tier at ratio {ratio:.4g} holds no whole page "
            f"({plan.page_bytes} bytes of KV each)"
        )
    free = free_host_memory() if free_host_bytes is None else free_host_bytes
    if size > free:
        raise HostMemoryExceeded(
            f"host tier of {format_bytes(size)} ({size} bytes, ratio {ratio:.4g} of the device "
            f"pools) exceeds the free host memory, {format_bytes(free)} ({free} bytes)"
        )
    return HostPlan(
        ratio=ratio,
        full_tokens=full,
        swa_tokens=swa,
        mamba_slots=slots,
        size_bytes=size,
        free_host_bytes=free,
    )


def _too_small(plan: MemoryPlan, rest: int) -> str:
    spec = plan.spec
    full, swa = plan.request_needs(plan.context_len)
    parts = [
        f"budget {format_bytes(plan.budget_bytes)} ({plan.budget_bytes} bytes) cannot hold one "
        f"request of {plan.context_len} tokens for {spec.architecture} "
        f"(tp {spec.tp_size}, kv {spec.kv_dtype}, page {plan.page_size})",
        f"request table {plan.req_table_bytes} bytes "
        f"({plan.max_running_requests} rows of {plan.context_len} int32 + row 0)",
    ]
    if spec.state_bytes_per_request:
        parts.append(
            f"Mamba states {plan.mamba_slots} x {spec.state_bytes_per_request} bytes "
            f"(one running request needs {MAMBA_SLOTS_PER_RUNNING_REQUEST} slots)"
        )
    parts.append(f"left for KV {max(rest, 0)} bytes")
    if full:
        parts.append(
            f"full pool {plan.full_tokens} tokens x {spec.full_kv_bytes_per_token} bytes, "
            f"one request needs {full} tokens ({full * spec.full_kv_bytes_per_token} bytes)"
        )
    if swa:
        parts.append(
            f"SWA pool {plan.swa_tokens} tokens x {spec.swa_kv_bytes_per_token} bytes, "
            f"one request needs {swa} tokens ({swa * spec.swa_kv_bytes_per_token} bytes)"
        )
    return "; ".join(parts)


def _table_bytes(requests: int, context_len: int) -> int:
    return (requests + 1) * context_len * REQ_TABLE_SLOT_BYTES


def _pages(tokens: int, page_size: int) -> int:
    return math.ceil(tokens / page_size)


def _align(tokens: int, page_size: int) -> int:
    return tokens // page_size * page_size
