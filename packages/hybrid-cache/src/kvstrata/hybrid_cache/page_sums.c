/* The page checksums of storage_io.py (zlib's CRC-32 of each page) for a whole batch in one
   call: `crc32_views` makes the 4-byte little-endian checksum of each page a backup stores
   beside it, `crc32_agree` checks the pages a prefetch read against the checksums read with
   them. The CRC runs on carry-less multiplies (PCLMULQDQ: folding 64 bytes at a time, the
   method of Intel's "Fast CRC Computation for Generic Polynomials Using PCLMULQDQ", as in
   Chromium's zlib) where the CPU has them (checked once, at import), else a table, byte by
   byte; both give `zlib.crc32` (tests compare them). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KV_HAVE_CLMUL_BUILD 1
#include <cpuid.h>
#include <immintrin.h>
#endif

static uint32_t crc_table[256];

static void make_table(void)
{
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++)
            c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[n] = c;
    }
}

/* The running (inverted) CRC over `len` more bytes, one table step a byte. */
static uint32_t crc_bytes(uint32_t crc, const uint8_t *buf, size_t len)
{
    while (len--)
        crc = crc_table[(crc ^ *buf++) & 0xFF] ^ (crc >> 8);
    return crc;
}

#ifdef KV_HAVE_CLMUL_BUILD
/* The running (inverted) CRC over `len` bytes, len >= 64 and a multiple of 16: four 128-bit
   lanes folded 64 bytes at a time, folded into one, then 16 bytes at a time, then reduced to
   32 bits (Barrett). Constants: the bit-reflected x^k mod P of the paper, and P with its
   Barrett quotient. */
__attribute__((target("pclmul,sse4.1"))) static uint32_t crc_clmul(uint32_t crc,
                                                                   const uint8_t *buf,
                                                                   size_t len)
{
    const __m128i k1k2 = _mm_set_epi64x(0x01c6e41596LL, 0x0154442bd4LL);
    const __m128i k3k4 = _mm_set_epi64x(0x00ccaa009eLL, 0x01751997d0LL);
    const __m128i k5k0 = _mm_set_epi64x(0, 0x0163cd6124LL);
    const __m128i poly = _mm_set_epi64x(0x01f7011641LL, 0x01db710641LL);
    const __m128i low32 = _mm_setr_epi32(~0, 0, ~0, 0);
    __m128i x1 = _mm_loadu_si128((const __m128i *)(buf + 0x00));
    __m128i x2 = _mm_loadu_si128((const __m128i *)(buf + 0x10));
    __m128i x3 = _mm_loadu_si128((const __m128i *)(buf + 0x20));
    __m128i x4 = _mm_loadu_si128((const __m128i *)(buf + 0x30));
    __m128i x5, x6, x7, x8;
    x1 = _mm_xor_si128(x1, _mm_cvtsi32_si128((int)crc));
    buf += 64;
    len -= 64;
    while (len >= 64) {
        x5 = _mm_clmulepi64_si128(x1, k1k2, 0x00);
        x6 = _mm_clmulepi64_si128(x2, k1k2, 0x00);
        x7 = _mm_clmulepi64_si128(x3, k1k2, 0x00);
        x8 = _mm_clmulepi64_si128(x4, k1k2, 0x00);
        x1 = _mm_clmulepi64_si128(x1, k1k2, 0x11);
        x2 = _mm_clmulepi64_si128(x2, k1k2, 0x11);
        x3 = _mm_clmulepi64_si128(x3, k1k2, 0x11);
        x4 = _mm_clmulepi64_si128(x4, k1k2, 0x11);
        x1 = _mm_xor_si128(_mm_xor_si128(x1, x5), _mm_loadu_si128((const __m128i *)(buf + 0x00)));
        x2 = _mm_xor_si128(_mm_xor_si128(x2, x6), _mm_loadu_si128((const __m128i *)(buf + 0x10)));
        x3 = _mm_xor_si128(_mm_xor_si128(x3, x7), _mm_loadu_si128((const __m128i *)(buf + 0x20)));
        x4 = _mm_xor_si128(_mm_xor_si128(x4, x8), _mm_loadu_si128((const __m128i *)(buf + 0x30)));
        buf += 64;
        len -= 64;
    }
    /* Four lanes into one. */
    x5 = _mm_clmulepi64_si128(x1, k3k4, 0x00);
    x1 = _mm_clmulepi64_si128(x1, k3k4, 0x11);
    x1 = _mm_xor_si128(_mm_xor_si128(x1, x2), x5);
    x5 = _mm_clmulepi64_si128(x1, k3k4, 0x00);
    x1 = _mm_clmulepi64_si128(x1, k3k4, 0x11);
    x1 = _mm_xor_si128(_mm_xor_si128(x1, x3), x5);
    x5 = _mm_clmulepi64_si128(x1, k3k4, 0x00);
    x1 = _mm_clmulepi64_si128(x1, k3k4, 0x11);
    x1 = _mm_xor_si128(_mm_xor_si128(x1, x4), x5);
    while (len >= 16) {
        x2 = _mm_loadu_si128((const __m128i *)buf);
        x5 = _mm_clmulepi64_si128(x1, k3k4, 0x00);
        x1 = _mm_clmulepi64_si128(x1, k3k4, 0x11);
        x1 = _mm_xor_si128(_mm_xor_si128(x1, x2), x5);
        buf += 16;
        len -= 16;
    }
    /* 128 bits to 64. */
    x2 = _mm_clmulepi64_si128(x1, k3k4, 0x10);
    x1 = _mm_xor_si128(_mm_srli_si128(x1, 8), x2);
    x2 = _mm_srli_si128(x1, 4);
    x1 = _mm_and_si128(x1, low32);
    x1 = _mm_clmulepi64_si128(x1, k5k0, 0x00);
    x1 = _mm_xor_si128(x1, x2);
    /* Barrett reduction to 32 bits. */
    x2 = _mm_and_si128(x1, low32);
    x2 = _mm_clmulepi64_si128(x2, poly, 0x10);
    x2 = _mm_and_si128(x2, low32);
    x2 = _mm_clmulepi64_si128(x2, poly, 0x00);
    x1 = _mm_xor_si128(x1, x2);
    return (uint32_t)_mm_extract_epi32(x1, 1);
}

static int cpu_has_clmul(void)
{
    unsigned int a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d))
        return 0;
    return (c & bit_PCLMUL) && (c & bit_SSE4_1);
}
#endif

static int use_clmul = 0;

/* zlib.crc32(buf[:len]); `table`: the table only (tests). */
static uint32_t crc32_of(const uint8_t *buf, size_t len, int table)
{
    uint32_t crc = 0xFFFFFFFFu;
#ifdef KV_HAVE_CLMUL_BUILD
    if (use_clmul && !table && len >= 64) {
        size_t chunk = len & ~(size_t)15;
        crc = crc_clmul(crc, buf, chunk);
        buf += chunk;
        len -= chunk;
    }
#else
    (void)table;
#endif
    return ~crc_bytes(crc, buf, len);
}

/* The CRC of one C-contiguous buffer object into *out; -1 with an error set. */
static int crc_of_object(PyObject *obj, int table, uint32_t *out)
{
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    *out = crc32_of((const uint8_t *)view.buf, (size_t)view.len, table);
    PyBuffer_Release(&view);
    return 0;
}

static int table_flag(PyObject *arg, int *table)
{
    *table = PyObject_IsTrue(arg);
    return *table < 0 ? -1 : 0;
}

/* crc32_views(views, table) -> [memoryview of the 4 little-endian bytes of zlib.crc32(v)]. */
static PyObject *crc32_views(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    int table;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "crc32_views(views, table)");
        return NULL;
    }
    if (!PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "crc32_views: views must be a list");
        return NULL;
    }
    if (table_flag(args[1], &table) < 0)
        return NULL;
    PyObject *views = args[0];
    Py_ssize_t num = PyList_GET_SIZE(views);
    PyObject *out = PyList_New(num);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < num; i++) {
        if (i >= PyList_GET_SIZE(views)) {
            Py_DECREF(out);
            PyErr_SetString(PyExc_RuntimeError, "crc32_views: the list changed size");
            return NULL;
        }
        uint32_t crc;
        if (crc_of_object(PyList_GET_ITEM(views, i), table, &crc) < 0) {
            Py_DECREF(out);
            return NULL;
        }
        char le[4] = {(char)(crc & 0xFF), (char)((crc >> 8) & 0xFF), (char)((crc >> 16) & 0xFF),
                      (char)(crc >> 24)};
        PyObject *sum = PyBytes_FromStringAndSize(le, 4);
        PyObject *view = sum == NULL ? NULL : PyMemoryView_FromObject(sum);
        Py_XDECREF(sum);
        if (view == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, view);
    }
    return out;
}

/* crc32_agree(views, sums, table) -> [checksum of views[k] == sums[k]]: True where sums[k]
   (a buffer) holds exactly the 4 little-endian bytes of zlib.crc32(views[k]). */
static PyObject *crc32_agree(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    int table;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "crc32_agree(views, sums, table)");
        return NULL;
    }
    if (!PyList_Check(args[0]) || !PyList_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "crc32_agree: views and sums must be lists");
        return NULL;
    }
    if (PyList_GET_SIZE(args[0]) != PyList_GET_SIZE(args[1])) {
        PyErr_SetString(PyExc_ValueError, "crc32_agree: as many sums as views");
        return NULL;
    }
    if (table_flag(args[2], &table) < 0)
        return NULL;
    PyObject *views = args[0], *sums = args[1];
    Py_ssize_t num = PyList_GET_SIZE(views);
    PyObject *out = PyList_New(num);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < num; i++) {
        if (i >= PyList_GET_SIZE(views) || i >= PyList_GET_SIZE(sums)) {
            Py_DECREF(out);
            PyErr_SetString(PyExc_RuntimeError, "crc32_agree: a list changed size");
            return NULL;
        }
        uint32_t crc;
        if (crc_of_object(PyList_GET_ITEM(views, i), table, &crc) < 0) {
            Py_DECREF(out);
            return NULL;
        }
        Py_buffer sum;
        if (PyObject_GetBuffer(PyList_GET_ITEM(sums, i), &sum, PyBUF_C_CONTIGUOUS) < 0) {
            Py_DECREF(out);
            return NULL;
        }
        const uint8_t *s = (const uint8_t *)sum.buf;
        int same = sum.len == 4 && s[0] == (crc & 0xFF) && s[1] == ((crc >> 8) & 0xFF) &&
                   s[2] == ((crc >> 16) & 0xFF) && s[3] == (crc >> 24);
        PyBuffer_Release(&sum);
        PyObject *flag = same ? Py_True : Py_False;
        Py_INCREF(flag);
        PyList_SET_ITEM(out, i, flag);
    }
    return out;
}

/* uses_clmul() -> whether the CRC runs on carry-less multiplies. */
static PyObject *uses_clmul(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(args))
{
    return PyBool_FromLong(use_clmul);
}

static PyMethodDef methods[] = {
    {"crc32_views", (PyCFunction)(void (*)(void))crc32_views, METH_FASTCALL,
     "crc32_views(views, table) -> list of 4-byte checksum memoryviews"},
    {"crc32_agree", (PyCFunction)(void (*)(void))crc32_agree, METH_FASTCALL,
     "crc32_agree(views, sums, table) -> list of bool"},
    {"uses_clmul", uses_clmul, METH_NOARGS, "uses_clmul() -> bool"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_kvstrata_page_sums", "Compiled page checksums (CRC-32).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__kvstrata_page_sums(void)
{
    make_table();
#ifdef KV_HAVE_CLMUL_BUILD
    use_clmul = cpu_has_clmul();
#endif
    return PyModule_Create(&module);
}
