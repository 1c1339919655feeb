/* The SHA-256 page-key chain of `kvstrata.storage.keys.PageKeyer` (hash "sha256") in one call:

       key_i = SHA-256(key_i-1 || data[i * step : (i + 1) * step]),   key_-1 = parent

   the same keys as `PageKeyer._chain`, without its per-page Python step (a slice, a
   concatenation, a hash object and a digest object per page). The compression function runs
   on the SHA extensions (SHA-NI) where the CPU has them (checked once, at import), else a
   portable one; both give the FIPS 180-4 digest (tests compare them with hashlib). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KV_HAVE_SHANI_BUILD 1
#include <cpuid.h>
#include <immintrin.h>
#endif

static const uint32_t K256[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
    0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
    0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
    0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
    0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
    0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
    0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
    0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
    0xc67178f2,
};

static const uint32_t IV256[8] = {
    0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
    0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19,
};

typedef void (*compress_fn)(uint32_t state[8], const uint8_t *data, size_t num_blocks);

#define ROTR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static void compress_portable(uint32_t state[8], const uint8_t *data, size_t num_blocks)
{
    uint32_t w[64];
    for (; num_blocks; num_blocks--, data += 64) {
        for (int t = 0; t < 16; t++)
            w[t] = (uint32_t)data[4 * t] << 24 | (uint32_t)data[4 * t + 1] << 16 |
                   (uint32_t)data[4 * t + 2] << 8 | (uint32_t)data[4 * t + 3];
        for (int t = 16; t < 64; t++) {
            uint32_t s0 = ROTR(w[t - 15], 7) ^ ROTR(w[t - 15], 18) ^ (w[t - 15] >> 3);
            uint32_t s1 = ROTR(w[t - 2], 17) ^ ROTR(w[t - 2], 19) ^ (w[t - 2] >> 10);
            w[t] = w[t - 16] + s0 + w[t - 7] + s1;
        }
        uint32_t a = state[0], b = state[1], c = state[2], d = state[3];
        uint32_t e = state[4], f = state[5], g = state[6], h = state[7];
        for (int t = 0; t < 64; t++) {
            uint32_t t1 = h + (ROTR(e, 6) ^ ROTR(e, 11) ^ ROTR(e, 25)) + ((e & f) ^ (~e & g)) +
                          K256[t] + w[t];
            uint32_t t2 = (ROTR(a, 2) ^ ROTR(a, 13) ^ ROTR(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
            h = g;
            g = f;
            f = e;
            e = d + t1;
            d = c;
            c = b;
            b = a;
            a = t1 + t2;
        }
        state[0] += a;
        state[1] += b;
        state[2] += c;
        state[3] += d;
        state[4] += e;
        state[5] += f;
        state[6] += g;
        state[7] += h;
    }
}

#ifdef KV_HAVE_SHANI_BUILD
/* The rounds on the SHA extensions: the state as (A,B,E,F) and (C,D,G,H) vectors, four rounds
   (two sha256rnds2) per group of four message words, the schedule by sha256msg1/msg2. */
__attribute__((target("sha,sse4.1,ssse3"))) static void
compress_shani(uint32_t state[8], const uint8_t *data, size_t num_blocks)
{
    const __m128i swap = _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);
    __m128i tmp = _mm_loadu_si128((const __m128i *)&state[0]);    /* A B C D (low first) */
    __m128i state1 = _mm_loadu_si128((const __m128i *)&state[4]); /* E F G H */
    tmp = _mm_shuffle_epi32(tmp, 0xB1);                           /* B A D C */
    state1 = _mm_shuffle_epi32(state1, 0x1B);                     /* H G F E */
    __m128i state0 = _mm_alignr_epi8(tmp, state1, 8);             /* F E B A: ABEF */
    state1 = _mm_blend_epi16(state1, tmp, 0xF0);                  /* H G D C: CDGH */
    for (; num_blocks; num_blocks--, data += 64) {
        __m128i abef = state0, cdgh = state1;
        __m128i msg[4];
        for (int i = 0; i < 4; i++)
            msg[i] = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(data + 16 * i)), swap);
        for (int i = 0; i < 16; i++) {
            __m128i m = msg[i & 3];
            __m128i wk = _mm_add_epi32(m, _mm_loadu_si128((const __m128i *)&K256[4 * i]));
            state1 = _mm_sha256rnds2_epu32(state1, state0, wk);
            state0 = _mm_sha256rnds2_epu32(state0, state1, _mm_shuffle_epi32(wk, 0x0E));
            if (i < 12) {
                /* W[4(i+4) .. +3] from W[4i .. 4i+15]: msg[i & 3] is replaced by it. */
                __m128i next = _mm_sha256msg1_epu32(m, msg[(i + 1) & 3]);
                next = _mm_add_epi32(next, _mm_alignr_epi8(msg[(i + 3) & 3], msg[(i + 2) & 3], 4));
                msg[i & 3] = _mm_sha256msg2_epu32(next, msg[(i + 3) & 3]);
            }
        }
        state0 = _mm_add_epi32(state0, abef);
        state1 = _mm_add_epi32(state1, cdgh);
    }
    tmp = _mm_shuffle_epi32(state0, 0x1B);        /* F E B A -> A B E F reversed: FEBA */
    state1 = _mm_shuffle_epi32(state1, 0xB1);     /* DCHG */
    state0 = _mm_blend_epi16(tmp, state1, 0xF0);  /* DCBA */
    state1 = _mm_alignr_epi8(state1, tmp, 8);     /* HGFE */
    _mm_storeu_si128((__m128i *)&state[0], state0);
    _mm_storeu_si128((__m128i *)&state[4], state1);
}

static int cpu_has_shani(void)
{
    unsigned int a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d))
        return 0;
    if (!(c & bit_SSE4_1) || !(c & bit_SSSE3))
        return 0;
    if (__get_cpuid_max(0, NULL) < 7)
        return 0;
    __cpuid_count(7, 0, a, b, c, d);
    return (b & bit_SHA) != 0;
}
#endif

/* SHA-256 of prefix || body (prefix_len <= 64) into out[32]. */
static void sha256_two(compress_fn compress, const uint8_t *prefix, size_t prefix_len,
                       const uint8_t *body, size_t body_len, uint8_t out[32])
{
    uint32_t state[8];
    uint8_t block[128];
    memcpy(state, IV256, sizeof state);
    size_t total = prefix_len + body_len;
    size_t have = prefix_len; /* bytes pending in `block` */
    memcpy(block, prefix, prefix_len);
    if (have + body_len >= 64) {
        size_t fill = 64 - have;
        memcpy(block + have, body, fill);
        compress(state, block, 1);
        body += fill;
        body_len -= fill;
        size_t whole = body_len / 64;
        if (whole)
            compress(state, body, whole);
        body += whole * 64;
        body_len -= whole * 64;
        have = 0;
    }
    memcpy(block + have, body, body_len);
    have += body_len;
    /* Padding: 0x80, zeros, the message length in bits (big-endian), one or two blocks. */
    block[have++] = 0x80;
    size_t padded = have <= 56 ? 64 : 128;
    memset(block + have, 0, padded - have);
    uint64_t bits = (uint64_t)total * 8;
    for (int i = 0; i < 8; i++)
        block[padded - 1 - i] = (uint8_t)(bits >> (8 * i));
    compress(state, block, padded / 64);
    for (int i = 0; i < 8; i++) {
        out[4 * i] = (uint8_t)(state[i] >> 24);
        out[4 * i + 1] = (uint8_t)(state[i] >> 16);
        out[4 * i + 2] = (uint8_t)(state[i] >> 8);
        out[4 * i + 3] = (uint8_t)state[i];
    }
}

static compress_fn best_compress = compress_portable;

/* sha256_chain(data, end, parent, step, portable) -> list of keys (bytes of 32): one per
   `step` bytes of the first `end` bytes of `data` (a C-contiguous buffer; a shorter last piece
   gets a key too, as in `PageKeyer._chain`), chained from `parent` (bytes, at most 64 long).
   `portable`: use the portable rounds even where the SHA extensions are there (tests). */
static PyObject *sha256_chain(PyObject *Py_UNUSED(module), PyObject *const *args,
                              Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "sha256_chain(data, end, parent, step, portable)");
        return NULL;
    }
    PyObject *data_obj = args[0], *parent = args[2];
    Py_ssize_t end = PyLong_AsSsize_t(args[1]);
    if (end == -1 && PyErr_Occurred())
        return NULL;
    if (!PyBytes_Check(parent)) {
        PyErr_SetString(PyExc_TypeError, "sha256_chain: parent must be bytes");
        return NULL;
    }
    Py_ssize_t parent_len = PyBytes_GET_SIZE(parent);
    if (parent_len > 64) {
        PyErr_SetString(PyExc_ValueError, "sha256_chain: parent longer than 64 bytes");
        return NULL;
    }
    Py_ssize_t step = PyLong_AsSsize_t(args[3]);
    if (step == -1 && PyErr_Occurred())
        return NULL;
    if (step < 1) {
        PyErr_SetString(PyExc_ValueError, "sha256_chain: step must be >= 1");
        return NULL;
    }
    int portable = PyObject_IsTrue(args[4]);
    if (portable < 0)
        return NULL;
    compress_fn compress = portable ? compress_portable : best_compress;
    Py_buffer view;
    if (PyObject_GetBuffer(data_obj, &view, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (end < 0 || end > view.len) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "sha256_chain: end outside the data");
        return NULL;
    }
    Py_ssize_t num = end == 0 ? 0 : (end - 1) / step + 1;
    PyObject *keys = PyList_New(num);
    if (keys == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    uint8_t prev[64];
    size_t prev_len = (size_t)parent_len;
    memcpy(prev, PyBytes_AS_STRING(parent), prev_len);
    const uint8_t *data = (const uint8_t *)view.buf;
    for (Py_ssize_t i = 0; i < num; i++) {
        Py_ssize_t lo = i * step;
        Py_ssize_t len = end - lo < step ? end - lo : step;
        uint8_t digest[32];
        sha256_two(compress, prev, prev_len, data + lo, (size_t)len, digest);
        PyObject *key = PyBytes_FromStringAndSize((const char *)digest, 32);
        if (key == NULL) {
            Py_DECREF(keys);
            PyBuffer_Release(&view);
            return NULL;
        }
        PyList_SET_ITEM(keys, i, key);
        memcpy(prev, digest, 32);
        prev_len = 32;
    }
    PyBuffer_Release(&view);
    return keys;
}

/* uses_sha_extensions() -> whether the non-portable rounds are the SHA extensions. */
static PyObject *uses_sha_extensions(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(args))
{
    return PyBool_FromLong(best_compress != compress_portable);
}

static PyMethodDef methods[] = {
    {"sha256_chain", (PyCFunction)(void (*)(void))sha256_chain, METH_FASTCALL,
     "sha256_chain(data, end, parent, step, portable) -> list of 32-byte keys"},
    {"uses_sha_extensions", uses_sha_extensions, METH_NOARGS,
     "uses_sha_extensions() -> bool"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_kvstrata_page_keys", "The compiled SHA-256 page-key chain.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__kvstrata_page_keys(void)
{
#ifdef KV_HAVE_SHANI_BUILD
    if (cpu_has_shani())
        best_compress = compress_shani;
#endif
    return PyModule_Create(&module);
}
