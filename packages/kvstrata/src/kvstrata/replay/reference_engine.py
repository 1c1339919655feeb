"""A reference engine: a tiny torch model (seeded random weights, float32) whose caches live in a
`kvstrata.build.MemorySystem`, scheduled through `kvstrata.allocation`.

Layers by the config's kinds: GQA attention (full or sliding-window) reading K/V through the
request-to-token table and the pools; MLA-style latent attention (the latent and rotary key
stored per token in an `MLAKVPool`, queries absorbed into the latent space); a simple
recurrent layer (a causal conv + diagonal linear recurrence over the `[heads, head_dim,
d_state]` SSM state) whose conv and SSM state live in the `MambaPool` slot of the request;
both side by side in a parallel hybrid block (Falcon-H1: the state under
`MemorySystem.state_layer_id`);
layers without a cache (Nemotron-H's MLP layers) only run the MLP every layer has.

Every token is computed on its own (one token through every layer, in position order), so
each result is a function of the token, its position and what the caches hold for the
positions before it, never of how requests were batched or chunked: with a correct cache the
logits are bitwise the same whether a prefix was computed now or read back from the cache.

`kvstrata replay --engine reference` runs it on the embedded workload; the integration tests
(`integration_tests/test_reference_engine.py`) compare its logits with the cache on and off.
Its weights are shaped from the `ModelMemorySpec` (the pools' shapes) and the config's
`hidden_size`, `num_attention_heads` and `vocab_size`: `reference_parameters` counts them
before anything is allocated, and `check_reference_model` refuses a model too large to run
token by token on a CPU (`ReferenceModelTooLarge`) or of a layout it has no layer for.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from kvstrata.allocation import BatchAllocator, Running
from kvstrata.build import MemorySystem, ModelMemorySpec
from kvstrata.build.hf_layout import AttentionShape, LatentShape
from kvstrata.pool import MLAKVPool, SWAKVPool
from kvstrata.replay.errors import (
    ReferenceModelTooLarge,
    ReplayOptionError,
    RequestDoesNotFit,
)
from kvstrata.unified_radix_cache import PrefixCache

__all__ = [
    "MAX_REFERENCE_PARAMETERS",
    "EngineRun",
    "ReferenceDims",
    "ReferenceEngine",
    "ReferenceModel",
    "check_reference_model",
    "reference_parameters",
]

#: The largest model `check_reference_model` accepts: 16 Mi float32 weights (64 MiB), a model
#: that computes a token in about a millisecond per layer on a CPU core.
MAX_REFERENCE_PARAMETERS = 1 << 24


@dataclass(frozen=True, kw_only=True)
class ReferenceDims:
    """The figures the reference model's weights are shaped by (see `ReferenceDims.of`)."""

    hidden: int
    vocab: int
    heads: int
    kinds: tuple[str, ...]
    #: KV heads and head dim of an attention layer (full or sliding: the builder gives both
    #: the full layers' shape), or None.
    attention: tuple[int, int] | None
    #: kv_lora_rank and qk_rope_head_dim of an MLA layer, or None.
    latent: tuple[int, int] | None
    #: conv_dim, conv width (kernel - 1), SSM heads, head dim, d_state of a Mamba layer, or None.
    state: tuple[int, int, int, int, int] | None

    @classmethod
    def of(cls, config: Mapping[str, object], spec: ModelMemorySpec) -> ReferenceDims:
        """Read from `config` (its `text_config` when nested) and `spec`. ReplayOptionError
        for a layout the model has no layer for or a missing/invalid field."""
        text = config.get("text_config")
        cfg: Mapping[str, object] = text if isinstance(text, Mapping) else config
        kinds = tuple(str(k) for k in spec.layer_kinds)
        layout = spec.layout
        attention = latent = state = None
        if isinstance(layout.full, LatentShape):
            latent = (layout.full.kv_lora_rank, layout.full.qk_rope_head_dim)
        elif isinstance(layout.full, AttentionShape):
            attention = (layout.full.num_kv_heads, layout.full.head_dim)
        if layout.state is not None:
            conv_dim, width = layout.state.conv
            ssm = layout.state.ssm
            heads, head_dim, d_state = (ssm[0], 1, ssm[1]) if len(ssm) == 2 else ssm
            state = (conv_dim, width, heads, head_dim, d_state)
        heads = _positive(cfg, "num_attention_heads", spec)
        if attention is not None and heads % attention[0]:
            raise ReplayOptionError(
                f"{spec.architecture}: num_attention_heads {heads} is not a multiple of the "
                f"{attention[0]} KV heads"
            )
        return cls(
            hidden=_positive(cfg, "hidden_size", spec),
            vocab=_positive(cfg, "vocab_size", spec),
            heads=heads,
            kinds=kinds,
            attention=attention,
            latent=latent,
            state=state,
        )

    def layer_shapes(self, kind: str) -> dict[str, tuple[int, ...]]:
        """The weights of one layer of `kind`, name -> shape (the MLP's included)."""
        d, heads = self.hidden, self.heads
        shapes: dict[str, tuple[int, ...]] = {}
        if kind == "full+mamba":  # a parallel hybrid block: both mixers, their outputs summed
            return self.layer_shapes("full") | self.layer_shapes("mamba")
        if kind == "mamba":
            assert self.state is not None, "a Mamba layer has a state shape (spec invariant)"
            c, k, h, p, n = self.state
            shapes |= {"in": (d, c), "conv": (c, k + 1), "x": (c, h * p), "out": (h * p, d)}
            shapes |= {"a": (h, 1, n), "b": (h, 1, n), "c": (h, 1, n)}
        elif kind in ("full", "swa") and self.latent is not None:
            r, rope = self.latent
            shapes |= {"dkv": (d, r), "kr": (d, rope), "q": (d, heads * (r + rope))}
            shapes["o"] = (heads * r, d)
        elif kind in ("full", "swa"):
            assert self.attention is not None, "an attention layer has a shape (spec invariant)"
            g, hd = self.attention
            shapes |= {"q": (d, heads * hd), "k": (d, g * hd), "v": (d, g * hd)}
            shapes["o"] = (heads * hd, d)
        shapes |= {"mlp_in": (d, 2 * d), "mlp_out": (2 * d, d)}
        return shapes

    @property
    def parameters(self) -> int:
        """Weights of the whole model: the (tied) embedding and every layer's."""
        total = self.vocab * self.hidden
        for kind in self.kinds:
            for shape in self.layer_shapes(kind).values():
                total += _product(shape)
        return total


def reference_parameters(config: Mapping[str, object], spec: ModelMemorySpec) -> int:
    """The reference model's weight count for `config` (nothing is allocated)."""
    return ReferenceDims.of(config, spec).parameters


def check_reference_model(
    config: Mapping[str, object],
    spec: ModelMemorySpec,
    *,
    max_parameters: int = MAX_REFERENCE_PARAMETERS,
) -> ReferenceDims:
    """The dims of `config`, if the reference model can run it: ReplayOptionError for a layout
    it has no layer for, ReferenceModelTooLarge past `max_parameters` weights."""
    dims = ReferenceDims.of(config, spec)
    if dims.parameters > max_parameters:
        raise ReferenceModelTooLarge(
            architecture=spec.architecture, parameters=dims.parameters, limit=max_parameters
        )
    return dims


def _positive(cfg: Mapping[str, object], name: str, spec: ModelMemorySpec) -> int:
    value = cfg.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ReplayOptionError(
            f"{spec.architecture} config needs a positive integer {name} for the reference "
            f"model, got {value!r}"
        )
    return value


def _product(shape: tuple[int, ...]) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


class ReferenceModel:
    """Weights of `config` (a small HF config) for the pools of `system`: seeded with `seed`,
    float32 on the system's device. Raises what `ReferenceDims.of` raises, and
    ReplayOptionError when the pools' dtype is not float32 (bitwise checks need it) or their
    shapes are not the spec's."""

    def __init__(
        self, config: Mapping[str, object], system: MemorySystem, *, seed: int = 0
    ) -> None:
        spec = ModelMemorySpec.from_hf_config(config)
        dims = ReferenceDims.of(config, spec)
        _check_pools(system, dims)
        gen = torch.Generator().manual_seed(seed)
        device = system.device
        d = dims.hidden
        self.dims = dims
        self.vocab = dims.vocab
        self.heads = dims.heads
        self.system = system
        self.kinds = dims.kinds
        self.window = spec.sliding_window
        self.embed = (_w(gen, self.vocab, d) * d**0.5).to(device)
        self.weights: list[dict[str, torch.Tensor]] = []
        for kind in self.kinds:
            w = {name: _w(gen, *shape) for name, shape in dims.layer_shapes(kind).items()}
            if kind == "mamba":
                w["a"] = torch.sigmoid(w["a"] * w["a"].shape[0] ** 0.5)  # decay in (0, 1)
            self.weights.append({name: t.to(device) for name, t in w.items()})

    def token(self, row: int, pos: int, token: int, loc: int, state: int | None) -> torch.Tensor:
        """Logits of `token` at `pos` of request `row` (table row), writing its KV at full slot
        `loc` and advancing the state in slot `state`."""
        h = self.embed[token].clone()
        for layer, (kind, w) in enumerate(zip(self.kinds, self.weights, strict=True)):
            x = _norm(h)
            if kind == "mamba":
                h = h + self._recurrent(layer, w, x, state)
            elif kind == "full+mamba":
                y = self._attention(layer, "full", w, x, row, pos, loc)
                h = h + (y + self._recurrent(layer, w, x, state))
            elif kind == "none":
                pass
            elif isinstance(self.system.kv_pool, MLAKVPool):
                h = h + self._latent(layer, w, x, row, pos, loc)
            else:
                h = h + self._attention(layer, kind, w, x, row, pos, loc)
            h = h + torch.relu(_norm(h) @ w["mlp_in"]) @ w["mlp_out"]
        return _norm(h) @ self.embed.T

    def _slots(self, row: int, start: int, pos: int) -> torch.Tensor:
        table = self.system.req_to_token
        assert table is not None
        return table.req_to_token[row, start : pos + 1].to(torch.int64)

    def _attention(
        self,
        layer: int,
        kind: str,
        w: dict[str, torch.Tensor],
        x: torch.Tensor,
        row: int,
        pos: int,
        loc: int,
    ) -> torch.Tensor:
        layers = self.system.layers
        g, hd = layers.get_key_buffer(layer).shape[1:]
        loc_t = torch.tensor([loc], device=self.system.device)
        layers.set_kv(layer, loc_t, (x @ w["k"]).reshape(1, g, hd), (x @ w["v"]).reshape(1, g, hd))
        start = 0 if kind == "full" or self.window is None else max(0, pos - self.window + 1)
        slots = self._slots(row, start, pos)
        pool = self.system.kv_pool
        if kind == "swa" and isinstance(pool, SWAKVPool):
            slots = pool.translate(slots)
        rep = self.heads // g
        k = layers.get_key_buffer(layer)[slots].repeat_interleave(rep, dim=1)
        v = layers.get_value_buffer(layer)[slots].repeat_interleave(rep, dim=1)
        q = (x @ w["q"]).reshape(self.heads, hd)
        p = torch.softmax((k * q).sum(-1) / hd**0.5, dim=0)
        return (p.unsqueeze(-1) * v).sum(0).reshape(-1) @ w["o"]

    def _latent(
        self, layer: int, w: dict[str, torch.Tensor], x: torch.Tensor, row: int, pos: int, loc: int
    ) -> torch.Tensor:
        pool = self.system.kv_pool
        assert isinstance(pool, MLAKVPool)
        r, rope = pool.spec.kv_lora_rank, pool.spec.qk_rope_head_dim
        latent, k_rope = (x @ w["dkv"]).reshape(1, 1, r), (x @ w["kr"]).reshape(1, 1, rope)
        pool.set_kv(layer, torch.tensor([loc], device=self.system.device), latent, k_rope)
        kv = pool.get_key_buffer(layer)[self._slots(row, 0, pos)].reshape(-1, r + rope)
        q = (x @ w["q"]).reshape(self.heads, r + rope)
        p = torch.softmax((kv.unsqueeze(1) * q).sum(-1) / (r + rope) ** 0.5, dim=0)
        return (p.unsqueeze(-1) * kv[:, None, :r]).sum(0).reshape(-1) @ w["o"]

    def _recurrent(
        self, layer: int, w: dict[str, torch.Tensor], x: torch.Tensor, state: int | None
    ) -> torch.Tensor:
        pool = self.system.mamba_pool
        assert pool is not None and state is not None
        local = self.system.mamba_layer_ids.index(self.system.state_layer_id(layer))
        conv, ssm = pool.conv_state[local], pool.ssm_state[local]
        window = torch.cat([conv[state], (x @ w["in"]).unsqueeze(-1)], dim=-1)
        xc = (window * w["conv"]).sum(-1)
        conv[state] = window[:, 1:]
        heads, head_dim = w["a"].shape[0], w["x"].shape[1] // w["a"].shape[0]
        u = (xc @ w["x"]).reshape(heads, head_dim, 1)
        s = w["a"] * ssm[state] + w["b"] * u
        ssm[state] = s
        return (s * w["c"]).sum(-1).reshape(-1) @ w["out"]


def _w(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float32) / shape[0] ** 0.5


def _norm(x: torch.Tensor) -> torch.Tensor:
    return x / (x.pow(2).mean() + 1e-5).sqrt()


def _check_pools(system: MemorySystem, dims: ReferenceDims) -> None:
    """The pools hold float32 in the shapes `dims` gives (ReplayOptionError otherwise)."""
    if system.req_to_token is None:
        raise ReplayOptionError("the reference model needs a system with a request table (build)")
    pool = system.kv_pool
    if isinstance(pool, MLAKVPool):
        dtype = pool.spec.dtype
    else:
        dtype = system.layers.get_key_buffer(system.attention_layer_ids[0]).dtype
    if dtype != torch.float32:
        raise ReplayOptionError(f"the reference model needs float32 KV pools, got {dtype}")
    state = system.mamba_pool
    if state is not None:
        if {state.spec.conv_dtype, state.spec.ssm_dtype} != {torch.float32}:
            raise ReplayOptionError("the reference model needs float32 Mamba state")
        assert dims.state is not None, "a Mamba pool for a spec without state (build bug)"
        c, k, h, p, n = dims.state
        conv, ssm = tuple(state.conv_state.shape[2:]), tuple(state.ssm_state.shape[2:])
        if conv != (c, k) or ssm != (h, p, n):
            raise ReplayOptionError(
                f"Mamba pool shapes {conv} / {ssm} are not the spec's {(c, k)} / {(h, p, n)}"
            )


@dataclass
class _Job:
    rid: int
    tokens: list[int]
    outputs: int = 0
    running: Running | None = None


@dataclass
class EngineRun:
    """What `ReferenceEngine.run` returns: per request, the logits of every output step (in
    order), and counters (`computed_tokens`: tokens run through the model)."""

    logits: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    outputs: dict[int, list[int]] = field(default_factory=dict)
    hit_tokens: int = 0
    computed_tokens: int = 0
    retractions: int = 0
    steps: int = 0


class ReferenceEngine:
    """Chunked prefill + greedy decode of a batch of prompts through `BatchAllocator`.

    `cache_prefixes=False` is the cache-off baseline: requests end with `abort` (nothing is
    cached), so every token is computed. Under memory pressure (a prepare call returns None)
    the newest running request is retracted and re-admitted when others finished; a request
    that does not fit alone raises RequestDoesNotFit.
    """

    def __init__(
        self,
        model: ReferenceModel,
        cache: PrefixCache,
        *,
        chunk: int = 8,
        max_running: int = 4,
        cache_prefixes: bool = True,
    ) -> None:
        system = model.system
        assert system.req_to_token is not None
        self.model = model
        self.alloc = BatchAllocator(
            cache,
            kv_allocator=system.kv_allocator,
            req_to_token=system.req_to_token,
            state_pool=system.mamba_pool,
        )
        self.chunk, self.max_running, self.cache_prefixes = chunk, max_running, cache_prefixes

    def run(self, prompts: list[list[int]], max_new_tokens: int) -> EngineRun:
        out = EngineRun()
        waiting = deque(_Job(i, list(p)) for i, p in enumerate(prompts))
        running: list[_Job] = []
        held_back = False  # after a retraction, admit again only once a request finished
        while waiting or running:
            while waiting and len(running) < self.max_running and not (held_back and running):
                job = waiting[0]
                job.running = self.alloc.admit(job.tokens)
                if job.running is None:
                    break
                out.hit_tokens += job.running.hit_len
                running.append(waiting.popleft())
            if not running:
                raise RequestDoesNotFit(
                    f"request {waiting[0].rid} does not fit the memory system: no table row, "
                    "state slot or KV room for its matched prefix"
                )
            out.steps += 1
            if not self._step(running, out):
                if len(running) == 1:
                    raise RequestDoesNotFit(
                        f"request {running[0].rid} alone does not fit the memory system "
                        f"({running[0].running.seq_len if running[0].running else 0} tokens "
                        "computed); raise the device budget"
                    )
                held_back = True
                victim = running.pop()
                assert victim.running is not None
                # job.tokens already ends with the last output, which has no KV yet.
                if self.cache_prefixes:
                    self.alloc.retract(victim.running)
                else:
                    self.alloc.abort(victim.running)
                victim.running = None
                out.retractions += 1
                waiting.appendleft(victim)
            for job in [j for j in running if j.outputs >= max_new_tokens]:
                assert job.running is not None
                if self.cache_prefixes:
                    self.alloc.finish(job.running)
                else:
                    self.alloc.abort(job.running)
                running.remove(job)
                held_back = False
        return out

    def _step(self, jobs: list[_Job], out: EngineRun) -> bool:
        """One extend batch (requests still prefilling) or one decode batch. False: no room."""
        pre = [j for j in jobs if j.running is not None and not j.running.prefilled]
        if pre:
            chunks = [
                (j.running, min(self.chunk, j.running.num_tokens - j.running.seq_len))
                for j in pre
                if j.running is not None
            ]
            batch = self.alloc.prepare_extend(chunks)
            if batch is None:
                return False
            offset = 0
            for (r, n), job in zip(chunks, pre, strict=True):
                logits = None
                for i in range(n):
                    pos = r.seq_len - n + i
                    logits = self._token(r, pos, int(batch.out_cache_loc[offset + i]))
                offset += n
                out.computed_tokens += n
                if r.prefilled:
                    assert logits is not None
                    self._emit(job, logits, out)
                elif self.cache_prefixes:
                    self.alloc.cache_chunk(r)
            return True
        dec = [j for j in jobs if j.running is not None]
        nxt = [j.tokens[-1] for j in dec]
        batch = self.alloc.prepare_decode([j.running for j in dec if j.running], nxt)
        if batch is None:
            return False
        for i, job in enumerate(dec):
            r = job.running
            assert r is not None
            self._emit(job, self._token(r, r.seq_len - 1, int(batch.out_cache_loc[i])), out)
            out.computed_tokens += 1
        return True

    def _token(self, r: Running, pos: int, loc: int) -> torch.Tensor:
        return self.model.token(r.row, pos, r.tokens[pos], loc, r.state_slot)

    @staticmethod
    def _emit(job: _Job, logits: torch.Tensor, out: EngineRun) -> None:
        out.logits.setdefault(job.rid, []).append(logits)
        token = int(torch.argmax(logits))
        out.outputs.setdefault(job.rid, []).append(token)
        job.tokens.append(token)
        job.outputs += 1
