"""A reference engine: a tiny torch model (seeded random weights, float32, CPU) whose caches
live in a `kvstrata.build.MemorySystem`, scheduled through `kvstrata.allocation`.

Layers by the config's kinds: GQA attention (full or sliding-window) reading K/V through the
request-to-token table and the pools; MLA-style latent attention (the latent and rotary key
stored per token in an `MLAKVPool`, queries absorbed into the latent space); a simple
recurrent layer (a causal conv + diagonal linear recurrence) whose conv and SSM state live in
the `MambaPool` slot of the request.

Every token is computed on its own (one token through every layer, in position order), so
each result is a function of the token, its position and what the caches hold for the
positions before it, never of how requests were batched or chunked: with a correct cache the
logits are bitwise the same whether a prefix was computed now or read back from the cache.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from kvstrata.allocation import BatchAllocator, Running
from kvstrata.build import MemorySystem, ModelMemorySpec
from kvstrata.pool import MLAKVPool, SWAKVPool
from kvstrata.unified_radix_cache import PrefixCache


def _w(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float32) / shape[0] ** 0.5


class ReferenceModel:
    """Weights of `config` (a tiny HF config) for the pools of `system`."""

    def __init__(self, config: dict[str, object], system: MemorySystem, *, seed: int = 0) -> None:
        spec = ModelMemorySpec.from_hf_config(config)
        gen = torch.Generator().manual_seed(seed)
        d = int(config["hidden_size"])  # type: ignore[arg-type]
        self.vocab = int(config["vocab_size"])  # type: ignore[arg-type]
        self.heads = int(config["num_attention_heads"])  # type: ignore[arg-type]
        self.system = system
        self.kinds = spec.layer_kinds
        self.window = spec.sliding_window
        self.embed = _w(gen, self.vocab, d) * d**0.5
        self.weights: list[dict[str, torch.Tensor]] = []
        pool = system.kv_pool
        for layer, kind in enumerate(self.kinds):
            w: dict[str, torch.Tensor] = {}
            if kind == "mamba":
                conv = system.mamba_pool.conv_state  # type: ignore[union-attr]
                ssm = system.mamba_pool.ssm_state  # type: ignore[union-attr]
                c, k = conv.shape[2], conv.shape[3] + 1
                n = ssm.shape[-1]
                w |= {"in": _w(gen, d, c), "conv": _w(gen, c, k), "out": _w(gen, c, d)}
                w["a"] = torch.sigmoid(torch.randn(c, 1, n, generator=gen))
                w["b"] = _w(gen, c, 1, n)
                w["c"] = _w(gen, c, 1, n)
            elif isinstance(pool, MLAKVPool):
                r, rope = pool.spec.kv_lora_rank, pool.spec.qk_rope_head_dim
                w |= {"dkv": _w(gen, d, r), "kr": _w(gen, d, rope)}
                w |= {"q": _w(gen, d, self.heads * (r + rope)), "o": _w(gen, self.heads * r, d)}
            else:
                g, hd = system.layers.get_key_buffer(layer).shape[1:]
                w |= {"q": _w(gen, d, self.heads * hd), "k": _w(gen, d, g * hd)}
                w |= {"v": _w(gen, d, g * hd), "o": _w(gen, self.heads * hd, d)}
            w["mlp_in"], w["mlp_out"] = _w(gen, d, 2 * d), _w(gen, 2 * d, d)
            self.weights.append(w)

    def token(self, row: int, pos: int, token: int, loc: int, state: int | None) -> torch.Tensor:
        """Logits of `token` at `pos` of request `row` (table row), writing its KV at full slot
        `loc` and advancing the state in slot `state`."""
        h = self.embed[token].clone()
        for layer, (kind, w) in enumerate(zip(self.kinds, self.weights, strict=True)):
            x = _norm(h)
            if kind == "mamba":
                y = self._recurrent(layer, w, x, state)
            elif isinstance(self.system.kv_pool, MLAKVPool):
                y = self._latent(layer, w, x, row, pos, loc)
            else:
                y = self._attention(layer, kind, w, x, row, pos, loc)
            h = h + y
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
        loc_t = torch.tensor([loc])
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
        pool.set_kv(layer, torch.tensor([loc]), latent, k_rope)
        kv = pool.get_key_buffer(layer)[self._slots(row, 0, pos)].reshape(-1, r + rope)
        q = (x @ w["q"]).reshape(self.heads, r + rope)
        p = torch.softmax((kv.unsqueeze(1) * q).sum(-1) / (r + rope) ** 0.5, dim=0)
        return (p.unsqueeze(-1) * kv[:, None, :r]).sum(0).reshape(-1) @ w["o"]

    def _recurrent(
        self, layer: int, w: dict[str, torch.Tensor], x: torch.Tensor, state: int | None
    ) -> torch.Tensor:
        pool = self.system.mamba_pool
        assert pool is not None and state is not None
        local = self.system.mamba_layer_ids.index(layer)
        conv, ssm = pool.conv_state[local], pool.ssm_state[local]
        window = torch.cat([conv[state], (x @ w["in"]).unsqueeze(-1)], dim=-1)
        xc = (window * w["conv"]).sum(-1)
        conv[state] = window[:, 1:]
        s = w["a"] * ssm[state] + w["b"] * xc.reshape(-1, 1, 1)
        ssm[state] = s
        return (s * w["c"]).sum(-1).reshape(-1) @ w["out"]


def _norm(x: torch.Tensor) -> torch.Tensor:
    return x / (x.pow(2).mean() + 1e-5).sqrt()


@dataclass
class _Job:
    rid: int
    tokens: list[int]
    outputs: int = 0
    running: Running | None = None


@dataclass
class EngineRun:
    """What `ReferenceEngine.run` returns: per request, the logits of every output step (in
    order), and counters."""

    logits: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    outputs: dict[int, list[int]] = field(default_factory=dict)
    hit_tokens: int = 0
    retractions: int = 0
    steps: int = 0


class ReferenceEngine:
    """Chunked prefill + greedy decode of a batch of prompts through `BatchAllocator`.

    `cache_prefixes=False` is the cache-off baseline: requests end with `abort` (nothing is
    cached), so every token is computed. Under memory pressure (a prepare call returns None)
    the newest running request is retracted and re-admitted when others finished.
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
                raise RuntimeError("no request fits the memory system")
            out.steps += 1
            if not self._step(running, out):
                if len(running) == 1:
                    raise RuntimeError("one request alone does not fit the memory system")
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
