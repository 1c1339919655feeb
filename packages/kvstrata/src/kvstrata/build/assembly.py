"""`build(spec, budget, options)`: a model's `ModelMemorySpec` and a device budget in, the wired
`MemorySystem` out, every pool sized by `plan_memory`.

    ModelMemorySpec ──> plan_memory(budget) ──> MemoryPlan (tokens, slots, request rows)
          │                                          │
          └──> model config of the family ───────────┴──> family builder ──> MemorySystem
                 (MHAModel / SWAModel / MambaModel,          (+ the request table)
                  or an MLA pool built here)

The families are told apart by the layer kinds: MLA (a latent pool, Full tree), full attention
only (`mha`), full + sliding-window (`swa`), attention + Mamba (`mamba`). Mamba-1 states
(Jamba) fit the state pool as `[channels, 1, d_state]`: the same bytes as `[channels, d_state]`.
A layer holding attention and Mamba state at once (Falcon-H1's parallel hybrid blocks) gets
two router ids, since the layer router gives each id one pool: its KV is layer i, its state
layer `num_layers + i` (`MemorySystem.parallel_state_offset`, `state_layer_id(i)`).
Not buildable yet, refused by name before anything is allocated: models with sliding-window and
Mamba layers together (no tree family has both a sliding-window and a Mamba component: the
missing piece is an SWA + Mamba tree family and its builder), and models of sliding-window
layers only.

`build_tiered` adds the host tier the plan sized (`SizingParams.host_ratio` / `host_bytes`,
checked against the free host memory) and, with `BuildOptions.storage_url`, storage, through
`build_tiers(system, host_tokens=plan.host.full_tokens)`: its mirrors keep the device
proportions, as the plan's do.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from kvstrata.allocator import PagedAllocator
from kvstrata.build.budget import free_device_memory, is_fraction
from kvstrata.build.errors import InvalidCapacity, InvalidModel, UnknownPolicy
from kvstrata.build.factory import POLICIES, check_device
from kvstrata.build.hf_layout import AttentionShape, LatentShape, StateShape
from kvstrata.build.mamba import MambaModel, build_mamba_system
from kvstrata.build.mha import MHAModel, build_mha_system, full_only_system
from kvstrata.build.model_spec import ModelMemorySpec
from kvstrata.build.sizing import MemoryPlan, SizingParams, plan_memory
from kvstrata.build.swa import SWAModel, build_swa_system
from kvstrata.build.system import BuildParams, MemorySystem
from kvstrata.build.tiers import TieredSystem, build_tiers
from kvstrata.pool import MLAKVPool, MLASpec, ReqToTokenPool
from kvstrata.unified_radix_cache.tiers import TierParams

#: Torch dtype of each `ModelMemorySpec.kv_dtype` / SSM / conv dtype name.
TORCH_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


@dataclass(frozen=True, kw_only=True)
class BuildOptions:
    """How to build: the sizing knobs (`SizingParams`), the tree's eviction policy, the device,
    KV events, the L3 `storage_url` and the hierarchical cache's `tier_params` (write and
    prefetch policies; `build_tiered`). `free_device_bytes` / `free_host_bytes`: what a
    fractional budget and the host check refer to (None: measured on `device` / read from
    /proc/meminfo when needed)."""

    sizing: SizingParams = field(default_factory=SizingParams)
    policy: str = "lru"
    device: torch.device | str = "cpu"
    enable_events: bool = False
    free_device_bytes: int | None = None
    free_host_bytes: int | None = None
    storage_url: str | None = None
    tier_params: TierParams | None = None


@dataclass(frozen=True, kw_only=True, eq=False)
class BuiltSystem:
    """What `build_with_plan` returns: the system and the plan it was sized by."""

    system: MemorySystem
    plan: MemoryPlan


def build(
    spec: ModelMemorySpec, budget: str | int | float, options: BuildOptions | None = None
) -> MemorySystem:
    """The memory system of `spec` within `budget` ("40GiB", bytes, or a fraction of the free
    device memory): allocators, pools, layer router, tree and request table, each pool sized
    by `plan_memory(spec, budget, options.sizing)`. Raises every error of `plan_memory`,
    UnknownPolicy, DeviceUnavailable, and InvalidModel for a layout not buildable yet (module
    docstring), all before any pool is allocated."""
    return build_with_plan(spec, budget, options).system


def build_with_plan(
    spec: ModelMemorySpec, budget: str | int | float, options: BuildOptions | None = None
) -> BuiltSystem:
    """`build`, also returning the `MemoryPlan` (host tier figures, unused bytes, ...)."""
    options = BuildOptions() if options is None else options
    if options.policy not in POLICIES:
        raise UnknownPolicy(
            f"unknown eviction policy {options.policy!r}; choose from {', '.join(POLICIES)}"
        )
    device = check_device(options.device)
    _check_buildable(spec)
    free = options.free_device_bytes
    if free is None and is_fraction(budget):
        free = free_device_memory(device)
    plan = plan_memory(
        spec,
        budget,
        options.sizing,
        free_device_bytes=free,
        free_host_bytes=options.free_host_bytes,
    )
    params = BuildParams(
        capacity_tokens=plan.full_tokens,
        page_size=plan.page_size,
        policy=options.policy,
        device=device,
        swa_ratio=_swa_ratio(plan),
        mamba_slots=plan.mamba_slots or None,
        enable_events=options.enable_events,
    )
    system = _build_family(spec, params)
    table = ReqToTokenPool(plan.max_running_requests, plan.context_len, device)
    return BuiltSystem(system=replace(system, req_to_token=table), plan=plan)


def build_tiered(
    spec: ModelMemorySpec, budget: str | int | float, options: BuildOptions | None = None
) -> TieredSystem:
    """`build`, then the host tier of the plan (`options.sizing.host_ratio` or `host_bytes`,
    required) and storage at `options.storage_url` under it: pools, allocators, tree, host
    mirrors, transfer controller and hierarchical cache. `close()` it when done. Raises what
    `build` and `build_tiers` raise (InvalidCapacity without a host size). MLA models get a
    host mirror of the latent pool (`pool_host.MLAHostPool`)."""
    options = BuildOptions() if options is None else options
    sizing = options.sizing
    if sizing.host_ratio is None and sizing.host_bytes is None:
        raise InvalidCapacity("build_tiered needs a host tier: set sizing.host_ratio or host_bytes")
    built = build_with_plan(spec, budget, options)
    host = built.plan.host
    assert host is not None, "plan_memory sizes a host tier when asked (checked above)"
    return build_tiers(
        built.system,
        host_tokens=host.full_tokens,
        storage_url=options.storage_url,
        params=options.tier_params,
    )


def _check_buildable(spec: ModelMemorySpec) -> None:
    kinds = set(spec.layer_kinds)
    if "swa" in kinds and kinds & {"mamba", "full+mamba"}:
        raise InvalidModel(
            f"{spec.architecture}: sliding-window and Mamba layers together cannot be built "
            "yet (no tree family has both an SWA and a Mamba component); kvstrata size "
            "sizes them"
        )
    if spec.is_mla and spec.mamba_layer_ids:
        raise InvalidModel(
            f"{spec.architecture}: MLA and Mamba layers together cannot be built yet (the "
            "Mamba family's KV pool is an MHA pool)"
        )
    if "swa" in kinds and "full" not in kinds:
        raise InvalidModel(
            f"{spec.architecture}: a model of sliding-window layers only cannot be built yet "
            "(the SWA pool pairs every window slot with a full slot)"
        )


def _swa_ratio(plan: MemoryPlan) -> float:
    """The SWA builder's `swa_ratio` for exactly `plan.swa_tokens` (it takes int(size x ratio)
    and rounds down to pages; half a token of slack keeps float error from losing a page)."""
    if not plan.swa_tokens:
        return 1.0
    return min(1.0, (plan.swa_tokens + 0.5) / plan.full_tokens)


def _build_family(spec: ModelMemorySpec, params: BuildParams) -> MemorySystem:
    layout = spec.layout
    kv_dtype = TORCH_DTYPES[spec.kv_dtype]
    if isinstance(layout.full, LatentShape):
        return _build_mla(spec, layout.full, kv_dtype, params)
    full = layout.full
    assert isinstance(full, AttentionShape), "a buildable layout has full attention (checked)"
    if layout.state is not None:
        mamba = _mamba_model(spec, full, kv_dtype, layout.state)
        system = build_mamba_system(mamba, params)
        if mamba.mamba_layer_ids != spec.mamba_layer_ids:
            system = replace(system, parallel_state_offset=len(spec.layer_kinds))
        return system
    if layout.swa is not None:
        window = spec.sliding_window
        assert window is not None, "an SWA layout has a window (reader invariant)"
        swa_model = SWAModel(
            full_layer_ids=spec.full_layer_ids,
            swa_layer_ids=spec.swa_layer_ids,
            sliding_window=window,
            num_kv_heads=full.num_kv_heads,
            head_dim=full.head_dim,
            dtype=kv_dtype,
        )
        return build_swa_system(swa_model, params)
    mha_model = MHAModel(
        num_layers=len(spec.full_layer_ids),
        num_kv_heads=full.num_kv_heads,
        head_dim=full.head_dim,
        dtype=kv_dtype,
    )
    return build_mha_system(mha_model, params)


def _mamba_model(
    spec: ModelMemorySpec, full: AttentionShape, kv_dtype: torch.dtype, state: StateShape
) -> MambaModel:
    """The MambaModel of a layout; a Mamba-1 SSM state `[channels, d_state]` becomes
    `[channels, 1, d_state]` (the same bytes); parallel hybrid layers' states get ids past the
    last model layer."""
    assert spec.conv_dtype is not None, "a spec with state has a conv dtype (from_layout)"
    conv_dim, conv_width = state.conv
    if len(state.ssm) == 2:
        heads, state_head_dim, state_size = state.ssm[0], 1, state.ssm[1]
    else:
        heads, state_head_dim, state_size = state.ssm
    # A parallel hybrid layer's state is routed as layer num_layers + i (module docstring).
    num_layers = len(spec.layer_kinds)
    mamba_ids = tuple(
        i + num_layers if spec.layer_kinds[i] == "full+mamba" else i for i in spec.mamba_layer_ids
    )
    return MambaModel(
        attention_layer_ids=spec.full_layer_ids,
        mamba_layer_ids=mamba_ids,
        num_kv_heads=full.num_kv_heads,
        head_dim=full.head_dim,
        dtype=kv_dtype,
        conv_dim=conv_dim,
        conv_kernel=conv_width + 1,
        num_heads=heads,
        state_head_dim=state_head_dim,
        state_size=state_size,
        conv_dtype=TORCH_DTYPES[spec.conv_dtype],
        ssm_dtype=TORCH_DTYPES[spec.mamba_ssm_dtype],
    )


def _build_mla(
    spec: ModelMemorySpec, latent: LatentShape, dtype: torch.dtype, params: BuildParams
) -> MemorySystem:
    """Paged allocator + MLA latent pool + Full-only tree."""
    size, page_size, device = params.capacity_tokens, params.page_size, params.device
    mla_spec = MLASpec(
        num_layers=len(spec.full_layer_ids),
        kv_lora_rank=latent.kv_lora_rank,
        qk_rope_head_dim=latent.qk_rope_head_dim,
        dtype=dtype,
    )
    allocator = PagedAllocator(size=size, page_size=page_size, device=device)
    pool = MLAKVPool(mla_spec, size, page_size, device)
    return full_only_system("mla", mla_spec, allocator, pool, params)
