"""Run by test_sglang.py inside the SGLang peer venv (not collected by pytest: no test_ prefix).

SGLang's own backend factory loads KvstrataHiCacheStorage from the dynamic extra config; pages
of a real MHATokenToKVPoolHost written with batch_set_v1 come back byte-identical through
batch_get_v1 into other host slots. Prints one JSON line of what it saw."""

from __future__ import annotations

import json
import sys

sys.path.insert(0, sys.argv[2])  # the peer benchmark folder, for peer_env
import peer_env  # noqa: F401  (must precede sglang)
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

PAGE, N = 4, 5
kv = MHATokenToKVPool(
    size=128,
    page_size=PAGE,
    dtype=torch.float16,
    head_num=2,
    head_dim=8,
    layer_num=3,
    device="cpu",
    enable_memory_saver=False,
    start_layer=0,
    end_layer=3,
)
host = MHATokenToKVPoolHost(
    kv.get_device_pool_infos()[0].buffer_info,
    2,
    0,
    PAGE,
    "page_first",
    pin_memory=False,
    device_capacity_tokens=kv.size,
    start_layer=kv.start_layer,
    end_layer=kv.end_layer,
    write_back_staging=kv.hicache_write_back_staging,
)


def roundtrip(url: str) -> dict[str, object]:
    config = HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=True,
        is_page_first_layout=True,
        model_name="org/model",
        extra_config={
            "backend_name": "kvstrata",
            "module_path": "kvstrata.l3_store.sglang",
            "class_name": "KvstrataHiCacheStorage",
            "url": url,
        },
    )
    backend = StorageBackendFactory.create_backend("dynamic", config, host)
    backend.register_mem_pool_host(host)
    gen = torch.Generator().manual_seed(0)
    host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape, generator=gen).to(host.kv_buffer.dtype))
    src = torch.arange(PAGE, PAGE * (N + 1))
    dst = torch.arange(PAGE * (N + 2), PAGE * (2 * N + 2))
    keys = [f"{i:064x}" for i in range(N)]
    out = {"class": type(backend).__name__, "exists_before": backend.batch_exists(keys)}
    out["set"] = backend.batch_set_v1(keys, src)
    want = [host.get_data_page(int(src[i * PAGE]), flat=True).clone() for i in range(N)]
    out["exists_after"] = backend.batch_exists(keys)
    out["exists_gap"] = backend.batch_exists([*keys[:2], "f" * 64, *keys[2:]])
    out["get"] = backend.batch_get_v1(keys, dst)
    got = [host.get_data_page(int(dst[i * PAGE]), flat=True) for i in range(N)]
    out["identical"] = [
        bool(torch.equal(g.view(torch.uint8), w.view(torch.uint8)))
        for g, w in zip(got, want, strict=True)
    ]
    out["distinct"] = not torch.equal(want[0], want[1])
    out["missing_get"] = backend.batch_get_v1(["e" * 64], dst[:PAGE])
    one = torch.zeros_like(want[0])
    out["set_one"] = backend.set("a" * 64, want[3])
    out["get_one"] = backend.get("a" * 64, one) is not None and bool(torch.equal(one, want[3]))
    out["exists_one"] = backend.exists("a" * 64)
    stats = backend.get_stats()
    out["stats"] = {"prefetch_pgs": stats.prefetch_pgs, "backup_pgs": stats.backup_pgs}
    backend.clear()
    out["exists_cleared"] = backend.batch_exists(keys)
    return out


for url in sys.argv[1].split(" "):
    print(json.dumps(roundtrip(url)))
