/* The prefix index's entries in C: page key -> holders (instance id, tier bits), the
   per-instance key lists, and the least-recently-matched order of a bounded index. native.py
   compiles this file and index_ext.c (the Python-facing type) as one source, an extension
   module of the running interpreter: Python.h comes first, as the C API requires.

   Layout:
     slots:  open addressing, linear probing, power-of-two size, load <= 1/2. A slot is 64 bits:
             low 32 = entry index + 1 (0 = empty), high 32 = the low 32 bits of the key's hash
             (its home is that value & mask). Deletion shifts the run back (no tombstones).
     E:      entries, 64 bytes each: the full key (up to 32 bytes: a slot's hash bits only pick
             the candidates, every match compares the whole key, so a hash collision can never
             give a wrong answer), LRU links, and the holders sorted by instance id (one inline,
             more on the heap).
     I:      per instance id, the entries it holds (its holder in each entry knows its position
             here: removal is a swap with the last, O(1)).
   Tier bits: bit t = tier rank t, best tier first, so the best tier held is the lowest bit.

   index_ext.c validates every input before calling (keys of key_len bytes, known tiers, ids
   the Python side interned): the functions here do not check them again. They return -1 only when memory runs
   out (a batch may then be applied in part: every structure stays consistent). Arrays grow
   when an insertion needs room, not by a batch's worst case (a batch of keys already held
   would otherwise double the entry array). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#define KEY_MAX 32
#define NIL UINT32_MAX

/* Every allocation of an index goes through these: tests make one fail (Core.fail_allocation) to
   check that running out of memory leaves every structure consistent. fail_after: how many
   more allocations succeed before one fails (once); -1, the default: none fails. */
static int64_t fail_after = -1;
static int failing(void) { return fail_after >= 0 && fail_after-- == 0; }
static void *ix_malloc(size_t n) { return failing() ? 0 : malloc(n); }
static void *ix_calloc(size_t n, size_t size) { return failing() ? 0 : calloc(n, size); }

/* The table's slots and entries: 64-byte aligned (an entry is one cache line, not two), and
   from 2 MB on in whole 2 MB huge pages where the kernel gives them (madvise): every probe is
   a random access, and on 4 KB pages each one also missed the TLB (a page walk per slot and
   per entry, the largest stall of a lookup in a profile). */
#define HUGE_PAGE ((size_t)2 << 20)
static size_t big_size(size_t n) { return n < HUGE_PAGE ? n : (n + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1); }
static void *big_alloc(size_t n) {
    if (failing()) return 0;
    size_t size = big_size(n);
    void *p = aligned_alloc(size < HUGE_PAGE ? 64 : HUGE_PAGE, (size + 63) & ~(size_t)63);
#ifdef MADV_HUGEPAGE
    if (p && size >= HUGE_PAGE) madvise(p, size, MADV_HUGEPAGE);
#endif
    return p;
}
static void *ix_realloc(void *p, size_t n) { return failing() ? 0 : realloc(p, n); }

typedef struct {
    uint32_t iid;
    uint32_t pos; /* index of this entry in I[iid].k */
    uint32_t tiers;
} holder_t;

typedef struct {
    uint8_t key[KEY_MAX];
    uint32_t prev, next; /* LRU (bounded index); `next` links the free list */
    uint32_t n, cap;     /* holders; cap 0: the one holder is inline */
    union {
        holder_t one;
        holder_t *many;
    } h;
} entry_t;

_Static_assert(sizeof(entry_t) == 64, "an entry is one cache line");

typedef struct {
    uint32_t *k;
    uint32_t n, cap;
} inst_t;

typedef struct {
    int64_t key_len, all_tiers, max_entries;
    uint64_t *slots;
    uint64_t mask;
    entry_t *E;
    uint32_t ecap, used, live, free_head;
    uint32_t lru_head, lru_tail;
    inst_t *I;
    uint32_t icap;
    int64_t evicted, pairs;
    int64_t heap; /* bytes of holder lists and instance lists */
    uint32_t *at, *tags; /* per key of a call: its entry, its hash bits */
    int64_t scratch_cap;
    uint32_t *alive;
    int64_t alive_cap;
    int32_t *res; /* ix_match's output buffers (index_ext.c owns and grows them) */
    int64_t res_cap;
    uint8_t *pages;
    int64_t page_cap;
    uint8_t *gathered; /* keys copied out of Python bytes objects (index_ext.c) */
    int64_t gathered_cap;
} ix_t;

/* Key compare and copy: fixed-size for the 32-byte PageKeyer keys (a few inlined loads, not a
   libc call per probe), any length else. */
static int key_eq(const ix_t *x, const uint8_t *a, const uint8_t *b) {
    if (x->key_len == 32) {
        uint64_t u[4], v[4];
        memcpy(u, a, 32);
        memcpy(v, b, 32);
        return !((u[0] ^ v[0]) | (u[1] ^ v[1]) | (u[2] ^ v[2]) | (u[3] ^ v[3]));
    }
    return memcmp(a, b, (size_t)x->key_len) == 0;
}

static void key_copy(const ix_t *x, uint8_t *to, const uint8_t *from) {
    if (x->key_len == 32) memcpy(to, from, 32);
    else memcpy(to, from, (size_t)x->key_len);
}

static uint64_t key_hash(const ix_t *x, const uint8_t *key) {
    uint64_t h = 0x9E3779B97F4A7C15ULL ^ (uint64_t)x->key_len;
    for (int64_t i = 0; i < x->key_len; i += 8) {
        uint64_t w = 0;
        int64_t take = x->key_len - i < 8 ? x->key_len - i : 8;
        memcpy(&w, key + i, (size_t)take);
        h = (h ^ w) * 0xBF58476D1CE4E5B9ULL;
        h ^= h >> 31;
    }
    h ^= h >> 29;
    h *= 0x94D049BB133111EBULL;
    h ^= h >> 32;
    return h;
}

static holder_t *holders(entry_t *e) { return e->cap ? e->h.many : &e->h.one; }

static int64_t lower(const holder_t *hs, uint32_t n, uint32_t iid) {
    uint32_t lo = 0, hi = n;
    while (lo < hi) {
        uint32_t mid = (lo + hi) >> 1;
        if (hs[mid].iid < iid) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* ---- table ---------------------------------------------------------------------------- */

static uint32_t find_slot(const ix_t *x, const uint8_t *key, uint32_t tag, uint64_t *where) {
    uint64_t i = tag & x->mask;
    for (;;) {
        uint64_t s = x->slots[i];
        if (!s) {
            *where = i;
            return NIL;
        }
        if ((uint32_t)(s >> 32) == tag) {
            uint32_t idx = (uint32_t)s - 1;
            if (key_eq(x, x->E[idx].key, key)) {
                *where = i;
                return idx;
            }
        }
        i = (i + 1) & x->mask;
    }
}

static int grow_table(ix_t *x, uint64_t need) {
    uint64_t size = x->mask + 1;
    if (need * 2 <= size) return 0;
    while (need * 2 > size) size <<= 1;
    uint64_t *slots = (uint64_t *)big_alloc(size * sizeof(uint64_t));
    if (!slots) return -1;
    memset(slots, 0, size * sizeof(uint64_t));
    for (uint64_t i = 0; i <= x->mask; i++) {
        uint64_t s = x->slots[i];
        if (!s) continue;
        uint64_t j = (s >> 32) & (size - 1);
        while (slots[j]) j = (j + 1) & (size - 1);
        slots[j] = s;
    }
    free(x->slots);
    x->slots = slots;
    x->mask = size - 1;
    return 0;
}

static void delete_slot(ix_t *x, uint64_t i) {
    uint64_t j = i;
    for (;;) {
        j = (j + 1) & x->mask;
        uint64_t s = x->slots[j];
        if (!s) break;
        uint64_t home = (s >> 32) & x->mask;
        /* s may move to the hole at i unless its home lies cyclically in (i, j] */
        if ((j > i && (home <= i || home > j)) || (j < i && home <= i && home > j)) {
            x->slots[i] = s;
            i = j;
        }
    }
    x->slots[i] = 0;
}

/* ---- entries, LRU, instances -------------------------------------------------------- */

static int reserve_entries(ix_t *x, uint64_t more) {
    uint64_t free_count = (uint64_t)x->used - x->live;
    if (more <= free_count || x->used + (more - free_count) <= x->ecap) return 0;
    uint64_t cap = x->ecap ? x->ecap : 1024;
    uint64_t need = (uint64_t)x->used + more - free_count;
    while (cap < need) cap += cap >> 1;
    if (cap >= NIL) return -1;
    entry_t *e = (entry_t *)big_alloc(cap * sizeof(entry_t));
    if (!e) return -1;
    if (x->used) memcpy(e, x->E, (size_t)x->used * sizeof(entry_t));
    free(x->E);
    x->E = e;
    x->ecap = (uint32_t)cap;
    return 0;
}

static int reserve_inst(ix_t *x, uint32_t iid, uint64_t more) {
    if (iid >= x->icap) {
        uint32_t cap = x->icap ? x->icap : 8;
        while (cap <= iid) cap *= 2;
        inst_t *I = (inst_t *)ix_realloc(x->I, cap * sizeof(inst_t));
        if (!I) return -1;
        memset(I + x->icap, 0, (cap - x->icap) * sizeof(inst_t));
        x->I = I;
        x->icap = cap;
    }
    inst_t *in = &x->I[iid];
    if (in->n + more <= in->cap) return 0;
    uint64_t cap = in->cap ? in->cap : 16;
    while (cap < in->n + more) cap *= 2;
    if (cap >= NIL) return -1;
    uint32_t *k = (uint32_t *)ix_realloc(in->k, cap * sizeof(uint32_t));
    if (!k) return -1;
    in->k = k;
    x->heap += ((int64_t)cap - in->cap) * 4;
    in->cap = (uint32_t)cap;
    return 0;
}

static void lru_unlink(ix_t *x, uint32_t idx) {
    entry_t *e = &x->E[idx];
    if (e->prev != NIL) x->E[e->prev].next = e->next;
    else x->lru_head = e->next;
    if (e->next != NIL) x->E[e->next].prev = e->prev;
    else x->lru_tail = e->prev;
}

static void lru_append(ix_t *x, uint32_t idx) {
    entry_t *e = &x->E[idx];
    e->prev = x->lru_tail;
    e->next = NIL;
    if (x->lru_tail != NIL) x->E[x->lru_tail].next = idx;
    else x->lru_head = idx;
    x->lru_tail = idx;
}

/* Take `iid`'s position `pos` out of its list (the last one moves into it). */
static void inst_unlist(ix_t *x, uint32_t iid, uint32_t pos) {
    inst_t *in = &x->I[iid];
    uint32_t last = in->k[--in->n];
    if (pos == in->n) return;
    in->k[pos] = last;
    entry_t *m = &x->E[last];
    holder_t *hs = holders(m);
    hs[lower(hs, m->n, iid)].pos = pos;
}

static void delete_entry(ix_t *x, uint32_t idx, uint64_t slot) {
    entry_t *e = &x->E[idx];
    if (e->cap) {
        free(e->h.many);
        x->heap -= e->cap * (int64_t)sizeof(holder_t);
    }
    e->cap = 0;
    e->n = 0;
    delete_slot(x, slot);
    if (x->max_entries) lru_unlink(x, idx);
    e->next = x->free_head;
    x->free_head = idx;
    x->live--;
}

static uint64_t slot_of(ix_t *x, uint32_t idx) {
    uint64_t where = 0;
    const uint8_t *key = x->E[idx].key;
    find_slot(x, key, (uint32_t)key_hash(x, key), &where);
    return where;
}

static void evict_front(ix_t *x) {
    uint32_t idx = x->lru_head;
    entry_t *e = &x->E[idx];
    holder_t *hs = holders(e);
    for (uint32_t i = 0; i < e->n; i++) inst_unlist(x, hs[i].iid, hs[i].pos);
    x->pairs -= e->n;
    delete_entry(x, idx, slot_of(x, idx));
    x->evicted++;
}

/* Remove holder `at` of entry `idx` (its slot `slot`); the entry goes when it was the last. */
static void drop_holder(ix_t *x, uint32_t idx, uint64_t slot, int64_t at) {
    entry_t *e = &x->E[idx];
    holder_t *hs = holders(e);
    inst_unlist(x, hs[at].iid, hs[at].pos);
    x->pairs--;
    if (e->n == 1) {
        delete_entry(x, idx, slot);
        return;
    }
    memmove(hs + at, hs + at + 1, (e->n - at - 1) * sizeof(holder_t));
    e->n--;
    if (e->n == 1) {
        holder_t keep = hs[0];
        free(e->h.many);
        x->heap -= e->cap * (int64_t)sizeof(holder_t);
        e->cap = 0;
        e->h.one = keep;
    }
}

static int scratch_for(ix_t *x, int64_t n, int64_t m) {
    if (n > x->scratch_cap) {
        uint32_t *at = (uint32_t *)ix_realloc(x->at, (size_t)n * sizeof(uint32_t));
        if (!at) return -1;
        x->at = at;
        uint32_t *tags = (uint32_t *)ix_realloc(x->tags, (size_t)n * sizeof(uint32_t));
        if (!tags) return -1;
        x->tags = tags;
        x->scratch_cap = n;
    }
    if (m > x->alive_cap) {
        uint32_t *a = (uint32_t *)ix_realloc(x->alive, (size_t)m * 2 * sizeof(uint32_t));
        if (!a) return -1;
        x->alive = a;
        x->alive_cap = m;
    }
    return 0;
}

/* Hash every key and start loading its home slot, then the entry that slot names: a batch's
   probes overlap their cache misses instead of waiting on each in turn (on an index larger
   than the caches each probe is two or three misses). NULL when out of memory (no prefetch). */
static const uint32_t *hash_all(ix_t *x, const uint8_t *keys, int64_t n) {
    if (scratch_for(x, n, 0)) return 0;
    uint32_t *tags = x->tags;
    for (int64_t i = 0; i < n; i++) {
        tags[i] = (uint32_t)key_hash(x, keys + i * x->key_len);
        __builtin_prefetch(&x->slots[tags[i] & x->mask]);
    }
    for (int64_t i = 0; i < n; i++) {
        uint64_t s = x->slots[tags[i] & x->mask];
        if (s) {
            const char *e = (const char *)&x->E[(uint32_t)s - 1];
            __builtin_prefetch(e);
        }
    }
    return tags;
}

/* ---- operations ------------------------------------------------------------------------ */

static int store(ix_t *x, uint32_t iid, uint32_t bits, const uint8_t *keys, int64_t n) {
    const uint32_t *tags = hash_all(x, keys, n);
    for (int64_t k = 0; k < n; k++) {
        const uint8_t *key = keys + k * x->key_len;
        uint32_t tag = tags ? tags[k] : (uint32_t)key_hash(x, key);
        uint64_t where;
        if (grow_table(x, (uint64_t)x->live + 1)) return -1;
        uint32_t idx = find_slot(x, key, tag, &where);
        entry_t *e;
        if (idx == NIL) {
            /* Every allocation a new entry needs comes first (its slot in `iid`'s key list
               here, an entry by reserve_entries: none once one is evicted): when one fails
               the table is as it was, no entry without holders, nothing evicted. */
            if (reserve_inst(x, iid, 1)) return -1;
            if (x->max_entries && x->live >= (uint64_t)x->max_entries) {
                evict_front(x);
                find_slot(x, key, tag, &where); /* the shift may have moved the empty slot */
            }
            if (x->free_head == NIL && reserve_entries(x, 1)) return -1;
            if (x->free_head != NIL) {
                idx = x->free_head;
                x->free_head = x->E[idx].next;
            } else {
                idx = x->used++;
            }
            e = &x->E[idx];
            key_copy(x, e->key, key);
            e->n = 0;
            e->cap = 0;
            x->slots[where] = ((uint64_t)tag << 32) | (idx + 1);
            x->live++;
            if (x->max_entries) lru_append(x, idx);
        } else {
            e = &x->E[idx];
        }
        holder_t *hs = holders(e);
        int64_t at = lower(hs, e->n, iid);
        if (at < e->n && hs[at].iid == iid) {
            hs[at].tiers |= bits;
            continue;
        }
        if (e->n == 1 && !e->cap) {
            holder_t *many = (holder_t *)ix_malloc(4 * sizeof(holder_t));
            if (!many) return -1;
            many[0] = e->h.one;
            e->h.many = many;
            e->cap = 4;
            x->heap += 4 * (int64_t)sizeof(holder_t);
        } else if (e->cap && e->n == e->cap) {
            holder_t *many = (holder_t *)ix_realloc(e->h.many, 2 * e->cap * sizeof(holder_t));
            if (!many) return -1;
            e->h.many = many;
            x->heap += e->cap * (int64_t)sizeof(holder_t);
            e->cap *= 2;
        }
        if (reserve_inst(x, iid, 1)) return -1;
        hs = holders(e);
        memmove(hs + at + 1, hs + at, (e->n - at) * sizeof(holder_t));
        inst_t *in = &x->I[iid];
        hs[at].iid = iid;
        hs[at].tiers = bits;
        hs[at].pos = in->n;
        in->k[in->n++] = idx;
        e->n++;
        x->pairs++;
    }
    return 0;
}

static void remove_keys(ix_t *x, uint32_t iid, uint32_t bits, const uint8_t *keys, int64_t n) {
    const uint32_t *tags = hash_all(x, keys, n);
    for (int64_t k = 0; k < n; k++) {
        const uint8_t *key = keys + k * x->key_len;
        uint64_t where;
        uint32_t tag = tags ? tags[k] : (uint32_t)key_hash(x, key);
        uint32_t idx = find_slot(x, key, tag, &where);
        if (idx == NIL) continue;
        entry_t *e = &x->E[idx];
        holder_t *hs = holders(e);
        int64_t at = lower(hs, e->n, iid);
        if (at == e->n || hs[at].iid != iid) continue;
        hs[at].tiers &= ~bits;
        if (!hs[at].tiers) drop_holder(x, idx, where, at);
    }
}

/* Clear `bits` of `iid` on every key it holds; returns how many keys it held. */
static int64_t clear(ix_t *x, uint32_t iid, uint32_t bits) {
    if (iid >= x->icap) return 0;
    int64_t held = x->I[iid].n;
    /* Backwards: a removal moves the last position (already seen) into the current one. */
    for (int64_t p = held - 1; p >= 0; p--) {
        uint32_t idx = x->I[iid].k[p];
        entry_t *e = &x->E[idx];
        holder_t *hs = holders(e);
        int64_t at = lower(hs, e->n, iid);
        hs[at].tiers &= ~bits;
        if (!hs[at].tiers) drop_holder(x, idx, slot_of(x, idx), at);
    }
    return held;
}

static ix_t *ix_new(int64_t key_len, int64_t num_tiers, int64_t max_entries) {
    if (key_len < 1 || key_len > KEY_MAX || num_tiers < 1 || num_tiers > 31) return 0;
    ix_t *x = (ix_t *)ix_calloc(1, sizeof(ix_t));
    if (!x) return 0;
    x->key_len = key_len;
    x->all_tiers = ((int64_t)1 << num_tiers) - 1;
    x->max_entries = max_entries > 0 ? max_entries : 0;
    x->slots = (uint64_t *)ix_calloc(1024, sizeof(uint64_t));
    if (!x->slots) {
        free(x);
        return 0;
    }
    x->mask = 1023;
    x->free_head = x->lru_head = x->lru_tail = NIL;
    return x;
}

static void ix_free(ix_t *x) {
    if (!x) return;
    for (uint32_t i = 0; i < x->used; i++)
        if (x->E[i].n && x->E[i].cap) free(x->E[i].h.many);
    for (uint32_t i = 0; i < x->icap; i++) free(x->I[i].k);
    free(x->I);
    free(x->E);
    free(x->slots);
    free(x->at);
    free(x->tags);
    free(x->gathered);
    free(x->alive);
    free(x->res);
    free(x->pages);
    free(x);
}

/* A batch of `iid`'s events: `spec` holds (kind, tier bits, key count) per event, kind 0 store,
   1 remove, 2 clear (no keys); `keys` their keys back to back. 0, or -1 (out of memory: the
   batch may be applied in part). */
static int64_t ix_apply(ix_t *x, int64_t iid, const int64_t *spec, int64_t num_events,
                        const uint8_t *keys) {
    for (int64_t i = 0; i < num_events; i++) {
        int64_t kind = spec[3 * i], n = spec[3 * i + 2];
        uint32_t bits = (uint32_t)spec[3 * i + 1];
        if (kind == 0) {
            if (store(x, (uint32_t)iid, bits, keys, n)) return -1;
        } else if (kind == 1) {
            remove_keys(x, (uint32_t)iid, bits, keys, n);
        } else {
            clear(x, (uint32_t)iid, bits);
        }
        if (kind != 2) keys += n * x->key_len;
    }
    return 0;
}


static uint32_t best(uint32_t tiers) { return (uint32_t)__builtin_ctz(tiers); }

/* Per instance holding the first of the `n` keys: its run of held keys from the first and the
   best tier of each. Writes res[3j..3j+2] = (id, run, tier) for the j-th such instance, in the
   order (run, id); tier is the best tier of every page of the run when it is the same for all,
   else -1 - offset, the run's tiers being pages[offset ..] (only with `tiers`; capacity
   `page_cap`). Bounded: the keys matched move to most recently matched, deepest first.
   Returns the number of instances, -1 out of memory, -2 res too short, or -3 - the pages
   needed past `page_cap` (nothing changed then). */
static int64_t ix_match(ix_t *x, const uint8_t *keys, int64_t n, int64_t tiers) {
    int32_t *res = x->res;
    uint8_t *pages = x->pages;
    int64_t page_cap = x->page_cap;
    if (n < 1) return 0;
    uint64_t where;
    const uint32_t *tags = hash_all(x, keys, n);
    if (!tags) return -1;
    uint32_t e0 = find_slot(x, keys, tags[0], &where);
    if (e0 == NIL) return 0;
    entry_t *first = &x->E[e0];
    uint32_t m = first->n;
    if (3 * (int64_t)m > x->res_cap) return -2; /* the caller sizes res for every id */
    if (scratch_for(x, n, m)) return -1;
    uint32_t *at = x->at, *alive = x->alive, *t0 = x->alive + m;
    holder_t *hs = holders(first);
    for (uint32_t j = 0; j < m; j++) {
        alive[j] = hs[j].iid;
        t0[j] = best(hs[j].tiers);
    }
    at[0] = e0;
    uint32_t count = m, out = 0;
    int64_t depth = 1;
    /* res is filled in order of run end; uniformity is settled per instance as it ends */
    for (; depth < n && count; depth++) {
        uint32_t idx = find_slot(x, keys + depth * x->key_len, tags[depth], &where);
        if (idx == NIL) break;
        at[depth] = idx;
        entry_t *e = &x->E[idx];
        holder_t *h = holders(e);
        uint32_t p = 0, keep = 0;
        for (uint32_t j = 0; j < count; j++) {
            uint32_t iid = alive[j];
            while (p < e->n && h[p].iid < iid) p++;
            if (p < e->n && h[p].iid == iid) {
                uint32_t t = best(h[p].tiers);
                if (t != (t0[j] & 0xFFFF)) t0[j] |= 0x10000; /* not uniform */
                alive[keep] = iid;
                t0[keep++] = t0[j];
            } else {
                res[3 * out] = (int32_t)iid;
                res[3 * out + 1] = (int32_t)depth;
                res[3 * out + 2] = (int32_t)t0[j];
                out++;
            }
        }
        count = keep;
        if (!count) break;
    }
    for (uint32_t j = 0; j < count; j++) {
        res[3 * out] = (int32_t)alive[j];
        res[3 * out + 1] = (int32_t)depth;
        res[3 * out + 2] = (int32_t)t0[j];
        out++;
    }
    /* depth: the longest run (the keys a bounded index touches) */
    int64_t need = 0;
    for (uint32_t j = 0; j < out; j++)
        if (res[3 * j + 2] & 0x10000) need += res[3 * j + 1];
    if (tiers && need > page_cap) return -3 - need;
    int64_t offset = 0;
    for (uint32_t j = 0; j < out; j++) {
        if (!(res[3 * j + 2] & 0x10000)) continue;
        if (!tiers) {
            res[3 * j + 2] = -1;
            continue;
        }
        uint32_t iid = (uint32_t)res[3 * j];
        int64_t run = res[3 * j + 1];
        for (int64_t d = 0; d < run; d++) {
            entry_t *e = &x->E[at[d]];
            holder_t *h = holders(e);
            pages[offset + d] = (uint8_t)best(h[lower(h, e->n, iid)].tiers);
        }
        res[3 * j + 2] = (int32_t)(-1 - offset);
        offset += run;
    }
    if (x->max_entries)
        for (int64_t d = depth - 1; d >= 0; d--) {
            lru_unlink(x, at[d]);
            lru_append(x, at[d]);
        }
    return out;
}

static int64_t ix_held(const ix_t *x, int64_t iid) {
    return (uint64_t)iid < x->icap ? x->I[iid].n : 0;
}

static void ix_stats(const ix_t *x, int64_t *out) {
    int64_t bytes = (int64_t)sizeof(ix_t) + (int64_t)big_size((x->mask + 1) * 8) +
                    (int64_t)big_size(x->ecap * sizeof(entry_t)) +
                    (int64_t)x->icap * (int64_t)sizeof(inst_t) +
                    (2 * x->scratch_cap + 2 * x->alive_cap + x->res_cap) * 4 + x->page_cap +
                    x->gathered_cap * x->key_len + x->heap;
    out[0] = x->live;
    out[1] = x->pairs;
    out[2] = x->evicted;
    out[3] = bytes;
}

/* 0 when every invariant holds, else the number of the first that does not (Core.check):
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

/* continued in index_convert.c, then index_ext.c (native.py compiles the three as one source) */
