/* Page copies for kvstrata.pool's CPU page I/O, compiled at first use by native.py.

   A buffer stack is B buffers x num_pages pages x W bytes (piece (b, p) at
   stack + (b * num_pages + p) * W). A caller's flat buffer holds page i's piece of buffer b at
   flat + i * row + offset + b * stride. kv_copy copies pieces (b, ids[i]) out (a gather) or
   in (a scatter), for every i < n and b < B, in (i, b) order.

   Why C: at page size 1 a page set is thousands of small pieces at random addresses, and one
   core copying them with memcpy waits on each piece's cache misses in turn. Here the gather
   prefetches the piece PREFETCH_AHEAD positions later so that many misses are in flight, and
   with `stream` both copies write with non-temporal stores, which skip reading the
   destination lines before overwriting them (a plain copy pays that read). The ids must be
   valid page numbers and the buffers large enough: the Python side has checked them. */

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__SSE2__)
#include <emmintrin.h>
#define KV_STREAM 1
#endif
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define KV_AVX2 1
#endif

#ifdef __cplusplus
extern "C" {
#endif

#define PREFETCH_AHEAD 8
/* Lines of a piece the gather prefetches: past the first ones the hardware streamer follows. */
#define PREFETCH_BYTES 2048

/* `stream`: 0 = plain stores (memcpy); 1 = SSE2 non-temporal stores; 2 = AVX2 ones when the
   CPU has them (checked at run time: the library is built for any x86-64), else SSE2. A piece
   streams only when destination and width are whole 64-byte lines; otherwise memcpy. */

#ifdef KV_AVX2
__attribute__((target("avx2"))) static void stream_avx2(uint8_t *dst, const uint8_t *src,
                                                        int64_t w) {
    for (int64_t o = 0; o < w; o += 64) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(src + o));
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + o + 32));
        _mm256_stream_si256((__m256i *)(dst + o), a);
        _mm256_stream_si256((__m256i *)(dst + o + 32), b);
    }
}

static int have_avx2(void) {
    static int known = -1; /* a benign race: every thread writes the same value */
    if (known < 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("avx2") ? 1 : 0;
    }
    return known;
}
#endif

static int stream_mode(int64_t stream) {
#ifdef KV_AVX2
    if (stream >= 2) {
        return have_avx2() ? 2 : 1;
    }
#endif
    return stream > 0 ? 1 : 0;
}

static inline void copy_piece(uint8_t *dst, const uint8_t *src, int64_t w, int mode) {
#ifdef KV_STREAM
    if (mode && (((uintptr_t)dst | (uintptr_t)w) & 63) == 0) {
#ifdef KV_AVX2
        if (mode == 2) {
            stream_avx2(dst, src, w);
            return;
        }
#endif
        for (int64_t o = 0; o < w; o += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(src + o));
            __m128i b = _mm_loadu_si128((const __m128i *)(src + o + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + o + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + o + 48));
            _mm_stream_si128((__m128i *)(dst + o), a);
            _mm_stream_si128((__m128i *)(dst + o + 16), b);
            _mm_stream_si128((__m128i *)(dst + o + 32), c);
            _mm_stream_si128((__m128i *)(dst + o + 48), d);
        }
        return;
    }
#else
    (void)mode;
#endif
    memcpy(dst, src, (size_t)w);
}

static inline void fence(int mode) {
#ifdef KV_STREAM
    if (mode) {
        _mm_sfence(); /* streamed stores are weakly ordered: visible before we return */
    }
#else
    (void)mode;
#endif
}

/* The pool's page-id checks, before any byte moves: every id in [lo, num_pages) (lo = 0 with
   `allow_zero`, else 1) and, with `distinct`, no id twice (an open-addressing set). 0 when
   they pass; 1 when not, or 2 when the set's memory could not be had: the caller then runs
   its own checks, which raise the specific error. */
static int64_t check_ids(const int64_t *ids, int64_t n, int64_t num_pages, int64_t allow_zero,
                         int64_t distinct) {
    const int64_t lo = allow_zero ? 0 : 1;
    for (int64_t i = 0; i < n; i++) {
        if (ids[i] < lo || ids[i] >= num_pages) {
            return 1;
        }
    }
    if (!distinct || n < 2) {
        return 0;
    }
    int64_t cap = 64;
    while (cap < 2 * n) {
        cap <<= 1;
    }
    int64_t local[1024];
    int64_t *table = cap <= 1024 ? local : (int64_t *)malloc((size_t)cap * sizeof(int64_t));
    if (table == 0) {
        return 2;
    }
    for (int64_t k = 0; k < cap; k++) {
        table[k] = -1;
    }
    int64_t found = 0;
    for (int64_t i = 0; i < n && !found; i++) {
        uint64_t h = ((uint64_t)ids[i] * 0x9E3779B97F4A7C15ull) >> 20;
        for (;;) {
            int64_t *slot = &table[h & (uint64_t)(cap - 1)];
            if (*slot == -1) {
                *slot = ids[i];
                break;
            }
            if (*slot == ids[i]) {
                found = 1;
                break;
            }
            h++;
        }
    }
    if (table != local) {
        free(table);
    }
    return found;
}

/* One stack's copy: with `scatter`, from `flat` into the stack, else (a gather) from the
   stack out to `flat`. `check`: 0 = none (a later stack of the same call), else check the ids
   first (distinct for a scatter). Returns 0 after copying, or check_ids' refusal having
   copied nothing. */
int64_t kv_copy(uint8_t *stack, int64_t num_pages, int64_t w, int64_t nb, uint8_t *flat,
                int64_t row, int64_t offset, int64_t stride, const int64_t *ids, int64_t n,
                int64_t stream, int64_t check, int64_t allow_zero, int64_t scatter) {
    if (check) {
        int64_t refused = check_ids(ids, n, num_pages, allow_zero, scatter);
        if (refused) {
            return refused;
        }
    }
    int mode = stream_mode(stream);
    if (scatter) {
        for (int64_t i = 0; i < n; i++) {
            const uint8_t *from = flat + i * row + offset;
            uint8_t *dst = stack + ids[i] * w;
            for (int64_t b = 0; b < nb; b++) {
                copy_piece(dst + b * num_pages * w, from + b * stride, w, mode);
            }
        }
    } else {
        int64_t reach = w < PREFETCH_BYTES ? w : PREFETCH_BYTES;
        /* pi, pb: the piece prefetched next */
        int64_t pi = PREFETCH_AHEAD / nb, pb = PREFETCH_AHEAD % nb;
        for (int64_t i = 0; i < n; i++) {
            uint8_t *dst = flat + i * row + offset;
            const uint8_t *src = stack + ids[i] * w;
            for (int64_t b = 0; b < nb; b++) {
                if (pi < n) {
                    const uint8_t *p = stack + (pb * num_pages + ids[pi]) * w;
                    for (int64_t o = 0; o < reach; o += 64) {
                        __builtin_prefetch(p + o, 0, 3);
                    }
                    if (++pb == nb) {
                        pb = 0;
                        ++pi;
                    }
                }
                copy_piece(dst + b * stride, src + b * num_pages * w, w, mode);
            }
        }
    }
    fence(mode);
    return 0;
}

#ifdef __cplusplus
}
#endif
