/* The last part of the index module (after index_core.c and index_convert.c: native.py
   compiles the three as one source, an extension module of this interpreter): the Python type
   `Core` that PrefixIndex calls. One call serves a whole event batch (`apply`) or a whole
   lookup (`find_matches`, `lengths`): the keys are read straight from the bytes objects
   (PyBytes_AS_STRING), the events and instance name are validated before any change, with the
   exceptions and messages of the Python core, and the results are built in C as the
   PrefixMatches / InstanceMatch tuples the Python core returns. Calls hold the GIL. */

static int put_name(CoreObject *c, long iid, PyObject *name);

/* apply(instance, events): PrefixIndex.apply. Validates the instance name and every event
   (raising, before any change, InvalidInstance / InvalidEvent as the Python core does); a name
   with no id yet is interned (`intern(name) -> id`, whose name this core then records; the
   events are validated again after it: the callback may run any Python code); then the batch
   is applied in one go. MemoryError when memory runs out mid-batch (applied in part, every
   structure consistent). */
static PyObject *Core_apply_body(CoreObject *c, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "apply(instance, events)");
        return NULL;
    }
    PyObject *instance = args[0];
    if (check_instance(c, instance)) return NULL;
    /* A tuple of the events, never the caller's list: reading an event's attributes, the
       instance name's hash or `intern` may run Python code that changes that list, and the
       loop below holds pointers to its items (a list shrunk under it was a use after free). */
    PyObject *seq = PyTuple_CheckExact(args[1]) ? Py_NewRef(args[1]) : PySequence_Tuple(args[1]);
    if (!seq) return NULL;
    ix_t *x = c->x;
    Py_ssize_t ne = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *result = NULL;
    if (3 * ne > c->spec_cap) {
        Py_ssize_t cap = 2 * 3 * ne;
        int64_t *spec = (int64_t *)PyMem_Realloc(c->spec, (size_t)cap * sizeof(int64_t));
        if (!spec) {
            PyErr_NoMemory();
            goto done;
        }
        c->spec = spec;
        c->spec_cap = cap;
    }
    int interned = 0;
again:;
    int64_t keys = 0;
    for (Py_ssize_t i = 0; i < ne; i++) {
        if (take_event(c, items[i], c->spec + 3 * i, keys)) goto done;
        keys += c->spec[3 * i + 2];
    }
    PyObject *id = PyDict_GetItemWithError(c->ids, instance);
    if (!id) {
        if (PyErr_Occurred()) goto done;
        if (interned || !c->intern) {
            PyErr_Format(PyExc_LookupError, "instance %R has no id", instance);
            goto done;
        }
        PyObject *got = PyObject_CallOneArg(c->intern, instance);
        if (!got) goto done;
        long gid = iid_arg(got);
        Py_DECREF(got);
        /* The name is recorded here, not by a set_name call from the callback: this call
           holds the guard, which set_name would refuse. */
        if (gid < 0 || put_name(c, gid, instance)) goto done;
        interned = 1;
        goto again;
    }
    long iid = PyLong_AsLong(id);
    if (iid < 0 || iid >= MAX_IID) {
        if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "instance id %ld out of range", iid);
        goto done;
    }
    if (ne && ix_apply(x, iid, c->spec, ne, x->gathered) < 0) {
        PyErr_NoMemory();
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    shrink(x);
    Py_DECREF(seq);
    return result;
}

/* The PrefixMatches of `query`, a list / tuple: its keys up to the first that is no bytes of
   key_len (no entry can have it) are matched; num_pages is its length, as in the Python core. */
static PyObject *find_keys(CoreObject *c, PyObject *query) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(query);
    ix_t *x = c->x;
    int64_t m = gather_prefix(x, PySequence_Fast_ITEMS(query), n);
    int64_t got = m > 0 ? run_match(x, m, 1) : m;
    shrink(x);
    return got < 0 ? NULL : matches(c, n, got);
}

/* find_matches(query, *, extra_key=None, cache_salt=None): PrefixIndex.find_matches. A list /
   tuple that is empty or opens with a bytes object is page keys; anything else is token ids,
   keyed by `as_keys` (the index's keyer, in the namespace given). */
static PyObject *Core_find_matches_body(CoreObject *c, PyObject *const *args, Py_ssize_t nargs,
                                   PyObject *kwnames) {
    PyObject *extra_key = Py_None, *cache_salt = Py_None;
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    if (nargs != 1) {
        PyErr_SetString(PyExc_TypeError, "find_matches(query, *, extra_key=None, cache_salt=None)");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < nkw; i++) {
        PyObject *k = PyTuple_GET_ITEM(kwnames, i);
        if (PyUnicode_Compare(k, s_extra_key) == 0) extra_key = args[1 + i];
        else if (PyUnicode_Compare(k, s_cache_salt) == 0) cache_salt = args[1 + i];
        else {
            PyErr_Format(PyExc_TypeError, "find_matches() got an unexpected keyword argument %R", k);
            return NULL;
        }
    }
    PyObject *query = args[0];
    if ((PyList_Check(query) || PyTuple_Check(query)) &&
        (!PySequence_Fast_GET_SIZE(query) || PyBytes_Check(PySequence_Fast_ITEMS(query)[0])))
        return find_keys(c, query);
    if (!c->as_keys) {
        PyErr_SetString(PyExc_TypeError, "this core keys no token ids: pass page keys");
        return NULL;
    }
    PyObject *keys = PyObject_CallFunctionObjArgs(c->as_keys, query, extra_key, cache_salt, NULL);
    if (!keys) return NULL;
    PyObject *out = NULL;
    if (PyList_Check(keys) || PyTuple_Check(keys)) out = find_keys(c, keys);
    else PyErr_SetString(PyExc_TypeError, "as_keys must return a list or tuple of page keys");
    Py_DECREF(keys);
    return out;
}

/* lengths(keys) -> {name: pages matched}: the routing lookup, no tiers. */
static PyObject *Core_lengths_body(CoreObject *c, PyObject *keys) {
    PyObject *seq = PySequence_Fast(keys, "page keys must be a sequence");
    if (!seq) return NULL;
    ix_t *x = c->x;
    int64_t m = gather_prefix(x, PySequence_Fast_ITEMS(seq), PySequence_Fast_GET_SIZE(seq));
    Py_DECREF(seq);
    int64_t got = m > 0 ? run_match(x, m, 0) : m;
    shrink(x);
    if (got < 0) return NULL;
    PyObject *out = PyDict_New();
    for (int64_t j = 0; out && j < got; j++) {
        PyObject *name = name_of(c, x->res[3 * j]);
        PyObject *run = name ? PyLong_FromLong(x->res[3 * j + 1]) : NULL;
        if (!run || PyDict_SetItem(out, name, run)) Py_CLEAR(out);
        Py_XDECREF(run);
        Py_XDECREF(name);
    }
    return out;
}

/* Record `name` (NULL or None: none, the id is free) as instance `iid`'s; 0, or -1 with
   MemoryError set. The old name is released last: its finalizer may run Python code. */
static int put_name(CoreObject *c, long iid, PyObject *name) {
    if (iid >= c->names_cap) {
        Py_ssize_t cap = c->names_cap ? c->names_cap : 16;
        while (cap <= iid) cap *= 2;
        PyObject **names = (PyObject **)PyMem_Realloc(c->names, (size_t)cap * sizeof(PyObject *));
        if (!names) {
            PyErr_NoMemory();
            return -1;
        }
        memset(names + c->names_cap, 0, (size_t)(cap - c->names_cap) * sizeof(PyObject *));
        c->names = names;
        c->names_cap = cap;
    }
    PyObject *old = c->names[iid];
    c->names[iid] = name == NULL || name == Py_None ? NULL : Py_NewRef(name);
    Py_XDECREF(old);
    return 0;
}

/* set_name(id, name | None): the name results give instance `id` (None: the id is free). */
static PyObject *Core_set_name_body(CoreObject *c, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "set_name(id, name)");
        return NULL;
    }
    long iid = iid_arg(args[0]);
    if (iid < 0) return NULL;
    if (args[1] != Py_None && check_instance(c, args[1])) return NULL;
    if (put_name(c, iid, args[1])) return NULL;
    Py_RETURN_NONE;
}

/* drop(id) -> keys it held: every key of instance `id` goes. */
static PyObject *Core_drop_body(CoreObject *c, PyObject *arg) {
    long iid = iid_arg(arg);
    if (iid < 0) return NULL;
    return PyLong_FromLongLong(clear(c->x, (uint32_t)iid, (uint32_t)c->x->all_tiers));
}

/* holdings(id) -> [(key, tier bits)] of instance `id`. */
static PyObject *Core_holdings_body(CoreObject *c, PyObject *arg) {
    long iid = iid_arg(arg);
    if (iid < 0) return NULL;
    ix_t *x = c->x;
    int64_t held = ix_held(x, iid);
    PyObject *out = PyList_New((Py_ssize_t)held);
    for (int64_t p = 0; out && p < held; p++) {
        entry_t *e = &x->E[x->I[iid].k[p]];
        holder_t *h = holders(e);
        PyObject *pair = Py_BuildValue("(y#I)", (const char *)e->key, (Py_ssize_t)x->key_len,
                                       (unsigned)h[lower(h, e->n, (uint32_t)iid)].tiers);
        if (!pair) Py_CLEAR(out);
        else PyList_SET_ITEM(out, p, pair);
    }
    return out;
}

/* stats() -> (entries, pairs, evicted entries, bytes allocated by the C side). Unguarded,
   like check(): both read the structures and run no Python code before they are done. */
static PyObject *Core_stats(CoreObject *c, PyObject *Py_UNUSED(ignored)) {
    int64_t s[4];
    ix_stats(c->x, s);
    s[3] += (int64_t)sizeof(CoreObject) + c->names_cap * (int64_t)sizeof(PyObject *) +
            c->spec_cap * 8 + PyTuple_GET_SIZE(c->rank) * UNIFORM_RUNS * (int64_t)sizeof(PyObject *);
    return Py_BuildValue("(LLLL)", (long long)s[0], (long long)s[1], (long long)s[2],
                         (long long)s[3]);
}

/* check() -> 0 when every invariant of the C structures holds, else the first broken one. */
static PyObject *Core_check(CoreObject *c, PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromLongLong(ix_check(c->x));
}

/* hashes(keys) -> [64-bit hash of each key] (tests: keys whose slot bits collide). */
static PyObject *Core_hashes_body(CoreObject *c, PyObject *keys) {
    ix_t *x = c->x;
    int64_t n = gather_all(x, keys);
    if (n < 0) return NULL;
    PyObject *out = PyList_New((Py_ssize_t)n);
    for (int64_t i = 0; out && i < n; i++) {
        PyObject *h = PyLong_FromUnsignedLongLong(key_hash(x, x->gathered + i * x->key_len));
        if (!h) Py_CLEAR(out);
        else PyList_SET_ITEM(out, i, h);
    }
    shrink(x);
    return out;
}

/* match_count(keys) -> instances matched: the lookup without names or result objects
   (opstream.native_floor: what the index cannot go below). */
static PyObject *Core_match_count_body(CoreObject *c, PyObject *keys) {
    int64_t n = gather_all(c->x, keys);
    int64_t got = n > 0 ? run_match(c->x, n, 1) : n;
    shrink(c->x);
    return got < 0 ? NULL : PyLong_FromLongLong(got);
}

/* apply_keys(id, kind, bits, keys): one store (kind 0) or removal (1) of `keys` on tier `bits`
   for instance `id`, without events or names (opstream.native_floor). */
static PyObject *Core_apply_keys_body(CoreObject *c, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "apply_keys(id, kind, bits, keys)");
        return NULL;
    }
    ix_t *x = c->x;
    long iid = iid_arg(args[0]);
    if (iid < 0) return NULL;
    long kind = PyLong_AsLong(args[1]), bits = PyLong_AsLong(args[2]);
    if (PyErr_Occurred()) return NULL;
    if ((kind != 0 && kind != 1) || bits <= 0 || (bits & ~x->all_tiers)) {
        PyErr_Format(PyExc_ValueError, "kind 0 or 1 and tier bits in %lld, got %ld, %ld",
                     (long long)x->all_tiers, kind, bits);
        return NULL;
    }
    int64_t n = gather_all(x, args[3]);
    if (n < 0) return NULL;
    int64_t spec[3] = {kind, bits, n};
    int64_t rc = ix_apply(x, iid, spec, 1, x->gathered);
    shrink(x);
    if (rc < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* fail_allocation(after) -> the setting replaced: tests only; the C allocation after `after`
   more that succeed fails, once (-1: none). One setting for the whole process. */
static PyObject *Core_fail_allocation(CoreObject *Py_UNUSED(c), PyObject *arg) {
    long long after = PyLong_AsLongLong(arg);
    if (after == -1 && PyErr_Occurred()) return NULL;
    int64_t was = fail_after;
    fail_after = after < 0 ? -1 : after;
    return PyLong_FromLongLong(was);
}

/* The re-entry guard. Python code can run in the middle of a call (an event subclass's
   attribute, a key's or name's __hash__ / __eq__, the interning or keying callback, a finalizer
   run by the garbage collector at any allocation), and a nested call would move the scratch
   buffers (keys gathered, event specs, match output) or the table under the outer one. So one
   call at a time, and a call made inside another raises ReentrantCall (`reentered`) before it
   changes anything, whatever the call:

     FREE     no call is running
     IN_CALL  a method of this type is running
     HELD     the PrefixIndex holds the core (`hold()` .. `release()`) for one of its own
              methods, which makes several calls (drop, set_name, apply_held...) and changes
              its Python state in between: a finalizer run there must not get in either

   The index's public methods (apply, find_matches, lengths, also hashes, match_count and
   apply_keys) run only when FREE; the ones the index calls while it holds the core
   (set_name, drop, holdings) run when FREE or HELD; apply_held only when HELD. stats and
   check take no guard (they read, and run no Python code until they have read). */
enum { FREE = 0, IN_CALL = 1, HELD = 2 };

static PyObject *refuse(CoreObject *c) {
    PyErr_SetNone(c->reentered);
    return NULL;
}

/* A public call: only when no call runs. */
#define GUARD(call) \
    if (c->busy != FREE) return refuse(c); \
    c->busy = IN_CALL; \
    PyObject *out = call; \
    c->busy = FREE; \
    return out;

/* A call the index makes while it holds the core (or anyone makes when no call runs). */
#define INNER(call) \
    int was = c->busy; \
    if (was == IN_CALL) return refuse(c); \
    c->busy = IN_CALL; \
    PyObject *out = call; \
    c->busy = was; \
    return out;

static PyObject *Core_apply(CoreObject *c, PyObject *const *args, Py_ssize_t nargs) {
    GUARD(Core_apply_body(c, args, nargs))
}
static PyObject *Core_find_matches(CoreObject *c, PyObject *const *args, Py_ssize_t nargs,
                                   PyObject *kwnames) {
    GUARD(Core_find_matches_body(c, args, nargs, kwnames))
}
static PyObject *Core_lengths(CoreObject *c, PyObject *keys) { GUARD(Core_lengths_body(c, keys)) }
static PyObject *Core_hashes(CoreObject *c, PyObject *keys) { GUARD(Core_hashes_body(c, keys)) }
static PyObject *Core_match_count(CoreObject *c, PyObject *keys) {
    GUARD(Core_match_count_body(c, keys))
}
static PyObject *Core_apply_keys(CoreObject *c, PyObject *const *args, Py_ssize_t nargs) {
    GUARD(Core_apply_keys_body(c, args, nargs))
}
static PyObject *Core_set_name(CoreObject *c, PyObject *const *args, Py_ssize_t nargs) {
    INNER(Core_set_name_body(c, args, nargs))
}
static PyObject *Core_drop(CoreObject *c, PyObject *arg) { INNER(Core_drop_body(c, arg)) }
static PyObject *Core_holdings(CoreObject *c, PyObject *arg) { INNER(Core_holdings_body(c, arg)) }

/* hold(): the index's method that calls takes the core (ReentrantCall if any call runs). */
static PyObject *Core_hold(CoreObject *c, PyObject *Py_UNUSED(ignored)) {
    if (c->busy != FREE) return refuse(c);
    c->busy = HELD;
    Py_RETURN_NONE;
}

/* release(): the end of hold(). */
static PyObject *Core_release(CoreObject *c, PyObject *Py_UNUSED(ignored)) {
    if (c->busy != HELD) {
        PyErr_SetString(PyExc_RuntimeError, "release() without hold()");
        return NULL;
    }
    c->busy = FREE;
    Py_RETURN_NONE;
}

/* __exit__(type, value, traceback): release(); `with core:` is hold() .. release(). */
static PyObject *Core_exit(CoreObject *c, PyObject *const *Py_UNUSED(args),
                           Py_ssize_t Py_UNUSED(nargs)) {
    return Core_release(c, NULL);
}

/* apply_held(instance, events): apply, from a method of the index that holds the core
   (load_dump, apply_sequenced, apply_engine_batch). */
static PyObject *Core_apply_held(CoreObject *c, PyObject *const *args, Py_ssize_t nargs) {
    if (c->busy == IN_CALL) return refuse(c);
    if (c->busy != HELD) {
        PyErr_SetString(PyExc_RuntimeError, "apply_held() outside hold()");
        return NULL;
    }
    c->busy = IN_CALL;
    PyObject *out = Core_apply_body(c, args, nargs);
    c->busy = HELD;
    return out;
}

static int named_tuple_type(PyTypeObject *t) {
    return PyType_IsSubtype(t, &PyTuple_Type) && t->tp_basicsize == PyTuple_Type.tp_basicsize &&
           t->tp_itemsize == PyTuple_Type.tp_itemsize && !t->tp_dictoffset;
}

/* Core(key_len, page_size, max_entries, tier_bit, rank, known, ids,
        (BlockStored, BlockRemoved, AllBlocksCleared, PrefixMatches, InstanceMatch),
        (InvalidEvent, InvalidInstance, ReentrantCall), intern | None, as_keys | None) */
static PyObject *Core_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    Py_ssize_t key_len, max_entries;
    PyObject *page_size, *tier_bit, *rank, *known, *ids, *invalid_event, *invalid_instance;
    PyObject *reentered;
    PyObject *intern, *as_keys;
    PyTypeObject *stored, *removed, *cleared, *matches_type, *match_type;
    if (kwds && PyDict_GET_SIZE(kwds)) {
        PyErr_SetString(PyExc_TypeError, "Core takes positional arguments only");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "nO!nO!O!UO!(O!O!O!O!O!)(OOO)OO:Core", &key_len, &PyLong_Type,
                          &page_size, &max_entries, &PyDict_Type, &tier_bit, &PyTuple_Type, &rank,
                          &known, &PyDict_Type, &ids, &PyType_Type, &stored, &PyType_Type,
                          &removed, &PyType_Type, &cleared, &PyType_Type, &matches_type,
                          &PyType_Type, &match_type, &invalid_event, &invalid_instance,
                          &reentered, &intern, &as_keys))
        return NULL;
    Py_ssize_t tiers = PyTuple_GET_SIZE(rank);
    if (!named_tuple_type(matches_type) || !named_tuple_type(match_type)) {
        PyErr_SetString(PyExc_TypeError, "result types must be plain tuple subclasses");
        return NULL;
    }
    if (PyDict_GET_SIZE(tier_bit) != tiers || tiers < 1 || tiers > 31) {
        PyErr_SetString(PyExc_ValueError, "tier_bit and rank must name the same 1..31 tiers");
        return NULL;
    }
    for (Py_ssize_t t = 0; t < tiers; t++) {
        PyObject *bit = PyDict_GetItemWithError(tier_bit, PyTuple_GET_ITEM(rank, t));
        if (!bit || PyLong_AsLongLong(bit) != (1LL << t)) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "tier_bit[rank[t]] must be 1 << t");
            return NULL;
        }
    }
    if (!PyExceptionClass_Check(invalid_event) || !PyExceptionClass_Check(invalid_instance) ||
        !PyExceptionClass_Check(reentered)) {
        PyErr_SetString(PyExc_TypeError, "errors must be exception classes");
        return NULL;
    }
    CoreObject *c = (CoreObject *)type->tp_alloc(type, 0);
    if (!c) return NULL;
    c->x = ix_new(key_len, tiers, max_entries > 0 ? max_entries : 0);
    c->uniform = (PyObject **)PyMem_Calloc((size_t)(tiers * UNIFORM_RUNS), sizeof(PyObject *));
    if (c->x) {
        c->x->res = (int32_t *)malloc(3 * 64 * sizeof(int32_t));
        c->x->pages = (uint8_t *)malloc(4096);
        c->x->res_cap = c->x->res ? 3 * 64 : 0;
        c->x->page_cap = c->x->pages ? 4096 : 0;
    }
    c->page_size = Py_NewRef(page_size);
    c->ids = Py_NewRef(ids);
    c->tier_bit = Py_NewRef(tier_bit);
    c->rank = Py_NewRef(rank);
    c->known = Py_NewRef(known);
    c->stored = (PyTypeObject *)Py_NewRef(stored);
    c->removed = (PyTypeObject *)Py_NewRef(removed);
    c->cleared = (PyTypeObject *)Py_NewRef(cleared);
    c->matches_type = (PyTypeObject *)Py_NewRef(matches_type);
    c->match_type = (PyTypeObject *)Py_NewRef(match_type);
    c->invalid_event = Py_NewRef(invalid_event);
    c->invalid_instance = Py_NewRef(invalid_instance);
    c->reentered = Py_NewRef(reentered);
    c->intern = intern == Py_None ? NULL : Py_NewRef(intern);
    c->as_keys = as_keys == Py_None ? NULL : Py_NewRef(as_keys);
    if (!c->x || !c->uniform || !c->x->res || !c->x->pages) {
        Py_DECREF(c);
        if (key_len < 1 || key_len > KEY_MAX)
            PyErr_Format(PyExc_ValueError, "key_len must be 1..%d", KEY_MAX);
        else
            PyErr_NoMemory();
        return NULL;
    }
    return (PyObject *)c;
}

/* The callbacks are the index's bound methods, and the index holds this core: a cycle the
   garbage collector must see. */
static int Core_traverse(CoreObject *c, visitproc visit, void *arg) {
    Py_VISIT(c->intern);
    Py_VISIT(c->as_keys);
    Py_VISIT(c->ids);
    return 0;
}

static int Core_clear(CoreObject *c) {
    Py_CLEAR(c->intern);
    Py_CLEAR(c->as_keys);
    return 0;
}

static void Core_dealloc(CoreObject *c) {
    PyObject_GC_UnTrack(c);
    Core_clear(c);
    ix_free(c->x);
    for (Py_ssize_t i = 0; i < c->names_cap; i++) Py_XDECREF(c->names[i]);
    PyMem_Free(c->names);
    if (c->uniform && c->rank)
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(c->rank) * UNIFORM_RUNS; i++)
            Py_XDECREF(c->uniform[i]);
    PyMem_Free(c->uniform);
    PyMem_Free(c->spec);
    Py_XDECREF(c->page_size);
    Py_XDECREF(c->ids);
    Py_XDECREF(c->tier_bit);
    Py_XDECREF(c->rank);
    Py_XDECREF(c->known);
    Py_XDECREF(c->stored);
    Py_XDECREF(c->removed);
    Py_XDECREF(c->cleared);
    Py_XDECREF(c->matches_type);
    Py_XDECREF(c->match_type);
    Py_XDECREF(c->invalid_event);
    Py_XDECREF(c->invalid_instance);
    Py_XDECREF(c->reentered);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static PyMethodDef Core_methods[] = {
    {"apply", (PyCFunction)(void (*)(void))Core_apply, METH_FASTCALL, NULL},
    {"find_matches", (PyCFunction)(void (*)(void))Core_find_matches,
     METH_FASTCALL | METH_KEYWORDS, NULL},
    {"lengths", (PyCFunction)Core_lengths, METH_O, NULL},
    {"set_name", (PyCFunction)(void (*)(void))Core_set_name, METH_FASTCALL, NULL},
    {"drop", (PyCFunction)Core_drop, METH_O, NULL},
    {"holdings", (PyCFunction)Core_holdings, METH_O, NULL},
    {"stats", (PyCFunction)Core_stats, METH_NOARGS, NULL},
    {"check", (PyCFunction)Core_check, METH_NOARGS, NULL},
    {"hashes", (PyCFunction)Core_hashes, METH_O, NULL},
    {"match_count", (PyCFunction)Core_match_count, METH_O, NULL},
    {"apply_keys", (PyCFunction)(void (*)(void))Core_apply_keys, METH_FASTCALL, NULL},
    {"fail_allocation", (PyCFunction)Core_fail_allocation, METH_O, NULL},
    {"hold", (PyCFunction)Core_hold, METH_NOARGS, NULL},
    {"release", (PyCFunction)Core_release, METH_NOARGS, NULL},
    {"__enter__", (PyCFunction)Core_hold, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)(void (*)(void))Core_exit, METH_FASTCALL, NULL},
    {"apply_held", (PyCFunction)(void (*)(void))Core_apply_held, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvstrata.prefix_index._core.Core",
    .tp_basicsize = sizeof(CoreObject),
    .tp_dealloc = (destructor)Core_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = (traverseproc)Core_traverse,
    .tp_clear = (inquiry)Core_clear,
    .tp_free = PyObject_GC_Del,
    .tp_doc = "One prefix index's entries (see index_ext.c).",
    .tp_methods = Core_methods,
    .tp_new = Core_new,
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvstrata.prefix_index._core",
    .m_doc = "The prefix index's compiled core (kvstrata.prefix_index.native).",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__core(void) {
    s_page_keys = PyUnicode_InternFromString("page_keys");
    s_tier = PyUnicode_InternFromString("tier");
    s_tokens_per_page = PyUnicode_InternFromString("tokens_per_page");
    s_extra_key = PyUnicode_InternFromString("extra_key");
    s_cache_salt = PyUnicode_InternFromString("cache_salt");
    if (!s_page_keys || !s_tier || !s_tokens_per_page || !s_extra_key || !s_cache_salt ||
        PyType_Ready(&CoreType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (!m) return NULL;
    if (PyModule_AddObjectRef(m, "Core", (PyObject *)&CoreType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

