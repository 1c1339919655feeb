/* Part 3 of the compiled radix core (after radix_core.c and radix_evict.c, before
   radix_locks.c, which holds the method table and the module init): the insert of a Full-only
   tree with a host tier (HostWalks.insert_full) in one call.

    insert_tiered(tree, heap, checker, revive, node_type, no_children, namespace, data, end,
                  slots, cached_len, priority)
        -> (prefix_len, inserted_len, last_node, adopted, (), cached_len), or None
                                               HostWalks.insert_full of a Full-only tree of
                                               the exact classes without events: the walk
                                               without its split, the slot check
                                               (checker.check, before any change), the split
                                               (tree.split_node), one tick (tree._tick), per
                                               path node the access time and priority, an
                                               off-device one revived (revive(node, slots
                                               copy), checker.hold), then a new leaf
                                               (structure.add_leaf: node_type(...), sizes,
                                               heap.push, the held marks) or the end node
                                               re-keyed in `heap`. The six fields of its
                                               InsertResult come back. None: nothing changed
                                               and the caller runs the Python walk (events
                                               on, a revive inside the caller's cached
                                               prefix, a cached_len past the held prefix:
                                               the rare cases whose errors or marks the
                                               Python path words).

   Every step is the Python one, in the same order (the same callbacks at the same points), so
   an exception midway leaves what the Python path would leave. */

static PyObject *s_tick, *s_ids, *s_num_nodes, *s_inserted_tokens, *s_full, *s_evictable_size;
static PyObject *s_priority, *s_events, *s_last_walk, *s_split_node, *s_num_components;
static PyObject *s_root, *s_page_bytes_attr, *s_check, *s_hold, *s_table, *s_copy, *s_discard;

static int insert_init(void)
{
    struct {
        PyObject **at;
        const char *name;
    } names[] = {
        {&s_tick, "_tick"}, {&s_ids, "_ids"}, {&s_num_nodes, "num_nodes"},
        {&s_inserted_tokens, "inserted_tokens"}, {&s_full, "_full"},
        {&s_evictable_size, "evictable_size"}, {&s_priority, "priority"},
        {&s_events, "_events"}, {&s_last_walk, "_last_walk"}, {&s_split_node, "split_node"},
        {&s_num_components, "_num_components"}, {&s_root, "_root"},
        {&s_page_bytes_attr, "_page_bytes"}, {&s_check, "check"}, {&s_hold, "hold"},
        {&s_table, "table"}, {&s_copy, "copy"}, {&s_discard, "discard"},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        *names[i].at = PyUnicode_InternFromString(names[i].name);
        if (*names[i].at == NULL)
            return -1;
    }
    return 0;
}

/* obj.name as a Py_ssize_t; -1 with an error set when it is not an int. */
static int ssize_attr(PyObject *obj, PyObject *name, Py_ssize_t *out)
{
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL)
        return -1;
    *out = PyLong_AsSsize_t(v);
    Py_DECREF(v);
    return *out == -1 && PyErr_Occurred() ? -1 : 0;
}

/* obj.name += delta (ints); -1 with an error set. */
static int add_attr(PyObject *obj, PyObject *name, Py_ssize_t delta)
{
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL)
        return -1;
    PyObject *d = PyLong_FromSsize_t(delta);
    PyObject *sum = d == NULL ? NULL : PyNumber_Add(v, d);
    Py_DECREF(v);
    Py_XDECREF(d);
    if (sum == NULL)
        return -1;
    int rc = PyObject_SetAttr(obj, name, sum);
    Py_DECREF(sum);
    return rc;
}

/* len(node.value) (0: off the device); -1 with an error set. */
static Py_ssize_t value_len(PyObject *node)
{
    PyObject *value = PyObject_GetAttr(node, s_value);
    if (value == NULL)
        return -1;
    Py_ssize_t n = PyObject_Length(value);
    Py_DECREF(value);
    return n;
}

/* A copy of slots[lo:hi] (`slots[lo:hi].copy()`), new reference or NULL. */
static PyObject *slots_copy(PyObject *slots, Py_ssize_t lo, Py_ssize_t hi)
{
    PyObject *view = slice_of(slots, lo, hi);
    if (view == NULL)
        return NULL;
    PyObject *copy = PyObject_CallMethodNoArgs(view, s_copy);
    Py_DECREF(view);
    return copy;
}

/* checker.hold(value): each slot of int64 array `value` marked 1 in checker.table. Done here
   when the array is contiguous int64, apart from the table and inside it (always so after the
   check passed); otherwise through the method itself (which grows the table). */
static int hold(PyObject *checker, PyObject *value)
{
    PyObject *table = PyObject_GetAttr(checker, s_table);
    if (table == NULL)
        return -1;
    Py_buffer tv, sv;
    int done = 0;
    if (PyObject_GetBuffer(table, &tv, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0) {
        Py_DECREF(table);
        return -1;
    }
    if (tv.itemsize == 4 && tv.ndim == 1 &&
        PyObject_GetBuffer(value, &sv, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) == 0) {
        const char *a = (const char *)sv.buf, *b = (const char *)tv.buf;
        int apart = a + sv.len <= b || b + tv.len <= a;
        if (sv.itemsize == 8 && sv.ndim == 1 && apart) {
            const int64_t *s = (const int64_t *)sv.buf;
            Py_ssize_t n = sv.len / 8;
            int64_t rows = (int64_t)(tv.len / 4);
            Py_ssize_t i = 0;
            while (i < n && s[i] >= 0 && s[i] < rows)
                i++;
            if (i == n) {
                int32_t *held = (int32_t *)tv.buf;
                for (i = 0; i < n; i++)
                    held[s[i]] = 1;
                done = 1;
            }
        }
        PyBuffer_Release(&sv);
    }
    PyErr_Clear();  /* a value without a plain buffer: the method copes */
    PyBuffer_Release(&tv);
    Py_DECREF(table);
    if (done)
        return 0;
    PyObject *r = PyObject_CallMethodOneArg(checker, s_hold, value);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

/* The nodes of `path` (the walk's, split included) get the access time and priority; with
   `revives`, an off-device one takes a copy of its slots (revive, checker.hold) and its
   token range joins `adopted`. -1 with an error set. */
static int visit_path(PyObject *path, PyObject *tick, PyObject *priority, int revives,
                      PyObject *slots, PyObject *revive, PyObject *checker, PyObject *adopted)
{
    Py_ssize_t at = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(path); i++) {
        PyObject *node = PyList_GET_ITEM(path, i);
        if (PyObject_SetAttr(node, s_last_access, tick) < 0)
            return -1;
        PyObject *had = PyObject_GetAttr(node, s_priority);
        if (had == NULL)
            return -1;
        int more = PyObject_RichCompareBool(priority, had, Py_GT);
        Py_DECREF(had);
        if (more < 0 || (more && PyObject_SetAttr(node, s_priority, priority) < 0))
            return -1;
        Py_ssize_t n = key_len(node);
        if (n < 0)
            return -1;
        n /= 8;
        if (revives) {
            Py_ssize_t len = value_len(node);
            if (len < 0)
                return -1;
            if (len == 0) {
                PyObject *value = slots_copy(slots, at, at + n);
                if (value == NULL)
                    return -1;
                PyObject *r = PyObject_CallFunctionObjArgs(revive, node, value, NULL);
                Py_XDECREF(r);
                int rc = r == NULL || (checker != Py_None && hold(checker, value) < 0) ? -1 : 0;
                Py_DECREF(value);
                PyObject *range = rc < 0 ? NULL : Py_BuildValue("(nn)", at, at + n);
                if (range == NULL)
                    return -1;
                rc = PyList_Append(adopted, range);
                Py_DECREF(range);
                if (rc < 0)
                    return -1;
            }
        }
        at += n;
    }
    return 0;
}

/* structure.add_leaf (events off): a new on-device leaf under `parent` for data[pos:end]
   with a copy of its slots, marked held. New reference, or NULL. */
static PyObject *add_leaf(PyObject *tree, PyObject *heap, PyObject *checker, PyObject *root,
                          PyObject *node_type, PyObject *no_children, PyObject *parent,
                          PyObject *ns, PyObject *data, Py_ssize_t pos, Py_ssize_t end,
                          Py_ssize_t pb, PyObject *slots, PyObject *tick, PyObject *priority)
{
    if (PyObject_SetAttr(tree, s_last_walk, Py_None) < 0)
        return NULL;
    PyObject *entry = PyObject_GetAttr(parent, s_heap_entry);
    if (entry == NULL)
        return NULL;
    int listed = entry != Py_None;
    Py_DECREF(entry);
    if (listed) {  /* no longer a leaf */
        PyObject *r = PyObject_CallMethodOneArg(heap, s_discard, parent);
        if (r == NULL)
            return NULL;
        Py_DECREF(r);
    }
    if (add_attr(tree, s_num_nodes, 1) < 0)
        return NULL;
    PyObject *ids = PyObject_GetAttr(tree, s_ids);
    if (ids == NULL)
        return NULL;
    PyObject *id = PyIter_Next(ids);
    Py_DECREF(ids);
    if (id == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetNone(PyExc_StopIteration);
        return NULL;
    }
    const char *d = PyBytes_AS_STRING(data);
    PyObject *key = PyBytes_FromStringAndSize(d + pos, end - pos);
    PyObject *value = key == NULL ? NULL : slots_copy(slots, pos / 8, end / 8);
    PyObject *count = value == NULL ? NULL : PyObject_GetAttr(tree, s_num_components);
    PyObject *leaf = count == NULL ? NULL
                                   : PyObject_CallFunctionObjArgs(node_type, id, key, value,
                                                                  parent, ns, tick, count, NULL);
    Py_DECREF(id);
    Py_XDECREF(key);
    Py_XDECREF(count);
    if (leaf == NULL) {
        Py_XDECREF(value);
        return NULL;
    }
    int rc = PyObject_SetAttr(leaf, s_priority, priority);
    if (rc == 0 && checker != Py_None)
        rc = hold(checker, value);
    Py_DECREF(value);
    if (rc < 0)
        goto fail;
    PyObject *first = PyBytes_FromStringAndSize(d + pos, pb);
    PyObject *link = first == NULL || parent != root ? first : PyTuple_Pack(2, ns, first);
    if (link != first)
        Py_DECREF(first);
    if (link == NULL)
        goto fail;
    PyObject *children = PyObject_GetAttr(parent, s_children);
    if (children != NULL && children == no_children) {
        Py_DECREF(children);
        children = PyDict_New();
        if (children != NULL && PyObject_SetAttr(parent, s_children, children) < 0)
            Py_CLEAR(children);
    }
    rc = children == NULL ? -1 : PyObject_SetItem(children, link, leaf);
    Py_XDECREF(children);
    Py_DECREF(link);
    if (rc < 0)
        goto fail;
    PyObject *full = PyObject_GetAttr(tree, s_full);
    Py_ssize_t size = (end - pos) / 8;
    rc = full == NULL ? -1 : add_attr(full, s_evictable_size, size);
    Py_XDECREF(full);
    if (rc < 0 || add_attr(tree, s_inserted_tokens, size) < 0)
        goto fail;
    PyObject *pushed = PyObject_CallMethodOneArg(heap, s_push, leaf);
    if (pushed == NULL)
        goto fail;
    Py_DECREF(pushed);
    return leaf;
fail:
    Py_DECREF(leaf);
    return NULL;
}

/* `node` re-keyed in `heap` when it is a member (`node in heap`: LeafHeap._members). */
static int rekey(PyObject *heap, PyObject *node)
{
    PyObject *members = PyObject_GetAttr(heap, s_members);
    PyObject *id = members == NULL ? NULL : PyObject_GetAttr(node, s_id);
    int in = id == NULL ? -1 : PySequence_Contains(members, id);
    Py_XDECREF(id);
    Py_XDECREF(members);
    if (in <= 0)
        return in;
    PyObject *r = PyObject_CallMethodOneArg(heap, s_push, node);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

enum { I_TREE, I_HEAP, I_CHECKER, I_REVIVE, I_TYPE, I_NO_CHILDREN, I_NS, I_DATA, I_END,
       I_SLOTS, I_CACHED, I_PRIORITY, I_COUNT };

static PyObject *insert_tiered(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != I_COUNT) {
        PyErr_SetString(PyExc_TypeError,
                        "insert_tiered(tree, heap, checker, revive, node_type, no_children, "
                        "namespace, data, end, slots, cached_len, priority)");
        return NULL;
    }
    static const int ints[] = {I_END, I_CACHED, -1};
    Py_ssize_t iv[2], pb, pos, partial;
    if (ssize_args(args, ints, iv) < 0)
        return NULL;
    Py_ssize_t end = iv[0], cached_len = iv[1];
    PyObject *tree = args[I_TREE], *heap = args[I_HEAP], *checker = args[I_CHECKER];
    PyObject *ns = args[I_NS], *data = args[I_DATA], *slots = args[I_SLOTS];
    PyObject *priority = args[I_PRIORITY];
    if (!PyLong_Check(priority)) {
        PyErr_SetString(PyExc_TypeError, "insert_tiered: priority must be an int");
        return NULL;
    }
    PyObject *events = PyObject_GetAttr(tree, s_events);
    if (events == NULL)
        return NULL;
    Py_DECREF(events);
    if (events != Py_None)  /* events: the Python walk queues them */
        Py_RETURN_NONE;
    if (ssize_attr(tree, s_page_bytes_attr, &pb) < 0)
        return NULL;
    PyObject *root = PyObject_GetAttr(tree, s_root);
    if (root == NULL)
        return NULL;
    PyObject *result = NULL, *child = NULL, *tick = NULL, *adopted = NULL, *last = NULL;
    PyObject *path = descend(root, pb, ns, data, end, Py_None, &pos, &partial);
    if (path == NULL)
        goto done;
    Py_ssize_t n = PyList_GET_SIZE(path);
    PyObject *parent = n ? PyList_GET_ITEM(path, n - 1) : root;
    if (partial) {
        PyObject *first = PyBytes_FromStringAndSize(PyBytes_AS_STRING(data) + pos, pb);
        PyObject *link = first == NULL || parent != root ? first : PyTuple_Pack(2, ns, first);
        if (link != first)
            Py_DECREF(first);
        PyObject *children = link == NULL ? NULL : PyObject_GetAttr(parent, s_children);
        child = children == NULL ? NULL : PyObject_GetItem(children, link);
        Py_XDECREF(children);
        Py_XDECREF(link);
        if (child == NULL)
            goto done;
    }
    /* Device values are prefix-closed: only the tail of the walk can be off the device. */
    int revives = 0;
    if (n) {
        Py_ssize_t len = value_len(parent);
        if (len < 0)
            goto done;
        revives = len == 0;
    }
    if (!revives && child != NULL) {
        Py_ssize_t len = value_len(child);
        if (len < 0)
            goto done;
        revives = len == 0;
    }
    Py_ssize_t held = (pos + partial) / 8, hi = end / 8;
    Py_ssize_t lo = revives ? cached_len : (cached_len > held ? cached_len : held);
    if ((revives && cached_len) || (!revives && pos + partial < end && lo > held)) {
        result = Py_NewRef(Py_None);  /* the Python walk words these (or refuses them) */
        goto done;
    }
    if (checker != Py_None) {
        PyObject *check = PyObject_GetAttr(checker, s_check);
        PyObject *a = check == NULL ? NULL : PyLong_FromSsize_t(lo);
        PyObject *b = a == NULL ? NULL : PyLong_FromSsize_t(hi);
        PyObject *r = b == NULL ? NULL : PyObject_CallFunctionObjArgs(check, slots, a, b, NULL);
        Py_XDECREF(check);
        Py_XDECREF(a);
        Py_XDECREF(b);
        if (r == NULL)
            goto done;
        Py_DECREF(r);
    }
    if (child != NULL) {
        PyObject *split = PyObject_GetAttr(tree, s_split_node);
        PyObject *tokens = split == NULL ? NULL : PyLong_FromSsize_t(partial / 8);
        PyObject *upper =
            tokens == NULL ? NULL : PyObject_CallFunctionObjArgs(split, child, tokens, NULL);
        Py_XDECREF(split);
        Py_XDECREF(tokens);
        int rc = upper == NULL ? -1 : PyList_Append(path, upper);
        Py_XDECREF(upper);
        if (rc < 0)
            goto done;
        pos += partial;
    }
    Py_ssize_t now;
    if (ssize_attr(tree, s_tick, &now) < 0 || (tick = PyLong_FromSsize_t(now + 1)) == NULL ||
        PyObject_SetAttr(tree, s_tick, tick) < 0)
        goto done;
    adopted = PyList_New(0);
    if (adopted == NULL || visit_path(path, tick, priority, revives, slots, args[I_REVIVE],
                                      checker, adopted) < 0)
        goto done;
    n = PyList_GET_SIZE(path);
    PyObject *node = n ? PyList_GET_ITEM(path, n - 1) : root;
    Py_ssize_t inserted = 0;
    if (pos < end) {
        last = add_leaf(tree, heap, checker, root, args[I_TYPE], args[I_NO_CHILDREN], node, ns,
                        data, pos, end, pb, slots, tick, priority);
        if (last == NULL)
            goto done;
        inserted = (end - pos) / 8;
    } else {
        if (rekey(heap, node) < 0)
            goto done;
        last = Py_NewRef(node);
    }
    PyObject *ranges = PyList_AsTuple(adopted);
    if (ranges != NULL)
        result = Py_BuildValue("(nnOO()n)", pos / 8, inserted, last, ranges, cached_len);
    Py_XDECREF(ranges);
done:
    Py_XDECREF(last);
    Py_XDECREF(adopted);
    Py_XDECREF(tick);
    Py_XDECREF(child);
    Py_XDECREF(path);
    Py_DECREF(root);
    return result;
}

/* The method table entry of this part (radix_locks.c lists it). */
#define INSERT_METHODS                                                                        \
    {"insert_tiered", (PyCFunction)(void (*)(void))insert_tiered, METH_FASTCALL,              \
     "insert_tiered(tree, heap, checker, revive, node_type, no_children, namespace, data, "   \
     "end, slots, cached_len, priority) -> InsertResult fields, or None"},
