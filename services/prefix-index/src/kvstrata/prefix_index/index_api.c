/* The second half of the index core (after index_core.c: native.py compiles the two files as
   one source): the integrity check, keys read in place from Python objects, and the exported
   functions. */

/* 0 when every invariant holds, else the number of the first that does not (see kvx_check):
   1 a slot names a bad or free entry, 2 a slot's hash bits or place are wrong, 3 slot count
   != live entries, 4 holders unsorted / empty tiers / unknown tier bits, 5 a holder's position
   disagrees with its instance list, 6 pairs disagree, 7 LRU order broken or incomplete,
   8 entry bound exceeded, 9 free list broken. */
static int64_t ix_check(ix_t *x) {
    uint64_t filled = 0;
    for (uint64_t i = 0; i <= x->mask; i++) {
        uint64_t s = x->slots[i];
        if (!s) continue;
        filled++;
        uint32_t idx = (uint32_t)s - 1;
        if (idx >= x->used || !x->E[idx].n) return 1;
        uint64_t where;
        uint32_t tag = (uint32_t)key_hash(x, x->E[idx].key);
        if ((uint32_t)(s >> 32) != tag || find_slot(x, x->E[idx].key, tag, &where) != idx ||
            where != i)
            return 2;
    }
    if (filled != x->live) return 3;
    int64_t pairs = 0;
    for (uint32_t idx = 0; idx < x->used; idx++) {
        entry_t *e = &x->E[idx];
        if (!e->n) continue;
        holder_t *h = holders(e);
        for (uint32_t j = 0; j < e->n; j++) {
            if (!h[j].tiers || (h[j].tiers & ~(uint32_t)x->all_tiers) ||
                (j && h[j - 1].iid >= h[j].iid) || h[j].iid >= x->icap)
                return 4;
            inst_t *in = &x->I[h[j].iid];
            if (h[j].pos >= in->n || in->k[h[j].pos] != idx) return 5;
        }
        pairs += e->n;
    }
    int64_t listed = 0;
    for (uint32_t i = 0; i < x->icap; i++) listed += x->I[i].n;
    if (pairs != x->pairs || listed != pairs) return 6;
    if (x->max_entries) {
        uint64_t seen = 0;
        uint32_t prev = NIL;
        for (uint32_t i = x->lru_head; i != NIL; i = x->E[i].next) {
            if (x->E[i].prev != prev || !x->E[i].n || ++seen > x->live) return 7;
            prev = i;
        }
        if (seen != x->live || prev != x->lru_tail) return 7;
        if (x->live > (uint64_t)x->max_entries) return 8;
    }
    uint64_t free_count = 0;
    for (uint32_t i = x->free_head; i != NIL; i = x->E[i].next)
        if (i >= x->used || x->E[i].n || ++free_count > x->used) return 9;
    if (free_count + x->live != x->used) return 9;
    return 0;
}

/* ---- keys read from the Python objects themselves ----------------------------------------
   A tuple or list of bytes objects is read in place (no join, no per-key len() in Python):
   the object layout (type pointer at 8, size at 16, a tuple's items / a list's item array at
   24, a bytes object's data at 32) is the one of CPython 3.11-3.13 default builds, and the
   Python side checks it on probe objects before it ever uses these calls (kvx_layout); on
   any other layout it joins the keys itself. Each item must be exactly a bytes object of the
   key length (type pointer compared with bytes'), else the call refuses the whole sequence
   and Python joins it. Calls hold the GIL (PyDLL): the objects cannot change meanwhile. */

static const void *type_bytes, *type_tuple, *type_list;

void kvx_layout(const void *bytes_type, const void *tuple_type, const void *list_type) {
    type_bytes = bytes_type;
    type_tuple = tuple_type;
    type_list = list_type;
}

static const void *ob_type(const void *o) { return *(const void *const *)((const char *)o + 8); }
static int64_t ob_size(const void *o) { return *(const int64_t *)((const char *)o + 16); }

/* Copy the keys of sequence `seq` into x->gathered; returns how many, or -1 when an item is
   not exactly a bytes object of key_len bytes (a subclass of bytes included: the caller then
   joins the keys in Python, where isinstance decides), `seq` is neither a tuple nor a list,
   or memory runs out. */
static int64_t gather(ix_t *x, const void *seq) {
    const void *const *items;
    if (!type_bytes) return -1;
    if (ob_type(seq) == type_tuple) items = (const void *const *)((const char *)seq + 24);
    else if (ob_type(seq) == type_list) items = *(const void *const *const *)((const char *)seq + 24);
    else return -1;
    int64_t n = ob_size(seq);
    if (n > x->gathered_cap) {
        uint8_t *g = (uint8_t *)ix_realloc(x->gathered, (size_t)(n * x->key_len));
        if (!g) return -1;
        x->gathered = g;
        x->gathered_cap = n;
    }
    for (int64_t i = 0; i < n; i++) {
        const void *o = items[i];
        if (ob_type(o) != type_bytes || ob_size(o) != x->key_len) return -1;
        memcpy(x->gathered + i * x->key_len, (const char *)o + 32, (size_t)x->key_len);
    }
    return n;
}

/* ---- exported: indexes named by small ints ----------------------------------------------
   The hot calls (kvx_apply1, kvx_match) are made through ctypes without argument types, which
   costs a third of a typed call: every argument is then a C int or a bytes buffer, so an index
   is named by its number in this registry, not by a pointer, and kvx_match writes into buffers
   registered once (kvx_buffers). The library is loaded with ctypes.PyDLL: calls hold the GIL,
   so the registry and each index are used by one thread at a time. */

static ix_t **reg;
static int reg_cap;

/* A new index: its number (>= 0), or -1 (bad parameters, out of memory). */
int kvx_new(int64_t key_len, int64_t num_tiers, int64_t max_entries) {
    int id = 0;
    while (id < reg_cap && reg[id]) id++;
    if (id == reg_cap) {
        int cap = reg_cap ? 2 * reg_cap : 64;
        ix_t **r = (ix_t **)realloc(reg, (size_t)cap * sizeof(ix_t *));
        if (!r) return -1;
        memset(r + reg_cap, 0, (size_t)(cap - reg_cap) * sizeof(ix_t *));
        reg = r;
        reg_cap = cap;
    }
    reg[id] = ix_new(key_len, num_tiers, max_entries);
    return reg[id] ? id : -1;
}

void kvx_free(int id) {
    ix_free(reg[id]);
    reg[id] = 0;
}

/* kvx_match's output: res (int32, res_cap), pages (uint8, page_cap); `args`: where the *_seq
   calls find the address of their sequence of keys. All owned by the caller. */
void kvx_buffers(int id, int32_t *res, int64_t res_cap, uint8_t *pages, int64_t page_cap,
                 int64_t *args) {
    reg[id]->args = args;
    reg[id]->res = res;
    reg[id]->res_cap = res_cap;
    reg[id]->pages = pages;
    reg[id]->page_cap = page_cap;
}

/* A batch of `iid`'s events: `spec` holds (kind, tier bits, key count) per event as int64,
   kind 0 store, 1 remove, 2 clear (no keys); `keys` their keys back to back. 0, or -1 (out of
   memory: the batch may be applied in part). */
int kvx_apply(int id, int iid, const int64_t *spec, int num_events, const uint8_t *keys) {
    return (int)ix_apply(reg[id], iid, spec, num_events, keys);
}

/* One event (the common batch): as kvx_apply without the spec array. */
int kvx_apply1(int id, int iid, int kind, int bits, const uint8_t *keys, int n) {
    int64_t spec[3] = {kind, bits, n};
    return (int)ix_apply(reg[id], iid, spec, 1, keys);
}

/* kvx_apply1 of the keys of the tuple / list whose address is args[0]: 0, -1 out of memory,
   -4 when gather refuses the keys: nothing changed then. */
int kvx_apply_seq(int id, int iid, int kind, int bits) {
    ix_t *x = reg[id];
    int64_t n = gather(x, (const void *)(intptr_t)x->args[0]);
    if (n < 0) return -4;
    int64_t spec[3] = {kind, bits, n};
    return (int)ix_apply(x, iid, spec, 1, x->gathered);
}

/* kvx_match of the keys of the tuple / list at args[0]; -4 when gather refuses them (the
   caller then matches the keys joined in Python, up to the first that is no bytes of key_len:
   no entry can have it, the runs stop there). */
int kvx_match_seq(int id, int tiers) {
    ix_t *x = reg[id];
    int64_t n = gather(x, (const void *)(intptr_t)x->args[0]);
    if (n < 0) return -4;
    return (int)ix_match(x, x->gathered, n, tiers);
}

/* Every key of `iid` goes; returns how many it held. */
int64_t kvx_drop(int id, int iid) {
    return clear(reg[id], (uint32_t)iid, (uint32_t)reg[id]->all_tiers);
}

/* See ix_match: per instance holding the first of the `n` keys, its run and tiers. */
int kvx_match(int id, const uint8_t *keys, int n, int tiers) {
    return (int)ix_match(reg[id], keys, n, tiers);
}

/* How many keys `iid` holds. */
int64_t kvx_held(int id, int64_t iid) { return ix_held(reg[id], iid); }

/* `iid`'s keys (key_len bytes each) and their tier bits; room for kvx_held(iid) of each. */
int64_t kvx_holdings(int id, int64_t iid, uint8_t *keys, int32_t *bits) {
    return ix_holdings(reg[id], iid, keys, bits);
}

/* The 64-bit hash of each of `n` keys (tests: keys whose slot bits collide). */
void kvx_hashes(int id, const uint8_t *keys, int64_t n, uint64_t *out) {
    ix_hashes(reg[id], keys, n, out);
}

/* out[0..3] = entries, (key, instance) pairs, entries evicted, bytes allocated. */
void kvx_stats(int id, int64_t *out) { ix_stats(reg[id], out); }

/* Tests only: the allocation after `after` more that succeed fails, once (-1: none fails).
   Returns the setting it replaces: -1 once the failure has happened. */
int64_t kvx_fail_alloc(int64_t after) {
    int64_t was = fail_after;
    fail_after = after;
    return was;
}

/* 0 when every invariant holds, else the number of the first that does not. */
int64_t kvx_check(int id) { return ix_check(reg[id]); }

#ifdef __cplusplus
}
#endif
