/* The CPU gather-scatter of whole page rows between a device pool's buffers and its host
   mirror's, in one call for every buffer of the pool: an extension module of the running
   interpreter (built by copy_pages.py through `kvstrata.pool.native.native_extension`).

   copy_pages(table, src_rows, dst_rows, src_pages, dst_pages) -> int

   `table` is a C-contiguous int64 array of 5 entries per buffer b: source address, source row
   stride, destination address, destination row stride, row bytes; row r of a side starts at
   its address + r * its stride. For each k, row src_pages[k] of every source buffer is copied
   to row dst_pages[k] of the destination buffer of the same index. Every page id is checked
   against its side's row count (`src_rows`, `dst_rows`) first: on any id out of range nothing
   is copied and -1 is returned (the caller raises its own error); otherwise the number of
   pages. Consecutive pages that advance together on both sides are one memcpy when both
   sides' rows are packed (stride == row bytes). Arguments that are not int64 C-contiguous
   buffers of matching lengths raise TypeError / ValueError before anything is copied.

   Why C: a backup of a few scattered pages costs tens of microseconds in NumPy / torch calls
   per buffer (views, index arrays, a fancy gather and scatter) and ctypes' argument
   conversion several more; the memcpys take well under one. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* An int64 C-contiguous view of `obj`; 0 on success, -1 with an exception set. */
static int int64_view(PyObject *obj, Py_buffer *view, const char *what)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        return -1;
    }
    const char *f = view->format;
    int bare = f != NULL && (f[0] == 'l' || f[0] == 'q') && f[1] == '\0';
    int native_order = f != NULL && (f[0] == '<' || f[0] == '=' || f[0] == '@') &&
                       (f[1] == 'l' || f[1] == 'q') && f[2] == '\0';
    int ok = view->itemsize == 8 && (bare || native_order);
    if (!ok) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_TypeError, "copy_pages: %s must be an int64 array", what);
        return -1;
    }
    return 0;
}

static PyObject *copy_pages(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError,
                        "copy_pages(table, src_rows, dst_rows, src_pages, dst_pages)");
        return NULL;
    }
    int64_t src_rows = PyLong_AsLongLong(args[1]);
    if (src_rows == -1 && PyErr_Occurred()) {
        return NULL;
    }
    int64_t dst_rows = PyLong_AsLongLong(args[2]);
    if (dst_rows == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_buffer tv, sv, dv;
    if (int64_view(args[0], &tv, "table") < 0) {
        return NULL;
    }
    if (int64_view(args[3], &sv, "src_pages") < 0) {
        PyBuffer_Release(&tv);
        return NULL;
    }
    if (int64_view(args[4], &dv, "dst_pages") < 0) {
        PyBuffer_Release(&tv);
        PyBuffer_Release(&sv);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t entries = tv.len / 8;
    Py_ssize_t n = sv.len / 8;
    const int64_t *table = (const int64_t *)tv.buf;
    const int64_t *src_pages = (const int64_t *)sv.buf;
    const int64_t *dst_pages = (const int64_t *)dv.buf;
    if (entries % 5 || dv.len != sv.len) {
        PyErr_SetString(PyExc_ValueError,
                        "copy_pages: table holds 5 entries per buffer and the page arrays "
                        "must be of equal length");
        goto done;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        if (src_pages[k] < 0 || src_pages[k] >= src_rows || dst_pages[k] < 0 ||
            dst_pages[k] >= dst_rows) {
            result = PyLong_FromLong(-1);
            goto done;
        }
    }
    for (Py_ssize_t b = 0; b < entries / 5; b++) {
        const int64_t *entry = table + 5 * b;
        const char *src = (const char *)(intptr_t)entry[0];
        int64_t s_stride = entry[1];
        char *dst = (char *)(intptr_t)entry[2];
        int64_t d_stride = entry[3];
        int64_t bytes = entry[4];
        int packed = s_stride == bytes && d_stride == bytes;
        Py_ssize_t k = 0;
        while (k < n) {
            Py_ssize_t run = 1;
            if (packed) {
                while (k + run < n && src_pages[k + run] == src_pages[k] + run &&
                       dst_pages[k + run] == dst_pages[k] + run) {
                    run++;
                }
            }
            memcpy(dst + dst_pages[k] * d_stride, src + src_pages[k] * s_stride,
                   (size_t)(run * bytes));
            k += run;
        }
    }
    result = PyLong_FromSsize_t(n);
done:
    PyBuffer_Release(&tv);
    PyBuffer_Release(&sv);
    PyBuffer_Release(&dv);
    return result;
}

static PyMethodDef methods[] = {
    {"copy_pages", (PyCFunction)(void (*)(void))copy_pages, METH_FASTCALL,
     "copy_pages(table, src_rows, dst_rows, src_pages, dst_pages) -> pages copied, or -1"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_kvstrata_copy_pages", "Compiled page-row copies of the host pool.",
    -1, methods,
};

PyMODINIT_FUNC PyInit__kvstrata_copy_pages(void) { return PyModule_Create(&module); }
