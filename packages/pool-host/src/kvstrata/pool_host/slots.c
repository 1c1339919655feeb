/* The host slot allocator's alloc and free of whole pages in C (power-of-two or any page
   size), loaded by slots.py through `kvstrata.pool.native.native_library`.

   Both work on the arrays of the allocator's `kvstrata.core.free_ids.FreeIds` (ids offset by
   its `first`): `is_free` (one byte per id, 1 = free) and the front of its sorted `fresh`
   list. Each checks everything before it writes anything; on any input it does not take it
   returns HS_FALLBACK having changed nothing, and the caller runs the NumPy path, which raises
   the specific error (SizeNotPageAligned, IndexOutOfRange, DoubleFree, IntegrityError).

   Why C: an alloc or a free of a few pages costs 20-30 us in NumPy calls (about 20 of them
   for the page arithmetic and the FreeIds checks), one C call about 2 us. */

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define HS_FALLBACK (-1)

/* Give back the pages of token indices tokens[0..n): n / page groups, each one whole page in
   order (p*page .. p*page + page - 1) with p - first in [0, num_ids), allocated, no page twice.
   Writes the page ids to out[0 .. n/page), marks them free. Returns n / page. */
int64_t hs_give_tokens(const int64_t *tokens, int64_t n, int64_t page, int64_t first,
                       uint8_t *is_free, int64_t num_ids, int64_t *out) {
    if (page < 1 || n < 0 || n % page) {
        return HS_FALLBACK;
    }
    int64_t k = n / page;
    for (int64_t i = 0; i < k; i++) {
        const int64_t *run = tokens + i * page;
        int64_t t0 = run[0];
        if (t0 < 0 || t0 % page) {
            return HS_FALLBACK;
        }
        int64_t id = t0 / page - first;
        if (id < 0 || id >= num_ids || is_free[id]) {
            return HS_FALLBACK;
        }
        for (int64_t j = 1; j < page; j++) {
            if (run[j] != t0 + j) {
                return HS_FALLBACK;
            }
        }
        out[i] = id + first;
    }
    /* A page listed twice finds its own mark: undo the marks made so far. */
    for (int64_t i = 0; i < k; i++) {
        int64_t id = out[i] - first;
        if (is_free[id]) {
            for (int64_t j = 0; j < i; j++) {
                is_free[out[j] - first] = 0;
            }
            return HS_FALLBACK;
        }
        is_free[id] = 1;
    }
    return k;
}

/* Take the k ids fresh[0..k) (the front of the sorted free list): each must be in range and
   marked free; marks them taken and writes their token indices (id*page .. id*page + page - 1,
   in order) to out[0 .. k*page). Returns k. */
int64_t hs_take_tokens(const int64_t *fresh, int64_t k, int64_t page, int64_t first,
                       uint8_t *is_free, int64_t num_ids, int64_t *out) {
    if (page < 1 || k < 0) {
        return HS_FALLBACK;
    }
    for (int64_t i = 0; i < k; i++) {
        int64_t id = fresh[i] - first;
        if (id < 0 || id >= num_ids || !is_free[id]) {
            return HS_FALLBACK;
        }
    }
    for (int64_t i = 0; i < k; i++) {
        int64_t p = fresh[i];
        is_free[p - first] = 0;
        int64_t *dst = out + i * page;
        for (int64_t j = 0; j < page; j++) {
            dst[j] = p * page + j;
        }
    }
    return k;
}

#ifdef __cplusplus
}
#endif
