"""The shared L3 tier: one page store per Ray node, and the engine-side `RayStorage`.

Modules (import what you use; this package imports nothing, so `kvstrata.l3_store.sglang`
loads without Ray):

- `core`: `StoreCore`, the store without Ray (arena extents, memory-first LRU with
  watermarks spilling to a `FileStorage`, leases, reserve/commit writes, checksums);
- `arena`: the shared-memory arena file and its extent allocator;
- `actor`: `StoreActor`, the Ray actor around a `StoreCore`, with its metrics endpoint;
- `deploy`: `up` / `reconcile` / `status` / `down`, one store per alive node;
- `client`: `RayStorage`, opened as `ray://?namespace=...&timeout_ms=...`;
- `routing`: rendezvous hashing of page keys over the stores;
- `sglang`: `KvstrataHiCacheStorage`, SGLang's HiCache backend over any kvstrata storage URL.
"""
