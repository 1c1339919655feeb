/* Part 2 of the compiled radix core (native_core.py joins radix_core.c, radix_evict.c,
   radix_insert.c and radix_locks.c, in that order, into one C file): the leaf heap and Full's eviction loop. */

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

/* drain(pending, held): FullComponent.flush's array work. The slots of every array in list
   `pending` (1-D, 8-byte items) joined into one new bytearray (None when there are none), the
   list emptied; with `held` (a writable 1-D int32 buffer, or None) each slot inside its range
   is cleared there. Every buffer is checked before anything changes: a bad one raises with
   `pending` and `held` as they were. */
static PyObject *drain_pending(PyObject *pending, PyObject *held_obj)
{
    if (!PyList_CheckExact(pending)) {
        PyErr_SetString(PyExc_TypeError, "drain: pending must be a list");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(pending);
    if (n == 0)
        Py_RETURN_NONE;
    Py_buffer hv;
    int has_held = held_obj != Py_None;
    if (has_held && get_buffer(held_obj, &hv, 4, 1) < 0)
        return NULL;
    Py_buffer *views = PyMem_Calloc((size_t)n, sizeof(Py_buffer));
    PyObject *items = PyList_GetSlice(pending, 0, n);  /* holds the arrays while read */
    PyObject *out = NULL;
    Py_ssize_t got = 0, total = 0;
    if (views == NULL || items == NULL) {
        if (views == NULL)
            PyErr_NoMemory();
        goto done;
    }
    for (; got < n; got++) {
        if (get_buffer(PyList_GET_ITEM(items, got), &views[got], 8, 0) < 0)
            goto done;
        const char *f = views[got].format;
        if (f == NULL ||
            (strcmp(f, "l") && strcmp(f, "q") && strcmp(f, "<q") && strcmp(f, "=q"))) {
            PyBuffer_Release(&views[got]);
            PyErr_SetString(PyExc_ValueError, "drain: pending slots must be int64");
            goto done;
        }
        total += views[got].len;
    }
    if (total == 0) {
        out = Py_NewRef(Py_None);
    } else {
        out = PyByteArray_FromStringAndSize(NULL, total);
        if (out == NULL)
            goto done;
        char *at = PyByteArray_AS_STRING(out);
        for (Py_ssize_t i = 0; i < n; i++) {
            memcpy(at, views[i].buf, (size_t)views[i].len);
            at += views[i].len;
        }
    }
    if (PyList_SetSlice(pending, 0, n, NULL) < 0) {
        Py_CLEAR(out);
        goto done;
    }
    if (has_held && total) {
        const int64_t *s = (const int64_t *)PyByteArray_AS_STRING(out);
        int32_t *held = (int32_t *)hv.buf;
        int64_t rows = (int64_t)(hv.len / 4);
        for (Py_ssize_t i = 0; i < total / 8; i++) {
            if (s[i] >= 0 && s[i] < rows)  /* one past the table was never marked */
                held[s[i]] = 0;
        }
    }
done:
    for (Py_ssize_t i = 0; i < got; i++)
        PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    Py_XDECREF(items);
    if (has_held)
        PyBuffer_Release(&hv);
    return out;
}

static PyObject *drain(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "drain(pending, held)");
        return NULL;
    }
    return drain_pending(args[0], args[1]);
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

/* evict(heap, amount, page, page_bytes, root, no_children, pending, removed, cut, progress,
   held) -> (freed, gone, joined): FullComponent._evict's loop (see native_core.py). Unless
   `held` is False, `pending` is then drained as `drain(pending, held)` does (`held`: the held
   flags or None) and `joined` is what that returns; None otherwise. A drain that raises
   leaves `pending` as it was, the counts in `progress`. */
static PyObject *evict(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 11) {
        PyErr_SetString(PyExc_TypeError, "evict(heap, amount, page, page_bytes, root, "
                                         "no_children, pending, removed, cut, progress, held)");
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
    if (args[10] == Py_False)
        return Py_BuildValue("(nnO)", freed, gone, Py_None);
    PyObject *joined = drain_pending(pending, args[10]);
    if (joined == NULL)
        return NULL;
    return Py_BuildValue("(nnN)", freed, gone, joined);
}
