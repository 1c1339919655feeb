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

/* Free the pages of m slots (m < 2^31) whose pages come in runs: consecutive slots of one page
   strictly rising (a decode batch's output: one slot per page; a tree's evicted run: whole
   pages), each page in one run only. Push the runs' pages on the stack below `head`, in run
   order (the order the NumPy path keeps). Returns the new head. `checked`: every page must be
   handed out (marks >= 0) and is marked FREE. */
int64_t kv_free_slots(const int64_t *slots, int64_t m, int64_t shift, int32_t *marks,
                      int64_t num_pages, int64_t checked, int64_t *stack, int64_t head) {
    if (head < 0 || head > num_pages - 1 || shift < 1 || shift > 40 || m >= INT32_MAX) {
        return KV_FALLBACK; /* a bad state */
    }
    int64_t runs = 0;
    for (int64_t i = 0; i < m; i++) {
        int64_t page = slots[i] >> shift;
        if (page < 1 || page >= num_pages || (checked && marks[page] < 0)) {
            return KV_FALLBACK;
        }
        if (i > 0 && page == (slots[i - 1] >> shift)) {
            if (slots[i] <= slots[i - 1]) {
                return KV_FALLBACK; /* not rising inside a page: perhaps a repeated slot */
            }
            continue;
        }
        runs++;
    }
    if (runs > head) {
        return KV_FALLBACK; /* more pages than were handed out (a double free) */
    }
    /* Stamps: marks[page] = run, read back; all survive iff no page starts two runs. The
       marks of handed-out pages stay >= 0, so falling back here leaves a consistent state. */
    int32_t run = 0;
    for (int64_t i = 0; i < m; i++) {
        int64_t page = slots[i] >> shift;
        if (i == 0 || page != (slots[i - 1] >> shift)) {
            marks[page] = run++;
        }
    }
    run = 0;
    for (int64_t i = 0; i < m; i++) {
        int64_t page = slots[i] >> shift;
        if (i == 0 || page != (slots[i - 1] >> shift)) {
            if (marks[page] != run++) {
                return KV_FALLBACK;
            }
        }
    }
    int64_t k = head - runs;
    for (int64_t i = 0; i < m; i++) {
        int64_t page = slots[i] >> shift;
        if (i == 0 || page != (slots[i - 1] >> shift)) {
            if (checked) {
                marks[page] = KV_FREE;
            }
            stack[k++] = page;
        }
    }
    return head - runs;
}

/* 0 when every one of the m slots lies in a page 1 .. num_pages - 1 that is handed out
   (`checked`: marks >= 0), else KV_FALLBACK (the NumPy path raises the specific error).
   Reads only. */
int64_t kv_check_slots(const int64_t *slots, int64_t m, int64_t shift, const int32_t *marks,
                       int64_t num_pages, int64_t checked) {
    if (shift < 1 || shift > 40) {
        return KV_FALLBACK;
    }
    int64_t last = 0;
    for (int64_t i = 0; i < m; i++) {
        int64_t page = slots[i] >> shift;
        if (i > 0 && page == last) {
            continue;
        }
        if (page < 1 || page >= num_pages || (checked && marks[page] < 0)) {
            return KV_FALLBACK;
        }
        last = page;
    }
    return 0;
}

#ifdef __cplusplus
}
#endif
