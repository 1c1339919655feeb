/* Compiled hot paths of the Full-only device tree (kvstrata.unified_radix_cache.native_core).

Built at first use by kvstrata.pool.native.native_extension as the extension module
`_kvstrata_radix_core`; without it the tree runs the Python code these functions mirror
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
    evict(heap, amount, page, page_bytes, root, no_children, pending, removed, cut, progress)
        -> (freed, nodes removed)              FullComponent._evict on a Full-only device
                                               tree without events: leaves in heap order,
                                               the last one cut page-granular; slots go to
                                               `pending`, undo records to `removed` / `cut`
                                               (lists or None); the caller adjusts sizes.
                                               `progress` (bytearray(16)) gets the same two
                                               counts (int64) on every return, an exception
                                               included: each leaf is either untouched or
                                               counted; amount is clamped to [0, 2**63 - 1]
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

/* Copy node.value (a C-contiguous buffer of 8-byte items, `want` bytes) to out. */
static int copy_value(PyObject *node, char *out, Py_ssize_t want)
{
    PyObject *value = PyObject_GetAttr(node, s_value);
    if (value == NULL)
        return -1;
    Py_buffer view;
    if (PyObject_GetBuffer(value, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        Py_DECREF(value);
        return -1;
    }
    int rc = 0;
    if (view.itemsize != 8 || view.len != want) {
        PyErr_Format(PyExc_ValueError, "node value: %zd bytes of %zd-byte items for a key of "
                     "%zd bytes", view.len, view.itemsize, want);
        rc = -1;
    } else {
        memcpy(out, view.buf, (size_t)want);
    }
    PyBuffer_Release(&view);
    Py_DECREF(value);
    return rc;
}

static PyObject *match(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError,
                        "match(root, page_bytes, namespace, data, end, split, tick)");
        return NULL;
    }
    Py_ssize_t ints[2], pos, partial;
    if (ssize_args(args, WALK_INTS, ints) < 0)
        return NULL;
    Py_ssize_t pb = ints[0], end = ints[1];
    if (!PyLong_Check(args[6])) {
        PyErr_SetString(PyExc_TypeError, "tick must be an int");
        return NULL;
    }
    PyObject *path = descend(args[0], pb, args[2], args[3], end, args[5], &pos, &partial);
    if (path == NULL)
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(path);
    PyObject *slots = NULL;
    if (n) {
        slots = PyByteArray_FromStringAndSize(NULL, pos);
        if (slots == NULL)
            goto fail;
        char *out = PyByteArray_AS_STRING(slots);
        Py_ssize_t at = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *node = PyList_GET_ITEM(path, i);
            if (touch(node, args[6]) < 0)
                goto fail;
            PyObject *key = PyObject_GetAttr(node, s_key);
            if (key == NULL)
                goto fail;
            Py_ssize_t want = PyBytes_Check(key) ? PyBytes_GET_SIZE(key) : -1;
            Py_DECREF(key);
            if (want < 0 || at + want > pos) {
                PyErr_SetString(PyExc_ValueError, "match: path keys longer than the match");
                goto fail;
            }
            if (copy_value(node, out + at, want) < 0)
                goto fail;
            at += want;
        }
        if (at != pos) {
            PyErr_SetString(PyExc_ValueError, "match: path keys shorter than the match");
            goto fail;
        }
    } else {
        slots = Py_None;
        Py_INCREF(slots);
    }
    return Py_BuildValue("(NnN)", path, pos, slots);
fail:
    Py_XDECREF(slots);
    Py_DECREF(path);
    return NULL;
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


/* The top live entry's node of LeafHeap `heap` (new reference), popping stale entries as
   LeafHeap.peek does; NULL without an error when the heap is empty. *entry_out: its entry. */
static PyObject *peek(PyObject *heap, PyObject **entry_out)
{
    for (;;) {
        PyObject *list = PyObject_GetAttr(heap, s_heap);
        if (list == NULL)
            return NULL;
        PyObject *members = PyObject_GetAttr(heap, s_members);
        if (members == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        if (!PyList_CheckExact(list) || !PyDict_CheckExact(members)) {
            Py_DECREF(list);
            Py_DECREF(members);
            PyErr_SetString(PyExc_TypeError, "evict: not a LeafHeap");
            return NULL;
        }
        PyObject *node = NULL, *entry = NULL;
        if (PyList_GET_SIZE(list) > 0) {
            entry = PyList_GET_ITEM(list, 0);
            Py_INCREF(entry);
            if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 3) {
                PyErr_SetString(PyExc_TypeError, "evict: a heap entry is not a 3-tuple");
            } else {
                node = PyDict_GetItemWithError(members, PyTuple_GET_ITEM(entry, 2));
                Py_XINCREF(node);
            }
        }
        Py_DECREF(members);
        if (PyErr_Occurred()) {
            Py_XDECREF(node);
            Py_XDECREF(entry);
            Py_DECREF(list);
            return NULL;
        }
        if (entry == NULL) {  /* empty */
            Py_DECREF(list);
            return NULL;
        }
        if (node != NULL) {
            PyObject *current = PyObject_GetAttr(node, s_heap_entry);
            if (current == NULL) {
                Py_DECREF(node);
                Py_DECREF(entry);
                Py_DECREF(list);
                return NULL;
            }
            int live = current == entry;
            Py_DECREF(current);
            if (live) {
                Py_DECREF(list);
                *entry_out = entry;
                return node;
            }
            Py_DECREF(node);
        }
        Py_DECREF(entry);
        PyObject *gone = PyObject_CallOneArg(heappop, list);  /* a stale entry */
        Py_DECREF(list);
        if (gone == NULL)
            return NULL;
        Py_DECREF(gone);
    }
}

/* LeafHeap.pop_peeked(node): the top entry (node's) leaves the heap and the members. */
static int pop_peeked(PyObject *heap, PyObject *node, PyObject *entry)
{
    PyObject *list = PyObject_GetAttr(heap, s_heap);
    if (list == NULL)
        return -1;
    PyObject *top = PyObject_CallOneArg(heappop, list);
    Py_DECREF(list);
    if (top == NULL)
        return -1;
    int same = top == entry;
    Py_DECREF(top);
    if (!same) {
        PyErr_SetString(PyExc_RuntimeError, "evict: the top heap entry is not the peeked node's");
        return -1;
    }
    PyObject *members = PyObject_GetAttr(heap, s_members);
    if (members == NULL)
        return -1;
    int rc = PyObject_DelItem(members, PyTuple_GET_ITEM(entry, 2));
    Py_DECREF(members);
    if (rc < 0)
        return -1;
    return PyObject_SetAttr(node, s_heap_entry, Py_None);
}

static PyObject *slice_of(PyObject *obj, Py_ssize_t start, Py_ssize_t stop)
{
    PyObject *a = PyLong_FromSsize_t(start);
    PyObject *b = stop < 0 ? Py_NewRef(Py_None) : PyLong_FromSsize_t(stop);
    PyObject *sl = a && b ? PySlice_New(a, b, NULL) : NULL;
    Py_XDECREF(a);
    Py_XDECREF(b);
    if (sl == NULL)
        return NULL;
    PyObject *out = PyObject_GetItem(obj, sl);
    Py_DECREF(sl);
    return out;
}

/* Drop the last item of `list` (an append being undone; shrinking a list cannot fail). */
static void drop_last(PyObject *list)
{
    Py_ssize_t n = PyList_GET_SIZE(list);
    if (n > 0)
        (void)PyList_SetSlice(list, n - 1, n, NULL);
}

/* Cut unlocked leaf `node` after its first `keep` tokens (structure.cut_leaf_tail without
   events): its tail slots go to `pending`. Every object is made before the first change, so a
   failure (-1) leaves the node, `pending` and `cut` as they were. Returns the tokens freed. */
static Py_ssize_t cut_tail(PyObject *node, PyObject *value, Py_ssize_t size, Py_ssize_t keep,
                           PyObject *pending, PyObject *cut)
{
    PyObject *key = PyObject_GetAttr(node, s_key);
    if (key == NULL)
        return -1;
    if (!PyBytes_Check(key) || PyBytes_GET_SIZE(key) / 8 < keep) {
        Py_DECREF(key);
        PyErr_SetString(PyExc_ValueError, "evict: a leaf's key is shorter than its slots");
        return -1;
    }
    PyObject *record = NULL, *tail = NULL, *head = NULL, *short_key = NULL;
    Py_ssize_t rc = -1;
    if (cut != Py_None) {
        PyObject *keys = PyObject_GetAttr(node, s_page_keys);
        record = keys == NULL ? NULL : PyTuple_Pack(4, node, value, key, keys);
        Py_XDECREF(keys);
        if (record == NULL)
            goto done;
    }
    tail = slice_of(value, keep, -1);
    head = tail == NULL ? NULL : slice_of(value, 0, keep);
    short_key = head == NULL ? NULL : PyBytes_FromStringAndSize(PyBytes_AS_STRING(key), keep * 8);
    if (short_key == NULL)
        goto done;
    if (record != NULL && PyList_Append(cut, record) < 0)
        goto done;
    if (PyList_Append(pending, tail) < 0) {
        if (record != NULL)
            drop_last(cut);
        goto done;
    }
    if (PyObject_SetAttr(node, s_value, head) < 0) {
        drop_last(pending);
        if (record != NULL)
            drop_last(cut);
        goto done;
    }
    if (PyObject_SetAttr(node, s_key, short_key) < 0) {
        PyObject *type, *exc, *tb;
        PyErr_Fetch(&type, &exc, &tb);
        (void)PyObject_SetAttr(node, s_value, value);
        PyErr_Restore(type, exc, tb);
        drop_last(pending);
        if (record != NULL)
            drop_last(cut);
        goto done;
    }
    rc = size - keep;
done:
    Py_XDECREF(record);
    Py_XDECREF(tail);
    Py_XDECREF(head);
    Py_XDECREF(short_key);
    Py_DECREF(key);
    return rc;
}

/* Results of remove_leaf. */
enum { LEAF_KEPT = -1, LEAF_GONE = 0, LEAF_GONE_THEN_FAILED = -2 };

/* structure.remove_leaf for a Full-only device tree without events, `node` being the heap's
   peeked top (`entry`): it leaves the heap, its slots go to `pending`, it leaves its parent,
   which becomes an evictable leaf (heap.push) when it is a non-root unlocked node left
   childless. LEAF_KEPT: failed with the node, heap and lists as they were. LEAF_GONE_THEN_FAILED:
   the node is out (count it), then the parent's heap.push raised (as the Python path leaves
   it: the push's own state). */
static int remove_leaf(PyObject *heap, PyObject *node, PyObject *entry, PyObject *value,
                       PyObject *root, Py_ssize_t pb, PyObject *no_children, PyObject *pending,
                       PyObject *removed)
{
    PyObject *parent = PyObject_GetAttr(node, s_parent);
    if (parent == NULL)
        return LEAF_KEPT;
    PyObject *key = NULL, *first = NULL, *dkey = NULL, *children = NULL, *record = NULL;
    int rc = LEAF_KEPT;
    if (parent == Py_None) {
        PyErr_SetString(PyExc_ValueError, "evict: a leaf in the heap has no parent");
        goto done;
    }
    key = PyObject_GetAttr(node, s_key);
    if (key == NULL)
        goto done;
    if (!PyBytes_Check(key) || PyBytes_GET_SIZE(key) < pb) {
        PyErr_SetString(PyExc_ValueError, "evict: a leaf's key is shorter than a page");
        goto done;
    }
    first = PyBytes_FromStringAndSize(PyBytes_AS_STRING(key), pb);
    if (first == NULL)
        goto done;
    if (parent == root) {
        PyObject *ns = PyObject_GetAttr(node, s_namespace);
        dkey = ns == NULL ? NULL : PyTuple_Pack(2, ns, first);
        Py_XDECREF(ns);
    } else {
        dkey = Py_NewRef(first);
    }
    if (dkey == NULL)
        goto done;
    children = PyObject_GetAttr(parent, s_children);
    if (children == NULL)
        goto done;
    if (removed != Py_None) {
        record = PyTuple_Pack(2, node, parent);
        if (record == NULL || PyList_Append(removed, record) < 0)
            goto done;
    }
    if (PyList_Append(pending, value) < 0) {
        if (removed != Py_None)
            drop_last(removed);
        goto done;
    }
    if (pop_peeked(heap, node, entry) < 0 || PyObject_DelItem(children, dkey) < 0) {
        /* Put back what was done (a failed heappop already lost the entry, as in Python). */
        drop_last(pending);
        if (removed != Py_None)
            drop_last(removed);
        PyObject *type, *exc, *tb;
        PyErr_Fetch(&type, &exc, &tb);
        PyObject *heap_entry = PyObject_GetAttr(node, s_heap_entry);
        if (heap_entry == Py_None) {
            PyObject *back = PyObject_CallMethod(heap, "put_back", "OO", node, entry);
            Py_XDECREF(back);
        }
        Py_XDECREF(heap_entry);
        PyErr_Clear();
        PyErr_Restore(type, exc, tb);
        goto done;
    }
    if (PyObject_SetAttr(node, s_parent, Py_None) < 0) {
        rc = LEAF_GONE_THEN_FAILED;
        goto done;
    }
    rc = LEAF_GONE;
    if (parent == root)
        goto done;
    Py_ssize_t left =
        PyDict_CheckExact(children) ? PyDict_GET_SIZE(children) : PyObject_Length(children);
    if (left < 0)
        rc = LEAF_GONE_THEN_FAILED;
    if (left != 0)
        goto done;
    if (PyObject_SetAttr(parent, s_children, no_children) < 0) {
        rc = LEAF_GONE_THEN_FAILED;
        goto done;
    }
    PyObject *locks = PyObject_GetAttr(parent, s_lock_ref);
    if (locks == NULL) {
        rc = LEAF_GONE_THEN_FAILED;
        goto done;
    }
    int unlocked = PyLong_Check(locks) && PyLong_AsLong(locks) == 0;
    Py_DECREF(locks);
    if (PyErr_Occurred()) {
        rc = LEAF_GONE_THEN_FAILED;
        goto done;
    }
    if (unlocked) {
        PyObject *pushed = PyObject_CallMethodOneArg(heap, s_push, parent);
        if (pushed == NULL)
            rc = LEAF_GONE_THEN_FAILED;
        Py_XDECREF(pushed);
    }
done:
    Py_XDECREF(record);
    Py_XDECREF(children);
    Py_XDECREF(dkey);
    Py_XDECREF(first);
    Py_XDECREF(key);
    Py_DECREF(parent);
    return rc;
}

/* The eviction target as a Py_ssize_t: a larger one frees everything anyway, so it is
   clamped (no OverflowError), a negative one frees nothing. */
static int clamp_amount(PyObject *obj, Py_ssize_t *out)
{
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (overflow > 0 || v > PY_SSIZE_T_MAX)
        v = PY_SSIZE_T_MAX;
    if (overflow < 0 || v < 0)
        v = 0;
    *out = (Py_ssize_t)v;
    return 0;
}

static void report(PyObject *progress, Py_ssize_t freed, Py_ssize_t gone)
{
    int64_t both[2] = {(int64_t)freed, (int64_t)gone};
    memcpy(PyByteArray_AS_STRING(progress), both, sizeof both);
}

static PyObject *evict(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "evict(heap, amount, page, page_bytes, root, "
                                         "no_children, pending, removed, cut, progress)");
        return NULL;
    }
    PyObject *heap = args[0], *root = args[4], *no_children = args[5], *pending = args[6];
    PyObject *removed = args[7], *cut = args[8], *progress = args[9];
    if (!PyByteArray_CheckExact(progress) || PyByteArray_GET_SIZE(progress) != 16) {
        PyErr_SetString(PyExc_TypeError, "evict: progress must be a bytearray of 16 bytes");
        return NULL;
    }
    report(progress, 0, 0);
    static const int which[] = {2, 3, -1};
    Py_ssize_t ints[2], amount;
    if (clamp_amount(args[1], &amount) < 0 || ssize_args(args, which, ints) < 0)
        return NULL;
    Py_ssize_t page = ints[0], pb = ints[1];
    if (page <= 0 || page > PY_SSIZE_T_MAX / 8 || pb != page * 8 || !PyList_CheckExact(pending) ||
        (removed != Py_None && !PyList_CheckExact(removed)) ||
        (cut != Py_None && !PyList_CheckExact(cut))) {
        PyErr_SetString(PyExc_ValueError, "evict: bad page size or record lists");
        return NULL;
    }
    Py_ssize_t freed = 0, gone = 0;
    while (freed < amount) {
        PyObject *entry = NULL;
        PyObject *node = peek(heap, &entry);
        if (node == NULL) {
            if (PyErr_Occurred())
                return NULL;
            break;
        }
        PyObject *value = PyObject_GetAttr(node, s_value);
        Py_ssize_t size = value == NULL ? -1 : PyObject_Length(value);
        if (size < 0) {
            Py_XDECREF(value);
            Py_DECREF(node);
            Py_DECREF(entry);
            return NULL;
        }
        /* Whole pages covering what is still wanted, without overflow: keep <= 0 takes the
           whole leaf. */
        Py_ssize_t need = amount - freed;
        Py_ssize_t pages = need / page + (need % page != 0);
        Py_ssize_t keep = pages > size / page ? 0 : size - pages * page;
        int failed = 0;
        if (keep > 0) {  /* page-granular: the leaf keeps its head and its heap entry */
            Py_ssize_t got = cut_tail(node, value, size, keep, pending, cut);
            if (got < 0)
                failed = 1;
            else
                freed += got;
        } else {
            int rc = remove_leaf(heap, node, entry, value, root, pb, no_children, pending,
                                 removed);
            if (rc != LEAF_KEPT) {
                freed += size;
                gone += 1;
            }
            failed = rc != LEAF_GONE;
        }
        Py_DECREF(value);
        Py_DECREF(node);
        Py_DECREF(entry);
        report(progress, freed, gone);
        if (failed)
            return NULL;
        if (keep > 0)
            break;
    }
    return Py_BuildValue("(nn)", freed, gone);
}

/* The lock count of `node` (a non-negative int attribute) into *out; -1 with an error set
   when it is not one. */
static int lock_count(PyObject *node, Py_ssize_t *out)
{
    PyObject *locks = PyObject_GetAttr(node, s_lock_ref);
    if (locks == NULL)
        return -1;
    Py_ssize_t v = PyLong_Check(locks) ? PyLong_AsSsize_t(locks) : -1;
    Py_DECREF(locks);
    if (v < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "lock: a node's lock_ref is not a count");
        return -1;
    }
    *out = v;
    return 0;
}

/* The node's parent (new reference; Py_None at the root). */
static PyObject *parent_of(PyObject *node)
{
    return PyObject_GetAttr(node, s_parent);
}

/* The top of `anchor`'s chain (new reference), every node below it checked for a lock count
   (with `positive`: above zero). On an unlock below zero: AssertionError naming the node. */
static PyObject *climb(PyObject *anchor, int positive)
{
    PyObject *node = Py_NewRef(anchor);
    for (;;) {
        PyObject *parent = parent_of(node);
        if (parent == NULL) {
            Py_DECREF(node);
            return NULL;
        }
        if (parent == Py_None) {
            Py_DECREF(parent);
            return node;
        }
        Py_ssize_t count;
        if (lock_count(node, &count) < 0) {
            Py_DECREF(parent);
            Py_DECREF(node);
            return NULL;
        }
        if (positive && count == 0) {
            PyObject *id = PyObject_GetAttr(node, s_id);
            if (id != NULL)
                PyErr_Format(PyExc_AssertionError,
                             "FullComponent: unlock below zero at node %S", id);
            Py_XDECREF(id);
            Py_DECREF(parent);
            Py_DECREF(node);
            return NULL;
        }
        Py_DECREF(node);
        node = parent;
    }
}

/* lock_path(anchor, root, members) -> tokens moved to protected, or None when anchor's chain
   does not end at `root` (nothing changed). FullComponent.lock of a Full-only device tree
   with locks.lock's root check first: each node below the root gets lock_ref + 1; one that
   was unlocked leaves the leaf heap (`members`, LeafHeap._members: LeafHeap.discard). */
static PyObject *lock_path(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyDict_CheckExact(args[2])) {
        PyErr_SetString(PyExc_TypeError, "lock_path(anchor, root, members: dict)");
        return NULL;
    }
    PyObject *root = args[1], *members = args[2];
    PyObject *top = climb(args[0], 0);
    if (top == NULL)
        return NULL;
    Py_DECREF(top);
    if (top != root)
        Py_RETURN_NONE;
    Py_ssize_t moved = 0;
    PyObject *node = Py_NewRef(args[0]);
    while (node != root) {
        Py_ssize_t count;
        PyObject *parent = NULL;
        if (lock_count(node, &count) < 0)
            goto fail;
        if (count == 0) {
            PyObject *value = PyObject_GetAttr(node, s_value);
            Py_ssize_t size = value == NULL ? -1 : PyObject_Length(value);
            Py_XDECREF(value);
            if (size < 0)
                goto fail;
            moved += size;
            PyObject *entry = PyObject_GetAttr(node, s_heap_entry);
            if (entry == NULL)
                goto fail;
            int listed = entry != Py_None;
            Py_DECREF(entry);
            if (listed) {
                PyObject *id = PyObject_GetAttr(node, s_id);
                int had = id == NULL ? -1 : PyDict_Contains(members, id);
                if (had > 0)
                    had = PyDict_DelItem(members, id) < 0 ? -1 : 1;
                Py_XDECREF(id);
                if (had < 0 || (had && PyObject_SetAttr(node, s_heap_entry, Py_None) < 0))
                    goto fail;
            }
        }
        PyObject *more = PyLong_FromSsize_t(count + 1);
        int rc = more == NULL ? -1 : PyObject_SetAttr(node, s_lock_ref, more);
        Py_XDECREF(more);
        if (rc < 0)
            goto fail;
        parent = parent_of(node);
        if (parent == NULL)
            goto fail;
        Py_DECREF(node);
        node = parent;
    }
    Py_DECREF(node);
    return PyLong_FromSsize_t(moved);
fail:
    Py_DECREF(node);
    return NULL;
}

/* unlock_path(anchor, heap) -> tokens moved back to evictable. FullComponent.unlock of a
   Full-only device tree: every lock count on the chain is checked above zero first
   (AssertionError, nothing changed), then each drops by one; a node left unlocked and
   childless joins the leaf heap (heap.push). */
static PyObject *unlock_path(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "unlock_path(anchor, heap)");
        return NULL;
    }
    PyObject *heap = args[1];
    PyObject *top = climb(args[0], 1);
    if (top == NULL)
        return NULL;
    Py_ssize_t moved = 0;
    PyObject *node = Py_NewRef(args[0]);
    while (node != top) {
        Py_ssize_t count;
        PyObject *parent = NULL;
        if (lock_count(node, &count) < 0)
            goto fail;
        PyObject *less = PyLong_FromSsize_t(count - 1);
        int rc = less == NULL ? -1 : PyObject_SetAttr(node, s_lock_ref, less);
        Py_XDECREF(less);
        if (rc < 0)
            goto fail;
        if (count == 1) {
            PyObject *value = PyObject_GetAttr(node, s_value);
            Py_ssize_t size = value == NULL ? -1 : PyObject_Length(value);
            Py_XDECREF(value);
            if (size < 0)
                goto fail;
            moved += size;
            PyObject *children = PyObject_GetAttr(node, s_children);
            int has = children == NULL ? -1 : PyObject_IsTrue(children);
            Py_XDECREF(children);
            if (has < 0)
                goto fail;
            if (!has) {
                PyObject *pushed = PyObject_CallMethodOneArg(heap, s_push, node);
                if (pushed == NULL)
                    goto fail;
                Py_DECREF(pushed);
            }
        }
        parent = parent_of(node);
        if (parent == NULL)
            goto fail;
        Py_DECREF(node);
        node = parent;
    }
    Py_DECREF(node);
    Py_DECREF(top);
    return PyLong_FromSsize_t(moved);
fail:
    Py_DECREF(node);
    Py_DECREF(top);
    return NULL;
}

static PyMethodDef methods[] = {
    {"walk", (PyCFunction)(void (*)(void))walk, METH_FASTCALL,
     "walk(root, page_bytes, namespace, data, end, split) -> (path, pos, partial)"},
    {"match", (PyCFunction)(void (*)(void))match, METH_FASTCALL,
     "match(root, page_bytes, namespace, data, end, split, tick) -> (path, pos, slots)"},
    {"check_slots", (PyCFunction)(void (*)(void))check_slots, METH_FASTCALL,
     "check_slots(slots, lo, hi, held, keep) -> bool"},
    {"evict", (PyCFunction)(void (*)(void))evict, METH_FASTCALL,
     "evict(heap, amount, page, page_bytes, root, no_children, pending, removed, cut, "
     "progress) -> (freed, nodes removed)"},
    {"lock_path", (PyCFunction)(void (*)(void))lock_path, METH_FASTCALL,
     "lock_path(anchor, root, members) -> tokens moved to protected, or None"},
    {"unlock_path", (PyCFunction)(void (*)(void))unlock_path, METH_FASTCALL,
     "unlock_path(anchor, heap) -> tokens moved back to evictable"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_kvstrata_radix_core", "Compiled walks of the radix tree.", -1,
    methods,
};

PyMODINIT_FUNC PyInit__kvstrata_radix_core(void)
{
    struct {
        PyObject **at;
        const char *name;
    } names[] = {
        {&s_children, "children"},   {&s_key, "key"},           {&s_value, "value"},
        {&s_last_access, "last_access"}, {&s_hit_count, "hit_count"}, {&s_heap, "_heap"},
        {&s_members, "_members"},    {&s_heap_entry, "heap_entry"}, {&s_parent, "parent"},
        {&s_namespace, "namespace"}, {&s_lock_ref, "lock_ref"}, {&s_push, "push"},
        {&s_page_keys, "page_keys"}, {&s_id, "id"},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        *names[i].at = PyUnicode_InternFromString(names[i].name);
        if (*names[i].at == NULL)
            return NULL;
    }
    PyObject *heapq = PyImport_ImportModule("heapq");
    if (heapq == NULL)
        return NULL;
    heappop = PyObject_GetAttrString(heapq, "heappop");
    Py_DECREF(heapq);
    if (heappop == NULL)
        return NULL;
    return PyModule_Create(&module);
}
