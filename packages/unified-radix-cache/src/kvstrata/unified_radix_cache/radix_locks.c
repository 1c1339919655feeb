/* Part 4 of the compiled radix core (after radix_core.c, radix_evict.c and radix_insert.c):
   the lock and unlock walks, the method table and the module init. */

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

/* node.lock_ref = count; -1 with an error set. */
static int set_lock_count(PyObject *node, Py_ssize_t count)
{
    PyObject *v = PyLong_FromSsize_t(count);
    int rc = v == NULL ? -1 : PyObject_SetAttr(node, s_lock_ref, v);
    Py_XDECREF(v);
    return rc;
}

/* len(node.value): the tokens a lock or unlock moves; -1 with an error set. */
static Py_ssize_t value_size(PyObject *node)
{
    PyObject *value = PyObject_GetAttr(node, s_value);
    Py_ssize_t size = value == NULL ? -1 : PyObject_Length(value);
    Py_XDECREF(value);
    return size;
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
        if (!positive && count == PY_SSIZE_T_MAX) {
            PyErr_SetString(PyExc_OverflowError, "lock: a node's lock count is at its maximum");
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

/* `node` leaves the leaf heap (LeafHeap.discard through `members`, LeafHeap._members) if it
   is listed; -1 with an error set. */
static int leave_heap(PyObject *node, PyObject *members)
{
    PyObject *entry = PyObject_GetAttr(node, s_heap_entry);
    if (entry == NULL)
        return -1;
    int listed = entry != Py_None;
    Py_DECREF(entry);
    if (!listed)
        return 0;
    PyObject *id = PyObject_GetAttr(node, s_id);
    int had = id == NULL ? -1 : PyDict_Contains(members, id);
    if (had > 0)
        had = PyDict_DelItem(members, id) < 0 ? -1 : 1;
    Py_XDECREF(id);
    if (had < 0 || (had && PyObject_SetAttr(node, s_heap_entry, Py_None) < 0))
        return -1;
    return 0;
}

/* `node` joins the leaf heap (heap.push) when it has no children; -1 with an error set. */
static int join_heap(PyObject *node, PyObject *heap)
{
    PyObject *children = PyObject_GetAttr(node, s_children);
    int has = children == NULL ? -1 : PyObject_IsTrue(children);
    Py_XDECREF(children);
    if (has != 0)
        return has < 0 ? -1 : 0;
    PyObject *pushed = PyObject_CallMethodOneArg(heap, s_push, node);
    if (pushed == NULL)
        return -1;
    Py_DECREF(pushed);
    return 0;
}

/* The walk lock_path and unlock_path share: from `anchor` up to `stop` (not included), each
   lock count moves by `delta` (+1 or -1); a node whose count leaves zero (lock) or reaches it
   (unlock) moves its tokens (the sum is returned) and leaves the leaf heap (`members`) or,
   childless, joins it (`heap`). The counts were checked first (climb). */
static PyObject *move_locks(PyObject *anchor, PyObject *stop, int delta, PyObject *members,
                            PyObject *heap)
{
    Py_ssize_t moved = 0;
    PyObject *node = Py_NewRef(anchor);
    while (node != stop) {
        Py_ssize_t count;
        if (lock_count(node, &count) < 0 || set_lock_count(node, count + delta) < 0)
            goto fail;
        if (count == (delta > 0 ? 0 : 1)) {
            Py_ssize_t size = value_size(node);
            if (size < 0 || (delta > 0 ? leave_heap(node, members) : join_heap(node, heap)) < 0)
                goto fail;
            moved += size;
        }
        PyObject *parent = parent_of(node);
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
    PyObject *root = args[1];
    PyObject *top = climb(args[0], 0);
    if (top == NULL)
        return NULL;
    Py_DECREF(top);
    if (top != root)
        Py_RETURN_NONE;
    return move_locks(args[0], root, 1, args[2], NULL);
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
    PyObject *top = climb(args[0], 1);
    if (top == NULL)
        return NULL;
    PyObject *moved = move_locks(args[0], top, -1, NULL, args[1]);
    Py_DECREF(top);
    return moved;
}

static PyMethodDef methods[] = {
    {"walk", (PyCFunction)(void (*)(void))walk, METH_FASTCALL,
     "walk(root, page_bytes, namespace, data, end, split) -> (path, pos, partial)"},
    {"match", (PyCFunction)(void (*)(void))match, METH_FASTCALL,
     "match(root, page_bytes, namespace, data, end, split, tick) -> (path, pos, slots)"},
    {"match_tiered", (PyCFunction)(void (*)(void))match_tiered, METH_FASTCALL,
     "match_tiered(root, page_bytes, namespace, data, end, split, tick) -> (path, on_device, "
     "host_bytes, slots)"},
    {"check_slots", (PyCFunction)(void (*)(void))check_slots, METH_FASTCALL,
     "check_slots(slots, lo, hi, held, keep) -> bool"},
    {"evict", (PyCFunction)(void (*)(void))evict, METH_FASTCALL,
     "evict(heap, amount, page, page_bytes, root, no_children, pending, removed, cut, "
     "progress, held) -> (freed, nodes removed, joined slots or None)"},
    {"drain", (PyCFunction)(void (*)(void))drain, METH_FASTCALL,
     "drain(pending, held) -> the pending slots joined (bytearray) or None"},
    {"lock_path", (PyCFunction)(void (*)(void))lock_path, METH_FASTCALL,
     "lock_path(anchor, root, members) -> tokens moved to protected, or None"},
    {"unlock_path", (PyCFunction)(void (*)(void))unlock_path, METH_FASTCALL,
     "unlock_path(anchor, heap) -> tokens moved back to evictable"},
    /* radix_insert.c */
    INSERT_METHODS
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
    if (insert_init() < 0)  /* radix_insert.c */
        return NULL;
    return PyModule_Create(&module);
}
