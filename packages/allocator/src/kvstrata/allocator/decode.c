/* The numpy engine's decode round in C (power-of-two pages), loaded by native.py.

   Same arrays as NumpyPageEngine: `stack` (free pages from `head` to `capacity`), `marks`
   (num_pages + 1 int32: FREE -1, RESERVED -2 at page 0, BEYOND -3 at num_pages, >= 0 handed
   out; NULL for an unchecked engine, whose marks are only stamps for the free). Each function
   checks everything before it writes anything; on any input it does not take (a bad seq_len or
   last_loc, a repeated page, a stack too short) it returns KV_FALLBACK having changed nothing,
   and the caller runs the NumPy path, which raises the specific error or copes.

   Why C: a decode round in a serving loop runs with cold caches, where each of the ~26 NumPy
   calls of the fused Python path costs 3-30 us; one C call does the whole round. */

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KV_FALLBACK (-1)
#define KV_FREE (-1)

/* One slot per request for token seq[i] - 1: a new page (from the stack) for a request whose
   token starts one, else loc[i] + 1. Writes out[0..n); returns the pages taken. */
int64_t kv_alloc_decode(const int64_t *seq, const int64_t *loc, int64_t n, int64_t shift,
                        int32_t *marks, int64_t num_pages, const int64_t *stack, int64_t head,
                        int64_t capacity, int64_t *out) {
    const int64_t mask = ((int64_t)1 << shift) - 1;
    if (head < 0 || head > capacity || shift < 1 || shift > 40) {
        return KV_FALLBACK; /* a state the NumPy path must judge (or a corrupt one) */
    }
    int64_t num_new = 0;
    for (int64_t i = 0; i < n; i++) {
        if (seq[i] < 1) {
            return KV_FALLBACK; /* every seq_len counts the new token */
        }
        int64_t pos = seq[i] - 1;
        if ((pos & mask) == 0) {
            num_new++;
            continue;
        }
        if (loc == 0 || loc[i] < 0 || loc[i] == INT64_MAX) {
            return KV_FALLBACK; /* no last_loc, or one that cannot be a slot */
        }
        if (marks != 0) {
            int64_t next = loc[i] + 1;
            int64_t page = next >> shift;
            if (page >= num_pages || marks[page] < 0 || (next & mask) != (pos & mask)) {
                return KV_FALLBACK; /* out of range, not handed out, or misaligned */
            }
        }
    }
    if (num_new > capacity - head) {
        return KV_FALLBACK; /* short on the stack: released pages may help, or it fails */
    }
    int64_t k = head;
    for (int64_t i = 0; i < n; i++) {
        if (((seq[i] - 1) & mask) == 0) {
            int64_t page = stack[k++];
            if (marks != 0) {
                marks[page] = 0;
            }
            out[i] = page << shift;
        } else {
            out[i] = loc[i] + 1;
        }
    }
    return num_new;
}

/* Free the pages of m slots lying in m distinct pages (a decode batch's output), m < 2^31:
   push them on the stack below `head`. Returns the new head. `checked`: every page must be
   handed out (marks >= 0) and is marked FREE. */
int64_t kv_free_slots(const int64_t *slots, int64_t m, int64_t shift, int32_t *marks,
                      int64_t num_pages, int64_t checked, int64_t *stack, int64_t head) {
    if (m > head || head > num_pages - 1 || shift < 1 || shift > 40) {
        return KV_FALLBACK; /* more pages than were handed out (a double free), or a bad state */
    }
    for (int64_t i = 0; i < m; i++) {
        int64_t page = slots[i] >> shift;
        if (page < 1 || page >= num_pages || (checked && marks[page] < 0)) {
            return KV_FALLBACK;
        }
    }
    /* Stamps: marks[page] = i, read back; all survive iff the pages are distinct. The marks of
       handed-out pages stay >= 0, so falling back here leaves a consistent state. */
    for (int64_t i = 0; i < m; i++) {
        marks[slots[i] >> shift] = (int32_t)i;
    }
    for (int64_t i = 0; i < m; i++) {
        if (marks[slots[i] >> shift] != (int32_t)i) {
            return KV_FALLBACK;
        }
    }
    int64_t base = head - m;
    for (int64_t i = 0; i < m; i++) {
        int64_t page = slots[i] >> shift;
        if (checked) {
            marks[page] = KV_FREE;
        }
        stack[base + i] = page;
    }
    return base;
}

#ifdef __cplusplus
}
#endif
