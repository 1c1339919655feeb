/* Page copies for kvstrata.pool's CPU page I/O, compiled at first use by native.py.

   A buffer stack is B buffers x num_pages pages x W bytes (piece (b, p) at
   stack + (b * num_pages + p) * W). A caller's flat buffer holds page i's piece of buffer b at
   out + i * row + offset + b * stride. kv_gather copies pieces (b, ids[i]) out, kv_scatter in,
   for every i < n and b < B, in (i, b) order.

   Why C: at page size 1 a page set is thousands of small pieces at random addresses, and one
   core copying them with memcpy waits on each piece's cache misses in turn. Here the gather
   prefetches the piece PREFETCH_AHEAD positions later so that many misses are in flight, and
   with `stream` both copies write with non-temporal stores, which skip reading the
   destination lines before overwriting them (a plain copy pays that read). The ids must be
   valid page numbers and the buffers large enough: the Python side has checked them. */

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__SSE2__)
#include <emmintrin.h>
#define KV_STREAM 1
#endif

#ifdef __cplusplus
extern "C" {
#endif

#define PREFETCH_AHEAD 8
/* Lines of a piece the gather prefetches: past the first ones the hardware streamer follows. */
#define PREFETCH_BYTES 2048

static inline void copy_piece(uint8_t *dst, const uint8_t *src, int64_t w, int stream) {
#ifdef KV_STREAM
    if (stream && (((uintptr_t)dst | (uintptr_t)w) & 63) == 0) {
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
    (void)stream;
#endif
    memcpy(dst, src, (size_t)w);
}

static inline void fence(int stream) {
#ifdef KV_STREAM
    if (stream) {
        _mm_sfence(); /* streamed stores are weakly ordered: visible before we return */
    }
#else
    (void)stream;
#endif
}

void kv_gather(uint8_t *out, int64_t row, int64_t offset, int64_t stride, const uint8_t *stack,
               int64_t num_pages, int64_t w, int64_t nb, const int64_t *ids, int64_t n,
               int64_t stream) {
    int64_t reach = w < PREFETCH_BYTES ? w : PREFETCH_BYTES;
    int64_t pi = PREFETCH_AHEAD / nb, pb = PREFETCH_AHEAD % nb; /* the piece prefetched next */
    for (int64_t i = 0; i < n; i++) {
        uint8_t *dst = out + i * row + offset;
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
            copy_piece(dst + b * stride, src + b * num_pages * w, w, (int)stream);
        }
    }
    fence((int)stream);
}

void kv_scatter(uint8_t *stack, int64_t num_pages, int64_t w, int64_t nb, const uint8_t *src,
                int64_t row, int64_t offset, int64_t stride, const int64_t *ids, int64_t n,
                int64_t stream) {
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *from = src + i * row + offset;
        uint8_t *dst = stack + ids[i] * w;
        for (int64_t b = 0; b < nb; b++) {
            copy_piece(dst + b * num_pages * w, from + b * stride, w, (int)stream);
        }
    }
    fence((int)stream);
}

#ifdef __cplusplus
}
#endif
