/* Compiled hot paths of the Full-only device tree (kvstrata.unified_radix_cache.native_core).

Part 1 of 4: native_core.py joins radix_core.c (names, walks, slot check), radix_evict.c (the
leaf heap and the eviction loop), radix_insert.c (the tiered insert) and radix_locks.c (lock
walks, method table, module init) into one file. Built at first use by kvstrata.pool.native.native_extension as the extension
module `_kvstrata_radix_core`; without it the tree runs the Python code these functions mirror
(walk.descend, SlotChecker.check), giving the same answers. They read the TreeNode objects
through their attributes (slots), so a wrong object raises AttributeError / TypeError /
ValueError: no input makes this code read or write outside a buffer.

    walk(root, page_bytes, namespace, data, end, split)
        -> (path, pos, partial)                walk.descend without `visit`
    match(root, page_bytes, namespace, data, end, split, tick)
        -> (path, pos, slots)                  descend with `split`, then per path node
                                               last_access = tick and hit_count += 1;
                                               slots: bytearray of the path's Full slots
                                               (int64, pos bytes), None for an empty path
    match_tiered(root, page_bytes, namespace, data, end, split, tick)
        -> (path, on_device, host_bytes, slots) descend with `split` over a tree with a host
                                               tier; `on_device` leading path nodes hold
                                               device slots (joined into `slots`, None when
                                               0), the rest's keys are `host_bytes` long;
                                               then every path node is touched as by match
    evict(heap, amount, page, page_bytes, root, no_children, pending, removed, cut, progress,
          held) -> (freed, nodes removed, joined)
                                               FullComponent._evict on a Full-only device
                                               tree without events: leaves in heap order,
                                               the last one cut page-granular; slots go to
                                               `pending`, undo records to `removed` / `cut`
                                               (lists or None); the caller adjusts sizes.
                                               `progress` (bytearray(16)) gets the same two
                                               counts (int64) on every return, an exception
                                               included: each leaf is either untouched or
                                               counted; amount is clamped to [0, 2**63 - 1];
                                               then, unless held is False, drain(pending,
                                               held), its result as joined (else None)
    lock_path(anchor, root, members) -> tokens locked, or None for an anchor outside root's tree
    unlock_path(anchor, heap) -> tokens unlocked (every count checked above zero first)
    drain(pending, held) -> bytearray | None
        FullComponent.flush's array work: the int64 arrays of list `pending` joined (None when
        there are no slots), the list emptied, each slot inside `held` (int32 flags, or None)
        cleared there; a bad buffer raises before anything changes
    check_slots(slots, lo, hi, held, keep) -> bool
        True when every slots[lo:hi] lies in held's range, is unmarked there and appears
        once: with keep they are marked (1), else held is as it was. False changes nothing:
        the caller runs its Python check, which raises the precise error (or grows the table).
        Slots sharing memory with held get False (the Python check copes with the overlap).
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static PyObject *s_children, *s_key, *s_value, *s_last_access, *s_hit_count;
static PyObject *s_heap, *s_members, *s_heap_entry, *s_parent, *s_namespace, *s_lock_ref;
static PyObject *s_push, *s_page_keys, *s_id;
static PyObject *heappop;  /* heapq.heappop */

/* `node.children[k]` as a new reference; NULL without an error set when absent. */
static PyObject *child_of(PyObject *node, PyObject *k)
{
    PyObject *children = PyObject_GetAttr(node, s_children);
    if (children == NULL)
        return NULL;
    PyObject *child;
    if (PyDict_CheckExact(children)) {
        child = PyDict_GetItemWithError(children, k);
        Py_XINCREF(child);
    } else {  /* the shared read-only NO_CHILDREN of a leaf, or another mapping */
        child = PyObject_GetItem(children, k);
        if (child == NULL && PyErr_ExceptionMatches(PyExc_KeyError))
            PyErr_Clear();
    }
    Py_DECREF(children);
    return child;
}

/* Bytes (whole pages, >= 1 page) of node key `ck` equal to data[pos:end], the first page
   being equal (walk.common_bytes: the first page that differs ends the match). */
static Py_ssize_t common_bytes(const char *ck, Py_ssize_t cklen, const char *data, Py_ssize_t pos,
                               Py_ssize_t end, Py_ssize_t pb)
{
    Py_ssize_t limit = cklen < end - pos ? cklen : end - pos;
    if (memcmp(data + pos, ck, (size_t)limit) == 0)
        return limit;
    Py_ssize_t p = pb;
    while (p + pb <= limit && memcmp(data + pos + p, ck + p, (size_t)pb) == 0)
        p += pb;
    return p;
}

/* The walk of walk.descend (no visit). On success returns the path (new list) and sets *pos
   and *partial; with `split` not None a match ending inside a node splits it there. */
static PyObject *descend(PyObject *root, Py_ssize_t pb, PyObject *ns, PyObject *data,
                         Py_ssize_t end, PyObject *split, Py_ssize_t *pos_out,
                         Py_ssize_t *partial_out)
{
    if (!PyBytes_Check(data)) {
        PyErr_SetString(PyExc_TypeError, "data must be bytes");
        return NULL;
    }
    Py_ssize_t size = PyBytes_GET_SIZE(data);
    if (pb <= 0 || end < 0 || end > size || end % pb) {
        PyErr_Format(PyExc_ValueError, "walk: end %zd not a whole number of %zd-byte pages "
                     "inside %zd bytes", end, pb, size);
        return NULL;
    }
    const char *d = PyBytes_AS_STRING(data);
    PyObject *path = PyList_New(0);
    if (path == NULL)
        return NULL;
    Py_ssize_t pos = 0, partial = 0;
    *pos_out = 0;
    *partial_out = 0;
    if (end == 0) {  /* descend looks up an empty first page: no child has an empty key */
        return path;
    }
    PyObject *first = PyBytes_FromStringAndSize(d, pb);
    if (first == NULL)
        goto fail;
    PyObject *rootkey = PyTuple_Pack(2, ns, first);
    Py_DECREF(first);
    if (rootkey == NULL)
        goto fail;
    PyObject *child = child_of(root, rootkey);
    Py_DECREF(rootkey);
    while (child != NULL) {
        PyObject *ck = PyObject_GetAttr(child, s_key);
        if (ck == NULL) {
            Py_DECREF(child);
            goto fail;
        }
        if (!PyBytes_Check(ck)) {
            Py_DECREF(ck);
            Py_DECREF(child);
            PyErr_SetString(PyExc_TypeError, "node key must be bytes");
            goto fail;
        }
        Py_ssize_t step = PyBytes_GET_SIZE(ck);
        if (step <= 0 || step % pb) {  /* every later read assumes whole pages */
            Py_DECREF(ck);
            Py_DECREF(child);
            PyErr_Format(PyExc_ValueError, "walk: a node key of %zd bytes is not a whole "
                         "number (>= 1) of %zd-byte pages", step, pb);
            goto fail;
        }
        PyObject *node;
        if (pos + step <= end && memcmp(d + pos, PyBytes_AS_STRING(ck), (size_t)step) == 0) {
            node = child;
            Py_INCREF(node);
        } else {
            step = common_bytes(PyBytes_AS_STRING(ck), step, d, pos, end, pb);
            if (split == Py_None) {
                Py_DECREF(ck);
                Py_DECREF(child);
                partial = step;
                break;
            }
            PyObject *tokens = PyLong_FromSsize_t(step / 8);
            node = tokens == NULL ? NULL : PyObject_CallFunctionObjArgs(split, child, tokens, NULL);
            Py_XDECREF(tokens);
            if (node == NULL) {
                Py_DECREF(ck);
                Py_DECREF(child);
                goto fail;
            }
        }
        Py_DECREF(ck);
        int rc = PyList_Append(path, node);
        pos += step;
        int stop = rc < 0 || pos >= end || node != child;
        Py_DECREF(child);
        child = NULL;
        if (rc < 0) {
            Py_DECREF(node);
            goto fail;
        }
        if (!stop) {
            PyObject *k = PyBytes_FromStringAndSize(d + pos, pb);
            if (k == NULL) {
                Py_DECREF(node);
                goto fail;
            }
            child = child_of(node, k);
            Py_DECREF(k);
        }
        Py_DECREF(node);
        if (stop)
            break;
    }
    if (PyErr_Occurred())
        goto fail;
    *pos_out = pos;
    *partial_out = partial;
    return path;
fail:
    Py_DECREF(path);
    return NULL;
}

/* args[i] for each index in `which` (ending with -1) as Py_ssize_t into out[...]. */
static int ssize_args(PyObject *const *args, const int *which, Py_ssize_t *out)
{
    for (int k = 0; which[k] >= 0; k++) {
        out[k] = PyLong_AsSsize_t(args[which[k]]);
        if (out[k] == -1 && PyErr_Occurred())
            return -1;
    }
    return 0;
}

static const int WALK_INTS[] = {1, 4, -1};

static PyObject *walk(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "walk(root, page_bytes, namespace, data, end, split)");
        return NULL;
    }
    Py_ssize_t ints[2], pos, partial;
    if (ssize_args(args, WALK_INTS, ints) < 0)
        return NULL;
    Py_ssize_t pb = ints[0], end = ints[1];
    PyObject *path = descend(args[0], pb, args[2], args[3], end, args[5], &pos, &partial);
    if (path == NULL)
        return NULL;
    return Py_BuildValue("(Nnn)", path, pos, partial);
}

/* node.hit_count += 1 and node.last_access = tick. */
static int touch(PyObject *node, PyObject *tick)
{
    if (PyObject_SetAttr(node, s_last_access, tick) < 0)
        return -1;
    PyObject *hits = PyObject_GetAttr(node, s_hit_count);
    if (hits == NULL)
        return -1;
    PyObject *one = PyLong_FromLong(1);
    PyObject *more = one == NULL ? NULL : PyNumber_Add(hits, one);
    Py_XDECREF(one);
    Py_DECREF(hits);
    if (more == NULL)
        return -1;
    int rc = PyObject_SetAttr(node, s_hit_count, more);
    Py_DECREF(more);
    return rc;
}

/* Bytes of node.value (a C-contiguous buffer of 8-byte items): `want` (the key's), or 0 (off
   the device) where `may_be_empty`; copied to `out` when it is not NULL. -1 with an exception
   otherwise. */
static Py_ssize_t read_value(PyObject *node, Py_ssize_t want, int may_be_empty, char *out)
{
    PyObject *value = PyObject_GetAttr(node, s_value);
    if (value == NULL)
        return -1;
    Py_buffer view;
    if (PyObject_GetBuffer(value, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        Py_DECREF(value);
        return -1;
    }
    Py_ssize_t len = view.len;
    if (view.itemsize != 8 || (len != want && (len != 0 || !may_be_empty))) {
        PyErr_Format(PyExc_ValueError, "node value: %zd bytes of %zd-byte items for a key of "
                     "%zd bytes", view.len, view.itemsize, want);
        len = -1;
    } else if (out != NULL) {
        memcpy(out, view.buf, (size_t)len);
    }
    PyBuffer_Release(&view);
    Py_DECREF(value);
    return len;
}

/* Bytes of node.key (bytes), -1 with an exception otherwise. */
static Py_ssize_t key_len(PyObject *node)
{
    PyObject *key = PyObject_GetAttr(node, s_key);
    if (key == NULL)
        return -1;
    Py_ssize_t want = PyBytes_Check(key) ? PyBytes_GET_SIZE(key) : -1;
    Py_DECREF(key);
    if (want < 0)
        PyErr_SetString(PyExc_TypeError, "node key must be bytes");
    return want;
}

/* The values of path[0:count] joined into a bytearray of `total` bytes, each as long as its
   node's key (None when count is 0), or NULL with an exception. */
static PyObject *join_values(PyObject *path, Py_ssize_t count, Py_ssize_t total, const char *who)
{
    if (count == 0)
        Py_RETURN_NONE;
    PyObject *slots = PyByteArray_FromStringAndSize(NULL, total);
    if (slots == NULL)
        return NULL;
    char *out = PyByteArray_AS_STRING(slots);
    Py_ssize_t at = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *node = PyList_GET_ITEM(path, i);
        Py_ssize_t want = key_len(node);
        if (want < 0)
            goto fail;
        if (at + want > total) {
            PyErr_Format(PyExc_ValueError, "%s: path keys longer than the match", who);
            goto fail;
        }
        if (read_value(node, want, 0, out + at) < 0)
            goto fail;
        at += want;
    }
    if (at != total) {
        PyErr_Format(PyExc_ValueError, "%s: path keys shorter than the match", who);
        goto fail;
    }
    return slots;
fail:
    Py_DECREF(slots);
    return NULL;
}

/* touch() on every node of path. */
static int touch_path(PyObject *path, PyObject *tick)
{
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(path); i++) {
        if (touch(PyList_GET_ITEM(path, i), tick) < 0)
            return -1;
    }
    return 0;
}

/* match (tiered 0) and match_tiered (1): the walk of their 7 arguments (root, page_bytes,
   namespace, data, end, split, tick), the device slots joined, the path touched. */
static PyObject *match_path(PyObject *const *args, Py_ssize_t nargs, int tiered)
{
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError,
                        tiered ? "match_tiered(root, page_bytes, namespace, data, end, split, tick)"
                               : "match(root, page_bytes, namespace, data, end, split, tick)");
        return NULL;
    }
    Py_ssize_t ints[2], pos, partial;
    if (ssize_args(args, WALK_INTS, ints) < 0)
        return NULL;
    if (!PyLong_Check(args[6])) {
        PyErr_SetString(PyExc_TypeError, "tick must be an int");
        return NULL;
    }
    PyObject *path = descend(args[0], ints[0], args[2], args[3], ints[1], args[5], &pos, &partial);
    if (path == NULL)
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(path), on = n, device_bytes = pos, host_bytes = 0;
    PyObject *slots = NULL;
    if (tiered) {
        /* Device values are prefix-closed: the leading nodes with slots are the device hit,
           the keys of the rest the host hit. */
        on = device_bytes = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *node = PyList_GET_ITEM(path, i);
            Py_ssize_t want = key_len(node);
            if (want < 0)
                goto fail;
            if (on == i) {
                Py_ssize_t got = read_value(node, want, 1, NULL);
                if (got < 0)
                    goto fail;
                if (got) {
                    on++;
                    device_bytes += got;
                    continue;
                }
            }
            host_bytes += want;
        }
    }
    slots = join_values(path, on, device_bytes, tiered ? "match_tiered" : "match");
    if (slots == NULL || touch_path(path, args[6]) < 0)
        goto fail;
    if (tiered)
        return Py_BuildValue("(NnnN)", path, on, host_bytes, slots);
    return Py_BuildValue("(NnN)", path, pos, slots);
fail:
    Py_XDECREF(slots);
    Py_DECREF(path);
    return NULL;
}

static PyObject *match(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return match_path(args, nargs, 0);
}

static PyObject *match_tiered(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return match_path(args, nargs, 1);
}

static int get_buffer(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, int writable)
{
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0)
        return -1;
    if (view->itemsize != itemsize || view->ndim != 1) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_ValueError, "expected a 1-D buffer of %zd-byte items", itemsize);
        return -1;
    }
    return 0;
}

static PyObject *check_slots(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "check_slots(slots, lo, hi, held, keep)");
        return NULL;
    }
    static const int which[] = {1, 2, -1};
    Py_ssize_t ints[2];
    if (ssize_args(args, which, ints) < 0)
        return NULL;
    Py_ssize_t lo = ints[0], hi = ints[1];
    int keep = PyObject_IsTrue(args[4]);
    if (keep < 0)
        return NULL;
    Py_buffer sv, hv;
    if (PyObject_GetBuffer(args[0], &sv, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();  /* e.g. a strided view: the Python check handles it */
        Py_RETURN_FALSE;
    }
    if (sv.itemsize != 8 || sv.ndim != 1 || sv.format == NULL ||
        (strcmp(sv.format, "l") && strcmp(sv.format, "q") && strcmp(sv.format, "<q") &&
         strcmp(sv.format, "=q"))) {
        PyBuffer_Release(&sv);
        Py_RETURN_FALSE;
    }
    if (get_buffer(args[3], &hv, 4, 1) < 0) {
        PyBuffer_Release(&sv);
        return NULL;
    }
    Py_ssize_t n = sv.len / 8;
    if (lo < 0 || hi > n || lo > hi) {
        PyBuffer_Release(&sv);
        PyBuffer_Release(&hv);
        PyErr_Format(PyExc_ValueError, "check_slots: [%zd, %zd) outside %zd slots", lo, hi, n);
        return NULL;
    }
    const char *s_lo = (const char *)sv.buf, *h_lo = (const char *)hv.buf;
    if (s_lo < h_lo + hv.len && h_lo < s_lo + sv.len) {
        /* The slots share memory with the table: a mark written below would change slots
           still to be read (and the undo would then index with them). The Python check
           copes (numpy copies overlapping operands). */
        PyBuffer_Release(&sv);
        PyBuffer_Release(&hv);
        Py_RETURN_FALSE;
    }
    const int64_t *s = (const int64_t *)sv.buf;
    int32_t *held = (int32_t *)hv.buf;
    int64_t rows = (int64_t)(hv.len / 4);
    Py_ssize_t i;
    int ok = 1;
    for (i = lo; i < hi; i++) {
        int64_t x = s[i];
        if (x < 0 || x >= rows || held[x] != 0) {  /* outside, held, or given twice */
            ok = 0;
            break;
        }
        held[x] = 1;
    }
    if (!ok || !keep) {
        for (Py_ssize_t j = lo; j < i; j++)
            held[s[j]] = 0;
    }
    PyBuffer_Release(&sv);
    PyBuffer_Release(&hv);
    return PyBool_FromLong(ok);
}
